"""The Megatron backend on CPU: HF <-> Megatron weights bit-exact at TP=1 and TP=2 (2 gloo processes), the same
logits as the HF model, and the same logprobs, updates and checkpoints as the torch backend, at TP, PP and DP=2.

The mapping tests need only torch; the rest skip without megatron-core (the `megatron` extra).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3MoeConfig,
)

from rlflow.engines.core.batch import shard_for_workers
from rlflow.engines.core.config import AlgorithmConfig, DistillConfig, MegatronConfig
from rlflow.engines.core.protocols import TrainBackend
from rlflow.engines.models.moe import checkpoint_named, is_moe
from rlflow.engines.train.megatron import fused_kernels
from rlflow.engines.train.megatron.hf_config import UnsupportedModel, spec_from_hf
from rlflow.engines.train.megatron.microbatch import Micro, gather_rows, micro_batches, plan_micro_batches
from rlflow.engines.train.megatron.weights import (
    hf_to_megatron_state,
    megatron_to_hf_state,
    model_rules,
    to_megatron,
)
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.megatron_helpers import (
    backends_in_turn_worker,
    global_metrics,
    parallel_layouts_worker,
    tiny_hf_model,
    toy_batch,
    train_config,
)

CASES = [("llama", False), ("qwen2", True), ("qwen3", False), ("mixtral", False), ("qwen3_moe", True)]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """family -> (directory, state dict as saved: a tied model has no lm_head)."""
    out = {}
    for family, tied in CASES:
        path = tmp_path_factory.mktemp(family)
        state = tiny_hf_model(path, family, tied=tied)
        out[family] = (str(path), load_file(str(path / "model.safetensors")))
        names = set(checkpoint_named(state, family))
        assert set(out[family][1]) == names - ({"lm_head.weight"} if tied else set())
    return out


def _spec(path: str):
    return spec_from_hf(AutoConfig.from_pretrained(path))


# ----------------------------------------------------------------------------- config and mapping (torch only)


def test_spec_maps_each_family(hf_models):
    llama, qwen2, qwen3 = (_spec(hf_models[f][0]) for f in ("llama", "qwen2", "qwen3"))
    assert (llama.qkv_bias, llama.qk_norm, llama.tied_embeddings) == (False, False, False)
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.tied_embeddings) == (True, False, True)
    assert (qwen3.qkv_bias, qwen3.qk_norm) == (False, True)
    assert llama.head_dim == 24 and llama.num_kv_heads == 2 and llama.transformer_kwargs()["kv_channels"] == 24
    assert llama.transformer_kwargs()["hidden_dropout"] == 0.0  # megatron's default is 0.1
    mixtral, qwen3_moe = _spec(hf_models["mixtral"][0]), _spec(hf_models["qwen3_moe"][0])
    assert (mixtral.num_experts, mixtral.moe_top_k, mixtral.moe_ffn_hidden_size, mixtral.qk_norm) == (4, 2, 32, False)
    assert (qwen3_moe.qk_norm, qwen3_moe.tied_embeddings, qwen3_moe.moe_renormalize) == (True, True, False)
    # renormalised top-k = softmax over the top-k logits (megatron's default); without, softmax first
    assert mixtral.transformer_kwargs()["moe_router_pre_softmax"] is False
    assert qwen3_moe.transformer_kwargs()["moe_router_pre_softmax"] is True
    assert "num_moe_experts" not in llama.transformer_kwargs()


@pytest.mark.parametrize("config, message", [
    (Qwen2Config(use_sliding_window=True, sliding_window=16), "sliding"),
    (LlamaConfig(attention_bias=True), "attention_bias"),
    (LlamaConfig(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "yarn"),
    (LlamaConfig(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                  "rope_theta": 5e5}), "low_freq_factor"),
    (MistralConfig(), "model_type"),
    (Qwen3MoeConfig(mlp_only_layers=[0]), "mlp_only_layers"),
    (Qwen3MoeConfig(decoder_sparse_step=2), "decoder_sparse_step"),
    (MixtralConfig(router_jitter_noise=0.1), "router_jitter_noise"),
    (MixtralConfig(sliding_window=4096), "sliding_window"),
])
def test_features_the_mapping_cannot_reproduce_are_errors(config, message):
    with pytest.raises(UnsupportedModel, match=message):
        spec_from_hf(config)


def test_llama3_rope_scaling_is_mapped():
    cfg = LlamaConfig(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                       "rope_theta": 5e5})
    kw = spec_from_hf(cfg).gpt_kwargs()
    assert (kw["rope_scaling"], kw["rope_scaling_factor"], kw["rotary_base"]) == (True, 8.0, 5e5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_state_dict_round_trip_is_bit_exact(hf_models, family, tp):
    path, hf = hf_models[family]
    spec = _spec(path)
    shards = [hf_to_megatron_state(hf, spec, tp, r) for r in range(tp)]
    back = megatron_to_hf_state(shards, spec)
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    # shards have the shapes of a TP-split model
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((4 + 2 * 2) * 24 // tp, 64)
    assert shards[0]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 4 * 24 // tp)


def test_fused_layouts_follow_megatron():
    """linear_qkv groups [q heads of group g, k_g, v_g]; linear_fc1 on TP rank r is cat(gate_r, up_r)."""
    spec = spec_from_hf(LlamaConfig(hidden_size=8, intermediate_size=4, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=1, vocab_size=4))
    rules = {r.megatron: r for r in model_rules(spec)}
    q, k, v = torch.tensor([[0.0], [1], [2], [3]]), torch.tensor([[10.0], [11]]), torch.tensor([[20.0], [21]])
    qkv = to_megatron(rules["decoder.layers.0.self_attention.linear_qkv.weight"], [q, k, v], spec)
    assert qkv.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    gate, up = torch.arange(4.0)[:, None], torch.arange(10.0, 14.0)[:, None]
    fc1 = rules["decoder.layers.0.mlp.linear_fc1.weight"]
    assert to_megatron(fc1, [gate, up], spec, tp=2, rank=1).flatten().tolist() == [2, 3, 12, 13]


def test_micro_batches_keep_to_the_token_budget():
    batch = toy_batch(n=8)
    lengths = batch["attention_mask"].sum(-1)
    parts = micro_batches(batch, max_rows=3, max_tokens=24)
    assert sum(p["input_ids"].shape[0] for p in parts) == 8
    for p in parts:
        rows, width = p["input_ids"].shape
        assert rows <= 3 and (rows == 1 or rows * width <= 24)
        assert width == int(p["attention_mask"].sum(-1).max())  # cut to the group's longest row
    assert torch.equal(torch.cat([p["attention_mask"].sum(-1) for p in parts]), lengths)  # order kept
    padded = plan_micro_batches(batch, max_rows=3, max_tokens=24, packed=False)
    rebuilt = gather_rows([(m.rows, m.batch["input_ids"]) for m in padded], 8, batch["input_ids"].shape[1])
    assert torch.equal(rebuilt.long() * batch["attention_mask"], batch["input_ids"] * batch["attention_mask"])
    assert all(p["input_ids"].shape[1] % 4 == 0 for p in micro_batches(batch, 3, 0, multiple=4))


def test_packed_micro_batches_keep_to_the_token_budget_and_cover_every_row():
    batch = toy_batch(n=8)
    lengths = batch["attention_mask"].sum(-1)
    micro = plan_micro_batches(batch, max_rows=4, max_tokens=20, packed=True)
    assert sorted(r for m in micro for r in m.rows) == list(range(8))
    for m in micro:
        assert len(m.rows) <= 4 and (len(m.rows) == 1 or len(m.packed.input_ids) <= 20)
        assert len(m.packed.input_ids) == int(lengths[m.rows].sum())  # no padding in the stream
        assert torch.equal(m.packed.unpack(m.packed.input_ids), m.batch["input_ids"] * m.batch["attention_mask"])
    rebuilt = gather_rows([(m.rows, m.batch["input_ids"]) for m in micro], 8, batch["input_ids"].shape[1])
    assert torch.equal(rebuilt.long() * batch["attention_mask"], batch["input_ids"] * batch["attention_mask"])


# ----------------------------------------------------------------------------- megatron-core on CPU


def _backend(path, train=None, algo=None, megatron=None, **kw):
    from rlflow.engines.train.megatron.backend import MegatronTrainBackend

    return MegatronTrainBackend(path, train or train_config(), algo or AlgorithmConfig(), megatron, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_gptmodel_round_trip_and_logits_match_hf(hf_models, mcore, family):
    """HF -> GPTModel (TP=1) -> HF is bit-exact, and the GPTModel computes the HF model's logits (MoE families:
    through megatron's MoE layer, router and experts)."""
    path, hf = hf_models[family]
    backend = _backend(path)
    exported = dict(backend.named_tensors())
    assert set(exported) == set(hf)
    for name, t in hf.items():
        assert torch.equal(exported[name], t), name
    batch = toy_batch()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = ref(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        with backend_context(backend):
            logits = backend._run(backend.model, Micro(list(range(len(batch["input_ids"]))), batch))
    mask = batch["attention_mask"].bool()
    assert (logits[mask] - hf_logits[mask]).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_grouped_experts_compute_sequential_mlps_outputs_and_gradients(hf_models, mcore, family):
    """The local spec's experts run as grouped matmuls (GroupedSequentialMLP): logits and every parameter's gradient
    equal megatron's SequentialMLP loop on the same weights within 1e-5 (fp32, CPU), and the grouped path is the one
    that ran."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from rlflow.engines.train.megatron.grouped_experts import GroupedSequentialMLP

    backend = _backend(hf_models[family][0])
    core = backend.core
    experts = [m for m in core.modules() if isinstance(m, GroupedSequentialMLP)]
    assert experts and all(e.grouped() for e in experts)
    batch = toy_batch()
    micro = Micro(list(range(len(batch["input_ids"]))), batch)
    mask = batch["attention_mask"].bool()

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # gradients land in DDP's main_grad buffers
        backend.model.zero_grad_buffer()
        with backend_context(backend):
            logits = backend._run(backend.model, micro)
            (logits[mask].float().logsumexp(-1).sum()).backward()
        return logits.detach(), {n: p.main_grad.clone() for n, p in core.named_parameters()}

    grouped_logits, grouped_grads = run()
    for e in experts:
        e.__class__ = SequentialMLP
    loop_logits, loop_grads = run()
    assert (grouped_logits - loop_logits)[mask].abs().max() < 1e-5
    assert any(g.abs().max() > 0 for n, g in grouped_grads.items() if ".local_experts." in n)
    for name, g in loop_grads.items():
        assert (grouped_grads[name] - g).abs().max() <= 1e-5 * max(1.0, float(g.abs().max())), name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_and_packed_attention_match_megatrons_unfused(hf_models, mcore, family):
    """The SDPA core attention (padded rows, and packed THD streams) computes what megatron's own
    DotProductAttention computes, and the backend's logprobs agree across the three (fp32, CPU)."""
    path = hf_models[family][0]
    batch = toy_batch()
    mask = batch["attention_mask"].bool()
    results = {}
    for attention, packing in (("unfused", False), ("sdpa", False), ("sdpa", True)):
        backend = _backend(path, megatron=MegatronConfig(attention=attention, packing=packing,
                                                         micro_batch_tokens=30))
        core = backend.core.decoder.layers[0].self_attention.core_attention
        assert type(core).__name__ == ("DotProductAttention" if attention == "unfused" else "SDPAttention")
        results[attention, packing] = backend.forward_logprobs(batch)
    ref = results["unfused", False]
    for key, lp in results.items():
        assert (lp - ref)[mask].abs().max() < 1e-5, key
    assert (results["sdpa", True][~mask] == 0).all()  # packed: padding never ran


def test_moe_at_tensor_parallel_needs_sequence_parallel_and_transformer_engine(hf_models):
    from rlflow.engines.train.megatron.weights import check_moe_tensor_parallel

    moe, dense = _spec(hf_models["mixtral"][0]), _spec(hf_models["llama"][0])
    with pytest.raises(ValueError, match="tensor_parallel=2 with an MoE model .* sequence parallelism"):
        check_moe_tensor_parallel(moe, 2, None, False)
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        check_moe_tensor_parallel(moe, 2, False, True)
    check_moe_tensor_parallel(moe, 2, True, True)
    check_moe_tensor_parallel(moe, 1, False, False)
    check_moe_tensor_parallel(dense, 2, False, False)


def test_expert_parallel_layouts_that_cannot_work_are_errors(hf_models, mcore):
    from rlflow.engines.train.megatron.model_build import transformer_config

    with pytest.raises(ValueError, match="megatron.expert_parallel=2: the llama model has no experts"):
        transformer_config(_spec(hf_models["llama"][0]), MegatronConfig(expert_parallel=2), torch.float32, "cpu")
    with pytest.raises(ValueError, match="megatron.expert_parallel=3 does not divide 4 experts"):
        transformer_config(_spec(hf_models["mixtral"][0]), MegatronConfig(expert_parallel=3), torch.float32, "cpu")
    with pytest.raises(ValueError, match="expert_model_parallel_size are set by the backend"):
        transformer_config(_spec(hf_models["mixtral"][0]),
                           MegatronConfig(transformer={"expert_model_parallel_size": 2}), torch.float32, "cpu")


def test_fused_attention_refuses_what_it_does_not_compute(hf_models, mcore):
    with pytest.raises(ValueError, match="attention_dropout"):
        _backend(hf_models["llama"][0], megatron=MegatronConfig(transformer={"attention_dropout": 0.1}))
    with pytest.raises(ValidationError, match="megatron.packing: true needs megatron.attention: sdpa"):
        MegatronConfig(attention="unfused", packing=True)


def backend_context(backend):
    from rlflow.engines.train.megatron.cpu import device_context

    return device_context(backend.device)


@pytest.mark.parametrize("algo, budget, packing", [
    (AlgorithmConfig(clip_high=0.28), 20, True),
    (AlgorithmConfig(clip_high=0.28), 20, False),  # padded micro-batches take the packed ones' step
    # per-token metrics (approx_kl, clip_frac) of a sequence-mean loss depend on the micro-batch grouping in
    # both backends, so this case groups rows as the torch backend does
    (AlgorithmConfig(loss_agg="seq_mean_token_mean", kl_coef=0.1, entropy_coef=0.01), 0, True),
    # token_sum: the micro-batches' sums add up unscaled (and so do the loss metrics), the token means still average
    (AlgorithmConfig(loss_agg="token_sum", entropy_coef=0.01), 20, True),
])
def test_backend_matches_torch_backend(hf_models, mcore, algo, budget, packing):
    """Same logprobs, metrics and updates as TorchTrainBackend over 2 iterations x 2 mini-batches (micro-batches
    of at most 3 rows on both sides, and at most `budget` tokens on the Megatron side, whose fp32 log-softmax runs
    7 tokens at a time, recomputed in the backward)."""
    path = hf_models["llama"][0]
    torch_be = TorchTrainBackend(path, train_config(), algo)
    mega = _backend(path, train_config(logprob_chunk_tokens=7), algo,
                    MegatronConfig(micro_batch_tokens=budget, packing=packing))
    train_alike(torch_be, mega)


def train_alike(torch_be, mega, stepped_tol: float = 1e-5) -> None:
    """Two RL iterations on toy_batch(): the same logprobs, metrics and updated weights from both backends.
    `stepped_tol`: the logprob bound after the first step (before it, 1e-5)."""
    batch = toy_batch()
    mask = batch["attention_mask"].bool()
    for iteration in range(2):
        lp_t, lp_m = torch_be.forward_logprobs(batch), mega.forward_logprobs(batch)
        assert (lp_t - lp_m)[mask].abs().max() < (1e-5 if iteration == 0 else stepped_tol)
        step = {**batch, "old_logprobs": lp_t + 0.05 * torch.randn_like(lp_t)}
        m_t, m_m = global_metrics(torch_be.train_step(step)), global_metrics(mega.train_step(step))
        assert set(m_t) == set(m_m)
        for k in m_t:  # a loss near 0 sums per-token terms of ~0.1-1 that nearly cancel: its fp32 rounding in
            # two different kernels (packed vs Megatron's padded) is ~1e-6 absolute, whatever the loss's size
            assert m_m[k] == pytest.approx(m_t[k], rel=1e-4, abs=5e-6), k
    assert_same_weights(dict(torch_be.named_tensors()), dict(mega.named_tensors()))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_backend_matches_torch_backend(hf_models, mcore, family):
    """An MoE model through megatron's MoE layer (router, top-2 of 4 experts, all-to-all dispatcher) takes the
    HF model's steps in the torch backend: logprobs, metrics and updated weights, packed micro-batches of at
    most 20 tokens."""
    path = hf_models[family][0]
    algo = AlgorithmConfig(clip_high=0.28, entropy_coef=0.01)
    torch_be = TorchTrainBackend(path, train_config(), algo)
    mega = _backend(path, train_config(), algo, MegatronConfig(micro_batch_tokens=20, packing=True))
    # both send the experts under the checkpoint's names (transformers 5 stacks them in the module)
    hf = hf_models[family][1]
    for be in (torch_be, mega):
        assert dict(be.weight_layout()).keys() == hf.keys()
        assert be.weight_shapes() == {n: list(t.shape) for n, t in hf.items()}
    sent = dict(torch_be.named_tensors())
    assert sent.keys() == hf.keys() and all(torch.equal(sent[n], t) for n, t in hf.items())
    # before a step the two agree to 5e-7 here; after one, Adam has divided each gradient by its own running RMS,
    # so an expert's weights that saw a few tokens move by up to lr on gradients that differ by rounding: Mixtral
    # measured 1.5e-5 on one CPU and under 1e-5 on another (fp32 kernels differ by instruction set)
    train_alike(torch_be, mega, stepped_tol=3e-5)


def test_backend_matches_torch_backend_with_whole_batch_is_weights(hf_models, mcore):
    """Sequence-level TIS with the session's whole-batch weights (is_weights) and the rollout engine's logprobs
    in the batch: both backends pass them to rl_loss alike (same metrics and update)."""
    path = hf_models["llama"][0]
    algo = AlgorithmConfig(is_correction="tis", is_level="sequence", is_batch_normalize=True)
    torch_be = TorchTrainBackend(path, train_config(), algo)
    mega = _backend(path, train_config(), algo, MegatronConfig(micro_batch_tokens=20))
    batch = toy_batch()
    lp = torch_be.forward_logprobs(batch)
    gen = torch.Generator().manual_seed(0)
    weights = (0.5 + torch.rand(lp.shape, generator=gen)) * batch["loss_mask"]
    step = {**batch, "old_logprobs": lp, "rollout_logprobs": lp + 0.05 * torch.randn(lp.shape, generator=gen),
            "is_weights": weights}
    m_t, m_m = global_metrics(torch_be.train_step(step)), global_metrics(mega.train_step(step))
    assert set(m_t) == set(m_m) and "is_weight_mean" in m_t
    for k in m_t:
        assert m_m[k] == pytest.approx(m_t[k], rel=1e-4, abs=5e-6), k
    assert_same_weights(dict(torch_be.named_tensors()), dict(mega.named_tensors()))


@pytest.mark.parametrize("distill", [DistillConfig(teacher_path="teacher"),  # added to PPO, policy-gradient form
                                     DistillConfig(teacher_path="teacher", mode="alone", estimator="k2",
                                                   policy_gradient=False)])
def test_distillation_term_matches_torch_backend(hf_models, mcore, distill):
    """On-policy distillation: both backends add the teacher term of rl_loss alike from the batch's
    teacher_logprobs (same distill_* metrics, loss and update)."""
    path = hf_models["llama"][0]
    torch_be = TorchTrainBackend(path, train_config(), AlgorithmConfig(), distill=distill)
    mega = _backend(path, train_config(), AlgorithmConfig(), MegatronConfig(micro_batch_tokens=20), distill=distill)
    batch = toy_batch()
    lp = torch_be.forward_logprobs(batch)
    gen = torch.Generator().manual_seed(1)
    step = {**batch, "old_logprobs": lp, "teacher_logprobs": lp - 0.3 * torch.rand(lp.shape, generator=gen)}
    m_t, m_m = global_metrics(torch_be.train_step(step)), global_metrics(mega.train_step(step))
    assert set(m_t) == set(m_m) and {"distill_kl", "distill_loss"} <= set(m_t)
    assert m_t["distill_loss"] > 0.05  # the teacher finds the student's tokens less likely (by 0.15 on average)
    for k in m_t:
        assert m_m[k] == pytest.approx(m_t[k], rel=1e-4, abs=5e-6), k
    assert_same_weights(dict(torch_be.named_tensors()), dict(mega.named_tensors()))


def test_sft_step_matches_torch_backend(hf_models, mcore):
    """sft_step: the same NLL, entropy and updates as TorchTrainBackend.sft_step (micro-batches of 3 rows)."""
    path = hf_models["llama"][0]
    torch_be = TorchTrainBackend(path, train_config(mini_batches=1), AlgorithmConfig())
    mega = _backend(path, train_config(mini_batches=1), AlgorithmConfig(), MegatronConfig(micro_batch_tokens=20))
    batch = toy_batch()
    losses = []
    for _ in range(2):
        m_t, m_m = global_metrics(torch_be.sft_step(batch)), global_metrics(mega.sft_step(batch))
        assert set(m_t) == set(m_m) == {"loss", "entropy", "grad_norm", "lr"}
        for k in m_t:
            assert m_m[k] == pytest.approx(m_t[k], rel=1e-4, abs=1e-6), k
        losses.append(m_t["loss"])
    assert losses[1] < losses[0]  # the first step lowered the NLL
    assert_same_weights(dict(torch_be.named_tensors()), dict(mega.named_tensors()))
    # an RL step after the SFT steps still reports the RL metrics
    assert "pg_loss" in global_metrics(mega.train_step({**batch, "old_logprobs": mega.forward_logprobs(batch)}))


def assert_same_weights(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Equal up to float noise. Adam turns noise on a gradient near 0 into a visible step on that one element
    (at most ~lr), so single elements get a loose bound and the bulk a tight one."""
    assert set(got) == set(ref)
    diffs = torch.cat([(ref[n] - got[n]).abs().flatten() for n in ref])
    assert diffs.mean() < 1e-6 and diffs.quantile(0.999) < 1e-5 and diffs.max() < 1e-3


def test_backends_built_one_after_another_keep_one_set_of_process_groups(hf_models, tmp_path):
    """Backends of one layout built one after another in a process share its megatron groups: no new gloo group,
    no new thread (each gloo group has three; rebuilding them per backend left 2,400 polling threads in the test
    process). Groups formed over a default group that is gone are replaced, and their threads end. In a process
    of its own (backends_in_turn_worker says why)."""
    out = tmp_path / "groups.json"
    mp.spawn(backends_in_turn_worker, args=(hf_models["qwen2"][0], str(out)), nprocs=1)
    seen = json.loads(out.read_text())
    first, fourth, again = seen["first"], seen["fourth"], seen["reinitialised"]
    assert fourth["groups"] == first["groups"] and fourth["threads"] <= first["threads"]
    # re-initialised: as many groups as before (the names restart), megatron's old 17 (51 threads) ended; torch
    # keeps the destroyed default group's store and one gloo group referenced (4 threads, once per
    # re-initialisation, not per backend)
    assert len(again["groups"]) == len(first["groups"]) and again["threads"] <= first["threads"] + 4


def test_model_shards_bad_input_is_an_error(hf_models, mcore, tmp_path):
    """A shard folder without files, or a shard without its offsets, names the folder or file; weights_only on
    the saving layout loads the trained weights and leaves the LR clock at 0."""
    from safetensors.torch import save_file

    from rlflow.engines.store.run_store import RunStore
    from rlflow.engines.train.megatron.shards import load_shards

    path, batch = hf_models["qwen2"][0], toy_batch()
    first = _backend(path)
    first.train_step(batch)
    first.save(tmp_path / "ckpt")
    other = _backend(path)
    other.load(tmp_path / "ckpt", weights_only=True)
    assert other.updates == 0
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first.named_tensors(), other.named_tensors(), strict=True))
    store = RunStore(str(tmp_path.parent), tmp_path.name)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_shards(other.core, store, "empty")
    (tmp_path / "bare").mkdir()
    save_file({"x": torch.zeros(2)}, str(tmp_path / "bare" / "shard-0.safetensors"))
    with pytest.raises(ValueError, match="shard-0.safetensors: no .* offsets"):
        load_shards(other.core, store, "bare")


def test_checkpoint_straight_to_the_run_store_resumes_exactly(hf_models, mcore, storage):
    """save(path, storage) puts every rank's files in the run store (a local one, and S3 through moto's server)
    with no local checkpoint folder; load(path, storage) reads them back (the model shards by ranged reads), and
    the next step equals never stopping. `model/` is the HF export, loadable as it is."""
    from rlflow.engines.store.run_store import RunStore

    path, batch = hf_models["qwen3"][0], toy_batch()
    first = _backend(path)
    first.train_step(batch)
    store = RunStore(storage, "run")
    target = store.begin_checkpoint(1)
    first.save(target, storage)
    files = store.files("checkpoints", 1)
    assert {"model/model.safetensors", "model/config.json", "model_shards/shard-0.safetensors",
            "optimizer/optimizer-0-0.safetensors", "trainer_rank0.json"} <= set(files), files
    expected = global_metrics(first.train_step(batch)), dict(first.named_tensors())
    second = _backend(path)
    second.load(target, storage)
    got = global_metrics(second.train_step(batch)), dict(second.named_tensors())
    assert got[0] == expected[0]
    assert all(torch.equal(got[1][n], t) for n, t in expected[1].items())


def optimizer_snapshot(backend) -> dict[str, torch.Tensor]:
    """Copies of this rank's optimizer state: each parameter's fp32 main weight, Adam moments and step."""
    from rlflow.engines.train.megatron.model_build import stage_params
    from rlflow.engines.train.megatron.optimizer_shards import STATES, param_states

    names = {p: n for n, p in stage_params(backend.core).items()}
    out = {}
    for p, state in param_states(backend.optimizer).items():
        out |= {f"{names[p]}:{k}": state.tensor(k).clone() for k in STATES if state.tensor(k) is not None}
        out[f"{names[p]}:step"] = torch.tensor(state.step())
    return out


def test_a_step_counted_per_group_is_saved_and_restored(hf_models, mcore, tmp_path):
    """TE's and apex's FusedAdam (what megatron picks where either is installed) count Adam's steps in the param
    group, not per parameter: the checkpoint reads that count and the moments, and restores both."""
    import json

    from rlflow.engines.train.megatron.optimizer_shards import param_states

    path, batch = hf_models["llama"][0], toy_batch()
    first = _backend(path, train_config(precision="bf16"))
    first.train_step(batch)  # two mini-batches: two optimizer steps
    for state in param_states(first.optimizer).values():  # as FusedAdam keeps it
        state.group["step"] = int(state.optimizer.state[state.main].pop("step"))
    first.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "trainer_rank0.json").read_text())["adam_step"] == 2
    second = _backend(path, train_config(precision="bf16"))
    for state in param_states(second.optimizer).values():
        state.group["step"] = 0
    second.load(tmp_path / "ckpt")
    a, b = optimizer_snapshot(first), optimizer_snapshot(second)
    assert all(s.group["step"] == 2 for s in param_states(second.optimizer).values())
    assert {k for k in a if not k.endswith(":step")} == {k for k in b if not k.endswith(":step")}
    assert all(torch.equal(a[k], b[k]) for k in a if k.endswith((":exp_avg", ":exp_avg_sq", ":param")))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpoint_resume_is_exact(hf_models, mcore, tmp_path, precision):
    """save -> load -> next step equals never stopping (bf16: the fp32 master weights come back too)."""
    path = hf_models["qwen3"][0]
    batch = toy_batch()
    batch = {**batch, "old_logprobs": batch["old_logprobs"] * 0.5}
    first = _backend(path, train_config(precision=precision))
    first.train_step(batch)
    first.save(tmp_path / "ckpt")
    expected = global_metrics(first.train_step(batch)), dict(first.named_tensors())
    resumed = _backend(path, train_config(precision=precision))
    resumed.load(tmp_path / "ckpt")
    got = global_metrics(resumed.train_step(batch)), dict(resumed.named_tensors())
    assert got[0] == expected[0]
    for name, t in expected[1].items():
        assert torch.equal(got[1][name], t), name
    # fp32 master weights and Adam moments, after the step, too (bf16 weights alone would hide a lost master copy)
    a, b = optimizer_snapshot(first), optimizer_snapshot(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the stored model is a plain HF checkpoint
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model")
    assert set(hf.state_dict()) >= set(expected[1])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_round_trip_is_exact(hf_models, mcore, precision):
    """Colocated offload of the megatron backend: optimizer state (bf16: the fp32 master weights too) parked, the
    gradient buffers freed, then the parameter buffers and the reference model; use refused while parked; after
    onload the next steps, weights and optimizer state equal a backend that never offloaded."""
    from rlflow.engines.train.megatron.backend import _optimizer_tensors

    path, batch = hf_models["qwen3"][0], toy_batch()
    algo, train = AlgorithmConfig(kl_coef=0.1), train_config(precision=precision)
    parked, plain = _backend(path, train, algo), _backend(path, train, algo)
    for b in (parked, plain):
        b.train_step(batch)
    assert parked.offload(keep_weights=True)["bytes"] > 0
    grads = [buf.grad_data for buf in parked.model.buffers]
    assert all(g.untyped_storage().nbytes() == 0 for g in grads)
    own = {p.untyped_storage().data_ptr() for p in parked._weight_tensors()}
    assert all(t.untyped_storage().nbytes() == 0 for t in _optimizer_tensors(parked.optimizer)
               if t.untyped_storage().data_ptr() not in own)
    assert dict(parked.named_tensors())  # a weight sync still reads the weights
    with pytest.raises(RuntimeError, match="train_step while its state is offloaded"):
        parked.train_step(batch)
    assert parked.offload()["bytes"] > 0
    assert all(p.untyped_storage().nbytes() == 0 for p in parked._weight_tensors())
    with pytest.raises(RuntimeError, match="forward_logprobs while its state is offloaded"):
        parked.forward_logprobs(batch)
    parked.onload()
    for _ in range(2):
        assert global_metrics(parked.train_step(batch)) == global_metrics(plain.train_step(batch))
    a, b = dict(parked.named_tensors()), dict(plain.named_tensors())
    assert all(torch.equal(a[n], b[n]) for n in b)
    a, b = optimizer_snapshot(parked), optimizer_snapshot(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def test_bf16_backend_stays_close_to_fp32(hf_models, mcore):
    path = hf_models["llama"][0]
    fp32 = TorchTrainBackend(path, train_config(), AlgorithmConfig())
    bf16 = _backend(path, train_config(precision="bf16"))
    batch = toy_batch()
    mask = batch["attention_mask"].bool()
    assert (fp32.forward_logprobs(batch) - bf16.forward_logprobs(batch))[mask].abs().max() < 2e-2
    metrics = bf16.train_step({**batch, "old_logprobs": fp32.forward_logprobs(batch)})
    assert all(math.isfinite(v) for v in metrics.values())
    assert {t.dtype for _, t in bf16.named_tensors()} == {torch.bfloat16}


def test_compiled_layers_train_like_eager_and_compile_once_for_every_layer(hf_models, mcore, tmp_path, monkeypatch):
    """train.compile on megatron's decoder layers: the same logprobs, loss and update as eager, and the layers share
    their compiled graphs (a 4-layer model then needs no graph the 2-layer one did not capture: nothing in a layer
    makes dynamo specialise on which layer it is). Packed streams keep megatron's THD rotary eager (it copies the sample
    lengths to the host). The graphs run through aot_eager (dynamo's capture and the autograd graph, no code
    generation); the generated kernels run on GPUs (bench/megatron/gpu.py, +compile variants)."""
    import functools  # only here: this test compiles through a backend of its own

    import torch._dynamo  # the compile counters (imported here: only this test reads them)
    import torch._dynamo.utils
    from megatron.core.models.common.embeddings import rope_utils  # only here: the rotary compile leaves eager

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    path, batch = hf_models["qwen2"][0], toy_batch()
    mask = batch["attention_mask"].bool()
    mcfg = MegatronConfig(micro_batch_tokens=40)
    eager = _backend(path, train_config(mini_batches=1), megatron=mcfg)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _backend(path, train_config(mini_batches=1, compile=True), megatron=mcfg)
    lp = eager.forward_logprobs(batch)
    assert (compiled.forward_logprobs(batch) - lp)[mask].abs().max() < 1e-5
    step = {**batch, "old_logprobs": lp + 0.05 * torch.randn_like(lp)}
    m_e, m_c = eager.train_step(step), compiled.train_step(step)
    assert m_c["loss"] == pytest.approx(m_e["loss"], rel=1e-4, abs=5e-6)
    # after the step, logprobs (not weights: Adam turns the rounding noise of a gradient that is 0 in exact
    # arithmetic, the key bias's, into steps of the learning rate, which no logprob sees)
    assert (compiled.forward_logprobs(batch) - eager.forward_logprobs(batch))[mask].abs().max() < 1e-5
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > 0
    # megatron's tensor-parallel deprecation warning no longer splits the layers (dynamo cannot trace warn)
    assert not [r for r in torch._dynamo.utils.counters["graph_break"] if "warn" in r], dict(
        torch._dynamo.utils.counters["graph_break"])
    tiny_hf_model(tmp_path, "qwen2", tied=True, layers=4)  # twice the layers: the same graphs serve them all
    deeper = _backend(str(tmp_path), train_config(mini_batches=1, compile=True), megatron=mcfg)
    deeper.train_step({**step, "old_logprobs": deeper.forward_logprobs(batch)})
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert rope_utils._apply_rotary_pos_emb_thd._rlflow_eager


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torch_fused_kernels_train_like_megatrons_own_fallbacks(hf_models, mcore, precision):
    """megatron.torch_fused_kernels (the default): the weight-gradient GEMMs accumulate into main_grad (through
    megatron's gradient_accumulation_fusion path, tied output weights included) and the inner AdamW is torch's
    fused one; two optimizer steps land where megatron-core's own fallbacks land. (On CPU the accumulation runs
    in fp32; the bf16 -> fp32 GEMM it uses on CUDA is checked by bench/megatron/gpu.py's first-step gradient
    norms of an uncompiled variant with and without +no-wgrad-fusion.)"""
    from megatron.core.tensor_parallel import layers  # only here: where the fusion flag lives

    path, batch = hf_models["qwen2"][0], toy_batch()  # qwen2's tiny model ties its output layer to the embedding
    mask = batch["attention_mask"].bool()
    ours = _backend(path, train_config(precision=precision))
    theirs = _backend(path, train_config(precision=precision), megatron=MegatronConfig(torch_fused_kernels=False))
    linears = [m for m in ours.core.modules() if isinstance(m, layers.ColumnParallelLinear | layers.RowParallelLinear)]
    assert linears and all(m.gradient_accumulation_fusion for m in linears)
    assert not any(m.gradient_accumulation_fusion for m in theirs.core.modules()
                   if isinstance(m, layers.ColumnParallelLinear | layers.RowParallelLinear))
    assert all(g["fused"] for g in ours.optimizer.param_groups) and not any(
        g.get("fused") for g in theirs.optimizer.param_groups)
    lp = ours.forward_logprobs(batch)
    step = {**batch, "old_logprobs": lp + 0.05 * torch.randn_like(lp)}
    m_o, m_t = ours.train_step(step), theirs.train_step(step)  # two mini-batches: two optimizer steps
    tol = 1e-5 if precision == "fp32" else 2e-2
    assert m_o["grad_norm"] == pytest.approx(m_t["grad_norm"], rel=tol)
    assert (ours.forward_logprobs(batch) - theirs.forward_logprobs(batch))[mask].abs().max() < tol


def test_foreach_norm_and_copies_match_megatrons_loops(mcore):
    """The multi-tensor stand-ins give what megatron-core's per-tensor fallbacks give: the L2 norm of a list of
    tensors, an in-place scale, a cast copy."""
    from megatron.core import utils  # only here: megatron's own fallbacks, the reference

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) for n in (3, 70, 1025)]
    flag = torch.zeros(1, dtype=torch.int)
    ours, _ = fused_kernels.l2_norm(0, flag, [grads], False)
    assert ours.shape == (1,) and ours.item() == pytest.approx(torch.cat(grads).norm().item(), rel=1e-6)
    scaled = [t.clone() for t in grads]
    fused_kernels.scale(0, flag, [scaled, scaled], 0.5)
    assert all(torch.equal(s, t * 0.5) for s, t in zip(scaled, grads, strict=True))
    ours_bf16, theirs_bf16 = ([torch.empty(t.shape, dtype=torch.bfloat16) for t in grads] for _ in range(2))
    fused_kernels.scale(0, flag, [grads, ours_bf16], 1.0)
    utils.local_multi_tensor_scale(0, flag, [grads, theirs_bf16], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(ours_bf16, theirs_bf16, strict=True))


def test_compile_refuses_transformer_engine_layers(hf_models, mcore):
    with pytest.raises(ValueError, match="train.compile compiles the local layer spec"):
        _backend(hf_models["llama"][0], train_config(compile=True), megatron=MegatronConfig(transformer_engine=True))


# ----------------------------------------------------------------------------- 2 gloo processes


@pytest.fixture(scope="module")
def parallel_runs(hf_models, tmp_path_factory, mcore):
    """Each 2-rank layout run once, one after the other in one pair of processes: (tp, pp) -> (results JSON,
    final weights)."""
    from rlflow.engines.cluster.addresses import free_port

    dirs = {f: p for f, (p, _) in hf_models.items()}
    targets = {layout: str(tmp_path_factory.mktemp(name) / "result.json")
               for layout, name in [((2, 1), "tp2pp1"), ((1, 2), "tp1pp2"), ((1, 1), "tp1pp1"), ("ep2", "ep2")]}
    tp2 = targets[2, 1] + ".ckpt"
    jobs = [dict(tp=tp, pp=pp, model_dir=dirs["qwen2"], hf_dirs=dirs, out=targets[tp, pp],
                 resume=tp2 if pp == 2 else "")  # PP=2 resumes the TP=2 run's checkpoint
            for tp, pp in [(2, 1), (1, 2), (1, 1)]]
    # expert parallelism: each of the 2 ranks (data-parallel 2) holds 2 of the 4 experts of an MoE model
    jobs.append(dict(tp=1, pp=1, model_dir=dirs["qwen3_moe"], hf_dirs=dirs, out=targets["ep2"], ep=2))
    mp.spawn(parallel_layouts_worker, args=(2, f"tcp://127.0.0.1:{free_port()}", jobs), nprocs=2)
    out = {}
    for layout, target in targets.items():
        out[layout] = json.loads(Path(target).read_text()), load_file(target + ".safetensors")
        key = ("ep2",) if layout == "ep2" else layout
        out["hf", *key], out["ckpt", *key] = Path(target + ".hf"), target + ".ckpt"
    out["tp2_ckpt"], out["model"] = tp2, dirs["qwen2"]
    return out


LAYOUTS = pytest.mark.parametrize("layout", [(2, 1), (1, 2), "ep2"], ids=["tp2", "pp2", "ep2"])


def _families(hf_models, layout):
    return {f: v for f, v in hf_models.items() if layout != "ep2" or is_moe(f)}


@LAYOUTS
def test_round_trip_through_sharded_model_is_bit_exact(parallel_runs, hf_models, layout):
    """HF weights loaded into a TP=2 (or PP=2, or expert-parallel 2) model and gathered back equal the HF tensors
    bit for bit."""
    results = parallel_runs[layout][0]["round_trip"]
    for family, (_, hf) in _families(hf_models, layout).items():
        assert results[family].pop("__count__") == len(hf)
        assert all(results[family].values()), [n for n, ok in results[family].items() if not ok]


@LAYOUTS
def test_hf_export_is_written_by_each_stage(parallel_runs, hf_models, layout):
    """save_hf writes the HF checkpoint from the shards: tensor-parallel halves rebuilt per tensor, each pipeline
    stage (or expert-parallel rank) its own files (never the whole model on one rank), an index naming each
    tensor's file; every tensor equals the HF original bit for bit and transformers loads the folder as it is."""
    key = ("hf", layout) if layout == "ep2" else ("hf", *layout)
    for family, (_, hf) in _families(hf_models, layout).items():
        folder = parallel_runs[key] / family
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert index.keys() == hf.keys()
        files = sorted(folder.glob("model-*-of-*.safetensors"))
        assert sorted(set(index.values())) == [f.name for f in files] and len(files) > 2
        written = {n: t for f in files for n, t in load_file(f).items()}
        assert written.keys() == hf.keys() and all(torch.equal(written[n], hf[n]) for n in hf), family
    family = "qwen3_moe" if layout == "ep2" else "qwen2"
    folder = parallel_runs[key] / family
    shutil.copy(Path(hf_models[family][0]) / "config.json", folder)
    ids = torch.tensor([[1, 5, 9, 2]])
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    original = AutoModelForCausalLM.from_pretrained(hf_models[family][0]).eval()
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, original(ids).logits)


def test_checkpoint_reshards_tp2_to_tp1_and_pp2(parallel_runs, mcore):
    """The TP=2 run's checkpoint (per-rank model shards, no gathered model read) loads at TP=1 (one process) and
    at PP=2: the trained weights bit for bit, the same fp32 logprobs."""
    weights = parallel_runs[(2, 1)][1]
    ckpt = Path(parallel_runs["tp2_ckpt"])
    (ckpt / "model" / "model.safetensors").unlink()  # the weights must come from the shards alone
    one = _backend(parallel_runs["model"], train_config(), megatron=MegatronConfig(packing=True))
    one.load(ckpt, weights_only=True)
    got = dict(one.named_tensors())
    assert got.keys() == weights.keys() and all(torch.equal(got[n], weights[n]) for n in weights)
    logprobs = one.forward_logprobs(toy_batch())
    pp2 = torch.tensor(parallel_runs[(1, 2)][0]["resumed_logprobs"])
    mask = toy_batch()["attention_mask"].bool()
    assert (logprobs - pp2)[mask].abs().max() <= 1e-6


@pytest.mark.parametrize("layout", [(2, 1), (1, 2), (1, 1), "ep2"], ids=["tp2", "pp2", "dp2", "ep2"])
def test_parallel_layouts_train_like_one_torch_worker(parallel_runs, hf_models, layout):
    """TP=2, PP=2, DP=2 (distributed optimizer) and, on an MoE model, DP=2 with expert parallelism 2 (tokens
    reach the other rank's experts by all-to-all) give the logprobs, metrics and weights of TorchTrainBackend on
    the whole batch."""
    results, weights = parallel_runs[layout]
    family = "qwen3_moe" if layout == "ep2" else "qwen2"
    path = hf_models[family][0]
    torch_be = TorchTrainBackend(path, train_config(), AlgorithmConfig())
    batch = toy_batch()
    logprobs = torch_be.forward_logprobs(batch)
    mask = batch["attention_mask"].bool()
    assert (torch.tensor(results["logprobs"]) - logprobs)[mask].abs().max() < 1e-5
    metrics = global_metrics(torch_be.train_step(shard_for_workers({**batch, "old_logprobs": logprobs}, 1, 2)[0]))
    for k, v in metrics.items():
        assert results["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert_same_weights(dict(torch_be.named_tensors()), weights)


@pytest.mark.parametrize("layout", [(2, 1), (1, 1), "ep2"], ids=["tp2", "dp2", "ep2"])
def test_checkpoint_resumes_with_its_optimizer_on_one_rank(parallel_runs, hf_models, mcore, layout):
    """A checkpoint of TP=2, of DP=2 (the distributed optimizer's ranges of each parameter) and of EP=2 x DP=2
    (experts in a chained optimizer) resumes in one process with its optimizer state (fp32 main weights, Adam
    moments and step, in HF space): the next step equals the one the 2-rank run took after saving. A fresh
    optimizer (weights_only) would step elsewhere."""
    results = parallel_runs[layout][0]
    ckpt = parallel_runs["ckpt", layout] if layout == "ep2" else parallel_runs["ckpt", *layout]
    path = hf_models["qwen3_moe" if layout == "ep2" else "qwen2"][0]
    expected = load_file(ckpt[:-len(".ckpt")] + ".next.safetensors")
    step = shard_for_workers(toy_batch(seed=1), 1, 2)[0]
    resumed, fresh = (_backend(path, train_config(), megatron=MegatronConfig(packing=True)) for _ in range(2))
    resumed.load(ckpt)
    metrics = global_metrics(resumed.train_step(step))
    for k, v in results["next_metrics"].items():
        assert metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert_same_weights(expected, dict(resumed.named_tensors()))
    fresh.load(ckpt, weights_only=True)
    fresh.train_step(step)
    got = dict(fresh.named_tensors())
    assert max((got[n] - expected[n]).abs().max() for n in expected) > 1e-3


def test_expert_parallel_checkpoint_loads_on_one_rank(parallel_runs, hf_models, mcore):
    """The EP=2 run's checkpoint (each rank's experts in its own shard file) loads at EP=1 in one process: the
    trained weights bit for bit."""
    weights = parallel_runs["ep2"][1]
    ckpt = Path(parallel_runs["ckpt", "ep2"])
    exported = sorted((ckpt / "model").glob("model-*-of-*.safetensors"))
    assert len(exported) == 2  # the HF export: one file from each expert-parallel rank
    for f in exported:  # the weights must come from the shards alone
        f.unlink()
    one = _backend(hf_models["qwen3_moe"][0], train_config(), megatron=MegatronConfig(packing=True))
    one.load(ckpt, weights_only=True)
    got = dict(one.named_tensors())
    assert got.keys() == weights.keys() and all(torch.equal(got[n], weights[n]) for n in weights)


# ----------------------------------------------------------------------------- in the RL loop


def _two_synced_steps(cfg, tmp_path):
    """(session, train worker, rollout worker) of an in-process RL session after two steps, each ending with a
    weight sync; every step's loss is finite and its gradient non-zero."""
    from rlflow.engines.session.rl import RLSession
    from rlflow.engines.session.workers import prepare_data, prepare_model

    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    for step in range(2):
        session.rollout(step)
        session.reward(step)
        session.advantages(step)
        metrics = session.train(step)
        assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
        session.sync_weights(step)
    return session, session.train_group.workers[0], session.rollout_group.workers[0]


def test_rl_session_trains_and_syncs_with_megatron(recipe, mcore, tmp_path):
    """train.backend: megatron in the bare RL loop: steps run, the rollout engine gets the trainer's weights, and
    a checkpoint restores them."""

    cfg = recipe(train={"steps": 2, "threads": 1, "backend": "megatron", "mini_batches": 2},
                 megatron={"micro_batch_tokens": 64})
    session, trainer, rollout = _two_synced_steps(cfg, tmp_path)
    exported = dict(trainer.named_tensors())
    for name, p in rollout.model.named_parameters():
        assert torch.equal(p.detach(), exported[name]), name
    controller = session.save(tmp_path / "ckpt", step=1)
    session.load(tmp_path / "ckpt", controller)
    assert rollout.weight_version == 2


@pytest.mark.parametrize("backend", ["megatron", "torch"])
def test_rl_session_trains_and_syncs_an_moe_model(recipe, mcore, tmp_path, backend):
    """A Qwen3-MoE policy in the bare RL loop: Megatron trains it through its MoE layer (or the torch backend
    through HF's), the embedded engine generates with HF's MoE block, and the weight sync (per-expert checkpoint
    names) lands in the engine's stacked expert tensors: after two steps they equal the trainer's export."""
    from transformers import AutoTokenizer

    from rlflow.engines.session.workers import prepare_model

    demo = prepare_model(recipe(), tmp_path)  # for the demo's tokenizer and vocabulary
    moe = tmp_path / "moe"
    vocab = AutoConfig.from_pretrained(demo).vocab_size
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)).save_pretrained(moe)
    AutoTokenizer.from_pretrained(demo).save_pretrained(moe)
    cfg = recipe(model={"path": str(moe)}, train={"steps": 2, "threads": 1, "backend": backend,
                                                   "mini_batches": 2}, megatron={"micro_batch_tokens": 64})
    _, trainer, rollout = _two_synced_steps(cfg, tmp_path)
    exported = dict(trainer.named_tensors())
    engine = checkpoint_named({n: p.detach() for n, p in rollout.model.named_parameters()}, "qwen3_moe")
    assert exported.keys() <= engine.keys()
    for name, t in exported.items():
        assert torch.equal(engine[name], t), name


@pytest.mark.slow  # ~3 min on 2 cores; its parts in the default suite: the TP=2 rank tests (parallel_runs) and the
# Ray worker groups of tests/test_fsdp.py, which gather a sharded trainer's weights for the rollout engine
def test_ray_tensor_parallel_group_syncs_gathered_weights(recipe, mcore, tmp_path):
    """Two Ray actors as one TP=2 group: each trains its half of every weight, and weight sync (a collective
    gather through both actors) hands the rollout engine the full tensors."""
    import ray

    from rlflow.engines.session.rl import RLSession
    from rlflow.engines.session.workers import prepare_data, prepare_model

    cfg = recipe(train={"steps": 1, "threads": 1, "backend": "megatron", "num_workers": 2},
                 megatron={"tensor_parallel": 2}, cluster={"num_cpus": 2})
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=True)
    try:
        session.rollout(0)
        session.reward(0)
        session.advantages(0)
        metrics = session.train(0)
        session.sync_weights(0)
        assert math.isfinite(metrics["train/loss"])
        ranks = session.train_group.call(TrainBackend.data_parallel_rank)
        assert ranks == [0, 0]  # one TP group: both ranks train on the same data
        gathered = session.train_group.wait(session.train_group.submit(TrainBackend.named_tensors, None))
        assert gathered[1] == []  # only rank 0 holds the full tensors
        rollout = session.rollout_group.workers[0]
        synced = dict(ray.get(rollout.__ray_call__.remote(lambda w: list(w.model.state_dict().items()))))
        for name, t in gathered[0]:
            assert torch.equal(synced[name], t), name
    finally:
        session.shutdown()
        ray.shutdown()


def test_preflight_reports_models_the_mapping_cannot_take(recipe, hf_models, mcore, tmp_path):
    from transformers import MistralConfig

    from rlflow.engines.session.preflight import find_problems

    MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2).save_pretrained(tmp_path / "mistral")
    cases = {str(tmp_path / "mistral"): (1, "model_type"), hf_models["llama"][0]: (4, "num_key_value_heads=2"),
             hf_models["mixtral"][0]: (2, "sequence parallelism")}
    for path, (tp, message) in cases.items():
        cfg = recipe(model={"path": path}, train={"backend": "megatron", "num_workers": tp},
                     megatron={"tensor_parallel": tp})
        problems = [p for p in find_problems(cfg) if p.startswith("model.path")]
        assert len(problems) == 1 and message in problems[0], problems
    ok = recipe(model={"path": hf_models["qwen2"][0]}, train={"backend": "megatron", "num_workers": 2},
                megatron={"tensor_parallel": 2})
    assert not [p for p in find_problems(ok) if p.startswith("model.path")]


# padded and packed with 2 and 1 micro-batches take the same exchange (~40-100 s each on 2 cores) and run with
# -m slow; the default suite's twin is 'empty' (2 micro-batches against 0 + filler)
@pytest.mark.parametrize("packing, split", [pytest.param(False, 4, marks=pytest.mark.slow),
                                            pytest.param(True, 4, marks=pytest.mark.slow), (True, 6)],
                         ids=["padded", "packed", "empty"])
def test_expert_parallel_ranks_with_different_micro_batch_counts(hf_models, mcore, tmp_path, packing, split):
    """Expert-parallel ranks exchange tokens in every MoE layer of every micro-batch, so a rank whose shard makes
    fewer micro-batches must still take part in the others' (bench/megatron/multi_gpu.py's 4-rank workload makes
    16 on one rank, 15 on the rest): rank 0 runs 2 micro-batches where rank 1 has 1, and both finish with the
    logprobs and the step of TorchTrainBackend on the whole batch; also when rank 1's shard is empty."""
    from bench.ranks import run_ranks
    from rlflow.engines.cluster.addresses import free_port
    from tests.megatron_helpers import uneven_expert_parallel_worker

    path = hf_models["qwen3_moe"][0]
    out = str(tmp_path / "uneven")
    run_ranks(uneven_expert_parallel_worker, 2, 300, path, f"tcp://127.0.0.1:{free_port()}", packing, out, split)
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    batch = toy_batch(6)
    torch_be = TorchTrainBackend(path, train_config(micro_batch_size=2, mini_batches=1), AlgorithmConfig())
    logprobs = torch_be.forward_logprobs(batch)
    got = torch.cat([torch.tensor(r["logprobs"]) for r in ranks])  # select keeps the batch's width
    mask = batch["attention_mask"].bool()
    assert (got - logprobs)[mask].abs().max() < 1e-5
    metrics = global_metrics(torch_be.train_step({**batch, "old_logprobs": logprobs}))
    for r in ranks:
        for k, v in metrics.items():
            assert r["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
