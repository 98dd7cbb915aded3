"""Padding-free training equals the padded computation: log-probs, entropy, values, gradients and updates."""

from __future__ import annotations

import random

import pytest
import torch

from rlflow.engines.core import algorithms
from rlflow.engines.core.batch import shard_for_workers
from rlflow.engines.core.config import AlgorithmConfig, ModelConfig, TrainConfig
from rlflow.engines.models.hf import build_tiny_model, load_model, load_value_model
from rlflow.engines.models.packed import PackedLM, PackedRows
from rlflow.engines.train.microbatch import packed_micro_batches, token_budget_groups
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.conftest import assert_same_update

LENGTHS = [5, 17, 9, 30, 2, 23, 11, 30]


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory):
    """A Qwen2 model with grouped-query attention (2 KV heads for 4 query heads) and biases on q/k/v."""
    return str(build_tiny_model(ModelConfig(arch="qwen2", num_kv_heads=2), tmp_path_factory.mktemp("qwen2"), 0))


def _padded(vocab: int, lengths=LENGTHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[i, :n] = 1
    return ids, attn


def _reference(model, ids, attn, temperature):
    """log p and entropy [rows, width] from the HF model's own padded forward (column 0 and padding: 0)."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=attn, position_ids=pos).logits[:, :-1].float() / temperature
    lp, ent = torch.zeros(ids.shape), torch.zeros(ids.shape)
    lp[:, 1:] = algorithms.token_logprobs(logits, ids[:, 1:])
    ent[:, 1:] = algorithms.entropy_from_logits(logits)
    return lp * attn, ent * attn


@pytest.mark.parametrize("arch,entropy_in_loss", [("llama", True), ("qwen2", True), ("qwen2", False)])
def test_packed_logprobs_entropy_and_grads_equal_padded(arch, entropy_in_loss, tiny_model_dir, gqa_model_dir):
    path = tiny_model_dir if arch == "llama" else gqa_model_dir
    ref, model = load_model(path), load_model(path)
    ids, attn = _padded(ref.config.vocab_size)
    lp_ref, ent_ref = _reference(ref, ids, attn, 0.7)
    packed = PackedRows.from_padded(ids, attn)
    assert packed.input_ids.numel() == sum(LENGTHS)  # no padding token is computed
    lp, ent = PackedLM(model, chunk_tokens=16)(packed, 0.7, with_entropy=True)  # several head chunks
    lp, ent = packed.unpack(lp), packed.unpack(ent)
    assert (lp - lp_ref).abs().max() <= 1e-5 and (ent - ent_ref).abs().max() <= 1e-5
    weights = torch.randn(ids.shape)  # a loss that touches every position
    ((lp * weights).sum() + (ent.sum() if entropy_in_loss else 0)).backward()
    ((lp_ref * weights).sum() + (ent_ref.sum() if entropy_in_loss else 0)).backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name


def test_compiled_layers_equal_eager_and_compile_once_for_every_layer_and_length(gqa_model_dir, monkeypatch):
    """train.compile (each decoder layer compiled, dynamic shapes): the same log-probs, entropy and gradients as
    eager, and one captured graph serves all layers and packed lengths. A regression: transformers' KV cache,
    built in training forwards too, put per-layer state in the compile guards, so every layer recompiled until
    dynamo's limit (8) and the rest ran eagerly. The graphs run through aot_eager (dynamo's capture and the
    autograd graph, no code generation: seconds instead of a C++ build on every run); the generated kernels'
    numbers are checked on a GPU (bench/train/fsdp_check.py)."""
    import functools  # only here: this test compiles through a backend of its own

    import torch._dynamo  # the compile counters (imported here: only this test reads them)
    import torch._dynamo.utils

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    eager, model = load_model(gqa_model_dir), load_model(gqa_model_dir)
    compiled = PackedLM(model, chunk_tokens=16, compile_layers=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for seed, lengths in ((0, LENGTHS), (1, [7, 3, 26])):
        ids, attn = _padded(eager.config.vocab_size, lengths, seed)
        packed = PackedRows.from_padded(ids, attn)
        lp_ref, ent_ref = PackedLM(eager, chunk_tokens=16)(packed, 0.7, with_entropy=True)
        lp, ent = compiled(packed, 0.7, with_entropy=True)
        assert (lp - lp_ref).abs().max() <= 1e-5 and (ent - ent_ref).abs().max() <= 1e-5
        weights = torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed))
        ((lp * weights).sum() + ent.sum()).backward()
        ((lp_ref * weights).sum() + ent_ref.sum()).backward()
    for (name, a), b in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert (a.grad - b.grad).norm() <= 1e-5 * b.grad.norm(), name
    assert model.config.num_hidden_layers > 1
    assert torch._dynamo.utils.counters["frames"]["total"] == 1, dict(torch._dynamo.utils.counters["frames"])


def test_the_cudnn_kernels_one_sample_call_lays_out_heads_and_tokens_as_the_varlen_path():
    """train.attention_kernel cudnn's call (_cudnn_one_sample: [T, H, D] to SDPA's [1, H, T, D] and back, grouped
    heads repeated), run here on the CPU's flash kernel (the backends it asks for, in order): the varlen path's
    output for one causal sample, with its gradients. The cuDNN kernel itself needs a GPU."""
    from rlflow.engines.models.packed import _cudnn_one_sample, causal_varlen_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(37, 4, 16), torch.randn(37, 2, 16), torch.randn(37, 2, 16)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _cudnn_one_sample(*ours, 0.25)
    want = causal_varlen_attention(*ref, torch.tensor([0, 37], dtype=torch.int32), 37, 0.25)
    assert out.shape == (37, 4, 16) and torch.allclose(out, want, atol=1e-6)
    out.square().sum().backward()
    want.square().sum().backward()
    assert all(torch.allclose(a.grad, b.grad, atol=1e-5) for a, b in zip(ours, ref, strict=True))


def test_packed_values_equal_padded(gqa_model_dir):
    ref, critic = load_value_model(gqa_model_dir), load_value_model(gqa_model_dir)
    head = torch.randn_like(ref.score.weight)  # a head that is not zero, so the comparison means something
    with torch.no_grad():
        for m in (ref, critic):
            m.score.weight.copy_(head)
    ids, attn = _padded(ref.config.vocab_size)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    expected = torch.zeros(ids.shape)
    expected[:, 1:] = ref(ids, attention_mask=attn, position_ids=pos).logits[:, :-1, 0]
    packed = PackedRows.from_padded(ids, attn)
    values = packed.unpack(PackedLM(critic)(packed)[0])
    assert (values - expected * attn).abs().max() <= 1e-5


def _rl_batch(vocab: int, n: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    lengths = [rng.randint(4, 40) for _ in range(n)]
    ids, attn = _padded(vocab, lengths, seed)
    prompt = torch.tensor([min(3, n_ - 1) for n_ in lengths])
    loss_mask = (attn.bool() & (torch.arange(ids.shape[1])[None] >= prompt[:, None])).float()
    g = torch.Generator().manual_seed(seed)
    old = (-torch.rand(ids.shape, generator=g) * 3) * loss_mask
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "old_logprobs": old,
            "advantages": torch.randn(n, generator=g)}


@pytest.mark.parametrize("loss_agg", algorithms.LOSS_AGG_MODES)
def test_token_budget_micro_batches_take_the_same_step(tiny_model_dir, loss_agg):
    """A token budget that splits the batch into several packed micro-batches changes nothing: same loss,
    grad norm and updated weights as the whole batch in one micro-batch, for every loss aggregation."""
    algo = AlgorithmConfig(loss_agg=loss_agg)
    whole = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1, micro_batch_size=64), algo, norm_len=40)
    budget = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1, micro_batch_tokens=60), algo, norm_len=40)
    batch = _rl_batch(whole.model.config.vocab_size)
    assert len(budget.micro_batches(batch)) >= 5 and len(whole.micro_batches(batch)) == 1
    start = {n: t.clone() for n, t in whole.named_tensors()}
    m1, m2 = whole.train_step(batch), budget.train_step(batch)
    assert_same_update(start, whole.named_tensors(), budget.named_tensors())
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6, abs=1e-6)  # rel: token_sum's loss is ~37 here
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    if loss_agg in ("token_mean", "token_sum"):  # a token-mean metric averages exactly over micro-batches
        assert m1["approx_kl_k1"] == pytest.approx(m2["approx_kl_k1"], rel=1e-6) and m1["approx_kl_k1"] != 0
    lp_whole, lp_budget = whole.forward_logprobs(batch), budget.forward_logprobs(batch)
    assert (lp_whole - lp_budget).abs().max() <= 1e-5


def test_token_budget_groups_respect_their_caps():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
        max_tokens, max_rows = rng.choice([0, 50, 400, 1000]), rng.choice([0, 1, 3, 64])
        groups = token_budget_groups(lengths, max_tokens, max_rows)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every sample once
        for g in groups:
            assert not max_rows or len(g) <= max_rows
            assert not max_tokens or len(g) == 1 or sum(lengths[i] for i in g) <= max_tokens
    # few groups, evenly filled: 64 samples of 300-2,000 tokens under an 8,192 budget
    lengths = [rng.randint(300, 2000) for _ in range(64)]
    groups = token_budget_groups(lengths, 8192)
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert len(groups) <= -(-sum(lengths) // 8192) + 1 and max(sums) - min(sums) < 1000


def test_packed_micro_batches_cut_each_group_to_its_longest_row():
    """One grouping for the torch and Megatron backends: rows cut to their group's longest length;
    min_length=1 (Megatron) gives an empty row one token of width, 0 (torch) keeps it at zero."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    batch = {"input_ids": torch.arange(16).view(4, 4), "attention_mask": mask, "adv": torch.arange(4.0)}
    groups = packed_micro_batches(batch, max_tokens=3, max_rows=2)
    assert [rows for rows, _ in groups] == token_budget_groups([3, 1, 0, 2], 3, 2)
    for rows, part in groups:
        width = max(int(mask[i].sum()) for i in rows)
        assert torch.equal(part["input_ids"], batch["input_ids"][rows][:, :width])
        assert torch.equal(part["adv"], batch["adv"][rows])
    alone = packed_micro_batches({"input_ids": batch["input_ids"][2:3], "attention_mask": mask[2:3]})
    assert alone[0][1]["input_ids"].shape == (1, 0)
    clamped = packed_micro_batches({"input_ids": batch["input_ids"][2:3], "attention_mask": mask[2:3]}, min_length=1)
    assert clamped[0][1]["input_ids"].shape == (1, 1)


def test_shards_balance_tokens_across_workers():
    lengths = [40, 3, 3, 3, 38, 2, 39, 1] * 2
    attn = torch.tensor([[1] * n + [0] * (40 - n) for n in lengths])
    batch = {"input_ids": attn.clone(), "attention_mask": attn, "advantages": torch.arange(16.0)}
    shards = shard_for_workers(batch, 2, 2)
    for m in range(2):  # each mini-batch: equal sample counts, tokens within one long sample of each other
        tokens = [int(s["attention_mask"][4 * m : 4 * m + 4].sum()) for s in shards]
        assert abs(tokens[0] - tokens[1]) <= 40
    # every sample once, each in its own mini-batch
    seen = sorted(int(a) for s in shards for a in s["advantages"])
    assert seen == list(range(16))
    assert all(set(s["advantages"][:4].tolist()) <= set(range(8)) for s in shards)
