"""rollout.true_on_policy: the embedded engine's log-prob of every sampled token equals the native trainer's forward
of the same sequence bit for bit (fp32 on CPU), through continuous batching, a persisted batch and the RL loop;
without the mode they differ; a planted difference stops the step with OnPolicyMismatch."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from rlflow.engines.core.batch import RolloutBatch
from rlflow.engines.core.config import AlgorithmConfig, KVCacheConfig, TrainConfig, config_from_dict
from rlflow.engines.core.on_policy import OnPolicyMismatch, check_on_policy
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models import invariant
from rlflow.engines.models.hf import build_char_tokenizer
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.conftest import small_recipe
from tests.test_engines import _arch_model

# prompts of different lengths; with 3 page-table rows and per-request lengths, requests join as others leave
ROWS = 3
PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 8], [4, 11, 6, 2, 9, 9, 12, 3], [7], [2, 4, 6, 8, 10, 12], [5, 5]]


@pytest.mark.parametrize("shape", [(2, 40, 32), (3, 48, 32), (17, 40, 32), (64, 48, 32), (70, 128, 64)])
def test_invariant_ops_do_not_depend_on_the_batch(shape):
    """What the mode rests on: a row's linear and SiLU are the same bits alone, in any batch and at any place in it
    (F.linear and F.silu are not, on this CPU: the reason the module exists). The last shape's rows and outputs
    are 256-byte multiples: chunks are sliced in place, not copied."""
    torch.manual_seed(0)
    rows, width, k = shape
    x, w = torch.randn(rows + 3, k), torch.randn(width, k)
    full = invariant.linear(x, w)
    assert all(torch.equal(invariant.linear(x[i:i + 1].clone(), w)[0], full[i]) for i in range(rows + 3))
    assert torch.equal(invariant.linear(x[3:], w), full[3:])
    order = torch.randperm(rows + 3)  # each row at another place in its chunk, among other rows
    assert torch.equal(invariant.linear(x[order], w), full[order])
    h = torch.randn(rows + 3, width) * 3
    alone = torch.stack([invariant.silu(h[i:i + 1].clone())[0] for i in range(rows + 3)])
    assert torch.equal(invariant.silu(h), alone) and torch.equal(invariant.silu(h[3:]), alone[3:])
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()  # its gradient: plain GEMMs, the same values
    invariant.linear(xg, wg).square().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xr, wr).square().sum().backward()
    assert torch.allclose(xg.grad, xr.grad, atol=1e-4) and torch.allclose(wg.grad, wr.grad, atol=1e-4)
    for offset in range(1, 4):  # a weight inside a flat buffer (FSDP2's gathered parameters): the same bits
        buf = torch.empty(w.numel() + 8)
        view = buf[offset:offset + w.numel()].view_as(w)
        view.copy_(w)
        assert torch.equal(invariant.linear(x, view), full)
    assert (invariant.silu(h) - F.silu(h)).abs().max() < 1e-5  # the same function


def test_attention_of_a_query_is_the_same_alone_in_a_batch_and_in_a_prefill():
    """invariant.attention: a query's bits depend on its own prefix only: alone with garbage (even NaN) in the
    cache past its length, among rows of other lengths, and as one of a causal prefill's queries; its values are
    SDPA's within rounding, and its gradient is SDPA's."""
    torch.manual_seed(0)
    heads, kv, d, length = 4, 2, 16, 150  # over two key blocks
    q, k, v = torch.randn(1, heads, length, d), torch.randn(1, kv, length, d), torch.randn(1, kv, length, d)
    causal = torch.arange(1, length + 1)[None]
    prefill = invariant.attention(q, k, v, causal, 0.25)
    assert torch.equal(invariant.attention(q, k, v, None, 0.25), prefill)  # None: causal without a mask tensor
    for position in (0, 63, 64, 100, 149):
        garbage_k, garbage_v = torch.randn(1, kv, 200, d), torch.full((1, kv, 200, d), float("nan"))
        garbage_k[:, :, :position + 1], garbage_v[:, :, :position + 1] = k[:, :, :position + 1], v[:, :, :position + 1]
        alone = invariant.attention(q[:, :, position:position + 1], garbage_k, garbage_v,
                                    torch.tensor([[position + 1]]), 0.25)
        assert torch.equal(alone[0, :, 0], prefill[0, :, position])
        others = torch.randn(5, heads, 1, d), torch.randn(5, kv, 200, d), torch.randn(5, kv, 200, d)
        batch = invariant.attention(torch.cat([others[0], q[:, :, position:position + 1]]),
                                    torch.cat([others[1], garbage_k]), torch.cat([others[2], garbage_v]),
                                    torch.tensor([[3], [30], [70], [130], [200], [position + 1]]), 0.25)
        assert torch.equal(batch[5, :, 0], prefill[0, :, position])
    for visible in (causal, None):  # the backward: SDPA under a mask, or causal
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = invariant.attention(qg, kg, vg, visible, 0.25)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=0.25, enable_gqa=True)
        assert torch.allclose(out, ref, atol=1e-5)
        out.square().sum().backward()
        ref.square().sum().backward()
        for mine, theirs in ((qg, qr), (kg, kr), (vg, vr)):
            assert torch.allclose(mine.grad, theirs.grad, atol=1e-4)


def test_the_trainers_exact_attention_groups_samples_without_changing_a_bit(monkeypatch):
    """The trainer's exact attention pads samples in groups of similar length (packed.py): each token's output
    equals the sample run alone through invariant.attention, bit for bit, whatever group it landed in (an empty
    row included); a 200-token sample does not pad 31 short ones to its length."""
    from rlflow.engines.models.packed import EXACT_GROUP_TOKENS, PackedRows, _exact_packed_attention, _length_groups

    lengths = [200, *[9] * 31, 0, 150, 190]
    assert _length_groups(lengths, 4096) == [[0, 34, 33], list(range(1, 32))]  # the long ones, then the short
    assert _length_groups([100, 10, 90], 4096) == [[0, 2], [1]]
    assert _length_groups([100, 10, 90], 150) == [[0], [2], [1]]  # the token cap (a sample alone may pass it)
    monkeypatch.setitem(EXACT_GROUP_TOKENS, "cpu", 4096)  # groups on the CPU too (a GPU's setting)
    mask = (torch.arange(200)[None] < torch.tensor(lengths)[:, None]).long()
    packed = PackedRows.from_padded(torch.zeros_like(mask), mask)
    torch.manual_seed(0)
    total = sum(lengths)
    q, k, v = torch.randn(1, 4, total, 16), torch.randn(1, 2, total, 16), torch.randn(1, 2, total, 16)
    out, _ = _exact_packed_attention(None, q, k, v, None, scaling=0.25, packed=packed)  # [1, T, H, D]
    bounds = packed.cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b > a:
            alone = invariant.attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, 0.25)
            assert torch.equal(out[0, a:b], alone[0].transpose(0, 1))


def test_norm_and_logsumexp_of_a_row_are_the_same_alone_and_in_a_batch():
    """invariant.rms_norm and logsumexp: fixed-tree sums, so a row's bits do not depend on its batch; the values
    are torch's within rounding."""
    torch.manual_seed(0)
    x, w = torch.randn(37, 96) * 4, torch.randn(96)
    norm, lse = invariant.rms_norm(x, w, 1e-6), invariant.logsumexp(x)
    for i in (0, 17, 36):
        assert torch.equal(invariant.rms_norm(x[i:i + 1].clone(), w, 1e-6)[0], norm[i])
        assert torch.equal(invariant.logsumexp(x[i:i + 1].clone())[0], lse[i])
    assert torch.allclose(lse, torch.logsumexp(x, -1), atol=1e-5)
    assert torch.allclose(norm, w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-5)
    assert torch.equal(invariant.logsumexp(torch.full((2, 5), float("-inf"))), torch.full((2,), float("-inf")))
    assert invariant.tree_sum(torch.arange(7.0)) == 21.0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_exact_decode_step_is_capturable_for_dense_models_only(tmp_path, arch):
    """Under the mode a dense model's decode step reads nothing on the host (its attention folds every key block
    it is given), so a GPU captures it as a CUDA graph; a MoE model's experts loop reads the routing, so it is not
    captured. And the attention gives the same bits whether the blocks past every row's length are there or not."""
    from rlflow.engines.models.decoder import DecoderLM
    from rlflow.engines.models.hf import load_model

    lm = DecoderLM(load_model(_arch_model(tmp_path, arch)).eval())
    lm.true_on_policy()
    assert lm.graph_safe is (arch == "qwen2")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, n, 16, generator=g) for h, n in ((4, 1), (2, 200), (2, 200)))
    seen = torch.tensor([[5], [64], [130]])
    short = invariant.attention(q, k[:, :, :130], v[:, :, :130], seen, 0.25)
    k[:, :, 130:], v[:, :, 130:] = float("nan"), float("nan")
    assert torch.equal(invariant.attention(q, k, v, seen, 0.25), short)


def _samples(gens) -> RolloutBatch:
    """The engine's generations as a RolloutBatch (one group each), persisted to parquet and read back."""
    prompts = [SimpleNamespace(prompt="", label=None, prompt_ids=g.prompt_ids) for g in gens]
    groups = [[SimpleNamespace(response_ids=g.output_ids, logprobs=g.output_logprobs, loss_mask=None, reward=None,
                               response=None, finish_reason=g.finish_reason["type"], weight_version=g.weight_version,
                               last_weight_version=None, prompt_ids=None, metadata={})] for g in gens]
    buf = io.BytesIO()
    pq.write_table(RolloutBatch.from_samples(prompts, groups).to_arrow(), buf)
    return RolloutBatch.from_arrow(pq.read_table(io.BytesIO(buf.getvalue())))


def _model(tmp_path, arch: str) -> str:
    """test_engines' tiny random model of `arch`, with the char tokenizer the engine loads beside it."""
    path = _arch_model(tmp_path, arch)
    build_char_tokenizer().save_pretrained(path)
    return path


def _engine_vs_trainer(model_dir: str, exact: bool, temperature: float = 1.0, perturb: bool = False,
                       kv: KVCacheConfig | None = None, precision: str = "fp32"
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trainer log-probs, engine log-probs, loss mask) of the engine's samples of PROMPTS x 2, decoded 3 rows at a
    time with lengths of their own (continuous batching), through a parquet round trip. `kv`: the engine's cache.
    `precision` bf16: the engine's weights and the trainer's compute (FSDP2 over fp32 masters) in bf16."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rollout = TorchRolloutBackend(model_dir, threads=1, batch_size=ROWS, true_on_policy=exact, kv_cache=kv,
                                  dtype=dtype)
    if perturb:  # one weight of the rollout side off by a little: what a broken sync would leave
        with torch.no_grad():
            rollout.model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    try:
        requests = rollout.requests(PROMPTS * 2, SamplingParams(max_new_tokens=6, temperature=temperature,
                                                                ignore_eos=True), seed=7)
        for i, r in enumerate(requests):  # different lengths: rows leave and others join mid-batch
            r.params = r.params.model_copy(update={"max_new_tokens": 2 + (i * 5) % 9})
        gens = [f.result() for f in rollout.engine.submit(requests)]
        if kv is not None:  # what the caller wanted to exercise did happen
            assert rollout.engine.preemptions > 0
    finally:
        rollout.close()
    batch = _samples(gens).to_train_batch(0, torch.zeros(len(gens)))
    trainer = TorchTrainBackend(model_dir, TrainConfig(device="cpu", precision=precision, threads=1,
                                                       micro_batch_size=5), AlgorithmConfig(kl_coef=0.0),
                                temperature=temperature, true_on_policy=exact)
    return trainer.forward_logprobs(batch), batch["old_logprobs"], batch["loss_mask"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_engine_logprobs_equal_the_trainers(tmp_path, arch):
    """Generated tokens' log-probs: equal bit for bit with the mode (T=1, T=0.7, and with chunked prefill and
    preemption's re-prefill); apart without it (the mode is what makes them equal)."""
    model = _model(tmp_path, arch)
    train, engine, mask = _engine_vs_trainer(model, exact=True)
    on = mask > 0
    assert on.sum() > 30
    assert torch.equal(train[on], engine[on]), (train[on] - engine[on]).abs().max()
    train, engine, mask = _engine_vs_trainer(model, exact=True, temperature=0.7)
    assert torch.equal(train[mask > 0], engine[mask > 0])
    small = KVCacheConfig(page_size=4, tokens=24, prefill_chunk_tokens=3)  # prompts in parts; pages run out
    train, engine, mask = _engine_vs_trainer(model, exact=True, kv=small)
    assert torch.equal(train[mask > 0], engine[mask > 0])
    train, engine, mask = _engine_vs_trainer(model, exact=False)
    diff = (train[mask > 0] - engine[mask > 0]).abs().max()
    print(f"{arch}: max |train - rollout| without the mode {float(diff):.3g}")  # shown with -s
    assert 0 < diff < 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
def test_engine_logprobs_equal_the_trainers_in_bf16(tmp_path, arch):
    """The GPU's dtype on the CPU: bf16 engine weights against the trainer's bf16 compute over fp32 masters (its
    casts, rotary and norms in bf16) are equal bit for bit with the mode, about 1e-3 apart without it."""
    model = _model(tmp_path, arch)
    train, rollout, mask = _engine_vs_trainer(model, exact=True, precision="bf16")
    assert torch.equal(train[mask.bool()], rollout[mask.bool()])
    train, rollout, mask = _engine_vs_trainer(model, exact=False, precision="bf16")
    assert (train - rollout)[mask.bool()].abs().max() > 1e-5


def test_planted_difference_is_caught(tmp_path):
    """A weight changed on the rollout side only: the trainer's log-probs differ, and the check names the step, the
    largest difference and the token count."""
    train, engine, mask = _engine_vs_trainer(_model(tmp_path, "llama"), exact=True, perturb=True)
    diff = (train - engine).abs()[mask > 0]
    assert diff.max() > 0
    metrics = {"train/rollout_logprob_diff_max": float(diff.max()),
               "train/rollout_logprob_diff_mean": float(diff.mean()),
               "train/rollout_logprob_diff_tokens": float(len(diff))}
    with pytest.raises(OnPolicyMismatch, match=r"step 3: .*max \|diff\| .* over \d+ tokens"):
        check_on_policy(3, metrics)
    check_on_policy(3, metrics | {"train/rollout_logprob_diff_max": 0.0})  # exact: nothing raised


def test_config_refuses_what_breaks_exactness(tmp_path):
    def problem(**sections) -> str:
        with pytest.raises(ValueError) as err:
            config_from_dict(small_recipe(tmp_path, **sections))
        return str(err.value)

    on = {"true_on_policy": True}
    assert "rollout.true_on_policy" in problem(rollout=on | {"precision": "fp8", "device": "cuda"},
                                               train={"device": "cuda"})
    assert "rollout.backend" in problem(rollout=on | {"backend": "sglang"})
    assert "train.backend" in problem(rollout=on, train={"backend": "megatron"})
    assert "rollout.max_staleness" in problem(rollout=on | {"max_staleness": 1})
    assert "train.lora" in problem(rollout=on, train={"lora": {"rank": 4}})
    assert "train.compile" in problem(rollout=on, train={"compile": True})
    assert "rollout.precision bf16 must equal train.precision fp32" in problem(rollout=on | {"precision": "bf16"})
    cfg = config_from_dict(small_recipe(tmp_path, rollout=on))
    assert cfg.rollout.true_on_policy


@pytest.mark.parametrize("correction", ["none", "tis"], ids=["measured-by-train-step", "measured-with-correction"])
def test_first_step_ratio_is_one_in_the_rl_loop(tmp_path, correction):
    """The bare RL loop with the mode: every step's train/rollout log-prob difference is exactly 0 (ratio 1), the
    check passes, and training goes on; then one weight of the rollout worker changed (a sync gone wrong) stops the
    next step with OnPolicyMismatch naming it: in the train step, or with rollout correction in the advantages
    stage, which then computes the trainer's log-probs."""
    cfg = config_from_dict(small_recipe(tmp_path, rollout={"true_on_policy": True, "prompts_per_step": 4,
                                                           "samples_per_prompt": 3, "max_new_tokens": 4,
                                                           "batch_size": 5},
                                        train={"steps": 2, "threads": 1}, algorithm={"is_correction": correction}))
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, str(tmp_path)), use_ray=False)
    try:
        for step in range(2):
            m = session.rollout(step) | session.reward(step) | session.advantages(step) | session.train(step)
            session.sync_weights(step)
            assert m["train/rollout_logprob_diff_max"] == 0.0, (step, m["train/rollout_logprob_diff_max"])
            assert m["train/rollout_logprob_diff_tokens"] > 0 and np.isfinite(m["train/loss"])
        with torch.no_grad():
            session.rollout_group.workers[0].model.model.layers[1].self_attn.o_proj.weight[0, 0] += 1e-3
        session.rollout(2) | session.reward(2)
        with pytest.raises(OnPolicyMismatch, match=r"step 2: .*max \|diff\| .* over \d+ tokens") as err:
            session.advantages(2)
            session.train(2)
        assert err.value.max_diff > 0 and err.value.tokens > 0
    finally:
        session.shutdown()


def test_cost_bench_runs_its_smoke_shape(tmp_path):
    """bench/rollout/true_on_policy.py on the CPU: both modes' decode and train throughput, and the mode's log-prob
    difference of 0 measured by the train step itself."""
    out = tmp_path / "top.json"
    subprocess.run([sys.executable, "-m", "bench.rollout.true_on_policy", "--smoke", "--threads", "1", "--out",
                    str(out)], check=True, timeout=600, capture_output=True, cwd=Path(__file__).parents[1])
    report = json.loads(out.read_text())
    default, exact = report["modes"]
    assert exact["true_on_policy"] and exact["logprob_diff_max"] == 0.0
    assert default["decode_tokens_per_s"] > 0 and exact["train_tokens_per_s"] > 0 and report["train_ratio"] > 0
