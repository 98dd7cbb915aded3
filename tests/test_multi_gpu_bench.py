"""The multi-GPU bench scripts in their CPU smoke modes (gloo ranks, toy shapes): the same code the 2-GPU machine
runs with nccl, so the first run there does not find a script bug. Also the rank launcher's failure handling."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import pytest
import torch

# only the launcher: this module is what the OOM test's spawned ranks import, so the heavy bench modules (the
# session, megatron-core, transformers) are imported by the tests that use them
from bench.ranks import rank_result, run_and_collect


def _oom_or_wait(rank: int, world: int, out: str) -> None:
    """Rank 1 runs out of memory; rank 0 stays blocked, as an NCCL rank waiting in a collective for it would."""
    with rank_result(out, rank) as result:
        result["started"] = True
        if rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        time.sleep(600)


def test_a_rank_out_of_memory_ends_the_run_at_once_and_is_the_reported_error(tmp_path):
    t0 = time.monotonic()
    ranks, error = run_and_collect(_oom_or_wait, 2, 120, str(tmp_path / "run"))
    assert time.monotonic() - t0 < 60  # rank 0 was killed, not left to the 120 s limit
    assert error == "rank 1: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert [r["rank"] for r in ranks] == [1]  # rank 0, killed while blocked, wrote nothing


def test_train_multi_gpu_smoke_runs_one_and_two_ranks(tmp_path):
    from bench.train import multi_gpu as train_multi_gpu

    out = tmp_path / "train.json"
    report = train_multi_gpu.main(["--smoke", "--gpus", "1,2", "--steps", "1", "--deadline", "1800", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    runs = report["runs"]["rlflow-8k"]
    for n in ("1", "2"):
        r = runs[n]
        assert r["error"] is None, r["error"]
        assert r["samples"] == int(n) * 4 and len(r["ranks"]) == int(n)
        # each rank trained its own shard, and the shards cover the whole N x samples batch
        assert sum(x["local_tokens"] for x in r["ranks"]) == r["useful_tokens"]
        assert r["tokens_per_s_per_gpu"] > 0 and math.isfinite(r["loss"])
        assert r["mfu"] is None  # no peak for a CPU
    assert runs["2"]["scaling_efficiency"] == pytest.approx(
        runs["2"]["tokens_per_s_per_gpu"] / runs["1"]["tokens_per_s_per_gpu"]
    )


def test_train_multi_gpu_rejects_unknown_variants(tmp_path):
    from bench.train import multi_gpu as train_multi_gpu

    with pytest.raises(SystemExit):
        train_multi_gpu.main(["--smoke", "--variants", "baseline", "--out", str(tmp_path / "x.json")])


def test_layouts_parse_and_bad_ones_are_named():
    from bench.megatron import multi_gpu as megatron_multi_gpu

    names = ("tp1", "tp2", "pp2", "tp2pp2", "ep2", "tp2ep2", "pp2ep4", "tp2pp2ep2")
    assert [megatron_multi_gpu.parse_layout(x) for x in names] == [
        (1, 1, 1),
        (2, 1, 1),
        (1, 2, 1),
        (2, 2, 1),
        (1, 1, 2),
        (2, 1, 2),
        (1, 2, 4),
        (2, 2, 2),
    ]
    for bad in ("dp2", "", "ep2tp2", "ep", "tp0", "ep0", "tp2 ep2"):
        with pytest.raises(ValueError, match=f"{bad!r} is not a layout"):
            megatron_multi_gpu.parse_layout(bad)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "7b", "--layouts", "tp1,ep2"], "ep2 sets expert parallelism, but --shape 7b is dense"),
        (["--shape", "moe", "--gpus", "4", "--layouts", "tp2ep4"], r"ep4 must divide the data-parallel size .* = 2"),
        (["--shape", "moe", "--gpus", "6", "--layouts", "ep3"], "ep3 must divide the 32 experts of --shape moe"),
        (["--shape", "moe", "--gpus", "2", "--layouts", "pp4"], "pp4 needs a multiple of 4 ranks, --gpus is 2"),
        (["--smoke", "--shape", "moe", "--layouts", "ep4"], r"ep4 must divide the data-parallel size .* = 2"),
    ],
)
def test_layouts_that_cannot_run_on_the_shape_are_named(tmp_path, capsys, argv, message):
    from bench.megatron import multi_gpu as megatron_multi_gpu

    with pytest.raises(SystemExit):
        megatron_multi_gpu.main([*argv, "--out", str(tmp_path / "x.json")])
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.slow
def test_megatron_multi_gpu_smoke_runs_every_layout(tmp_path):
    from bench.megatron import multi_gpu as megatron_multi_gpu

    pytest.importorskip("megatron.core")
    out = tmp_path / "megatron.json"
    report = megatron_multi_gpu.main(["--smoke", "--steps", "1", "--deadline", "3000", "--out", str(out)])
    parity, throughput = report["sections"]["parity"], report["sections"]["throughput"]
    for name in ("tp1", "tp2", "pp2"):
        p = parity["layouts"][name]
        assert p["error"] is None, p["error"]
        assert p["vs"] == "tp1" and p["pass"], p  # fp32 log-probs agree across layouts within 1e-5
        t = throughput["layouts"][name]
        assert t["error"] is None, t["error"]
        assert t["tokens_per_s_per_gpu"] > 0 and math.isfinite(t["loss"])
        assert len(t["ranks"]) == 2
    # data parallel: two shards covering the batch; TP / PP: both ranks train the one shard (the whole batch)
    assert sum(x["local_tokens"] for x in throughput["layouts"]["tp1"]["ranks"]) == throughput["useful_tokens"]
    assert [x["local_tokens"] for x in throughput["layouts"]["tp2"]["ranks"]] == [throughput["useful_tokens"]] * 2


def _step(i: int, rollout: float, train: float, sync: float, step: float, stale: int) -> dict:
    return {"step": i, "rollout/tokens": 1000.0, "time/rollout": rollout, "time/train": train, "time/sync": sync,
            "time/step": step, "train/staleness_max": float(stale)}


def test_e2e_summary_keeps_a_cut_off_modes_steps_and_states_the_steady_one_step_off_rate():
    """A mode its timeout cut keeps the steps it logged (the cut line is dropped, the last finished step counts);
    one-step-off's steady step is max(rollout, train) + sync, not a median flattered by rollouts running ahead, and
    its last step (nothing generating under it) is not timed."""
    from bench.e2e.grpo import logged_steps, summarize
    from bench.e2e.workload import PROMPT_TOKENS

    lines = [json.dumps(_step(0, 30.0, 50.0, 1.0, 120.0, 0)), "INFO something else",
             json.dumps(_step(1, 18.0, 8.0, 0.5, 14.0, 1)), json.dumps(_step(2, 18.0, 8.0, 0.5, 15.0, 1)),
             '{"step": 3, "rollout/tok']
    steps = logged_steps("\n".join(lines))
    assert [h["step"] for h in steps] == [0, 1, 2]
    cut = summarize(steps, "disagg2x2-k1", prompts=2, gpus=4, finished=False)
    assert cut["timed_steps"] == 2 and cut["step_s"] == 14.5
    assert cut["steady_step_s"] == 18.5  # the rollouts (18 s) bound a long run, not the 14.5 s median
    assert cut["tokens_per_step"] == 1000 + PROMPT_TOKENS * 16
    assert cut["steady_tokens_per_s_per_gpu"] == pytest.approx(cut["tokens_per_step"] / 18.5 / 4)
    finished = summarize(steps, "disagg2x2-k1", prompts=2, gpus=4)  # a finished run's last step is not timed
    assert finished["timed_steps"] == 1 and finished["step_s"] == 14.0
    sync = summarize([_step(0, 30.0, 50.0, 1.0, 81.0, 0), _step(1, 18.0, 8.0, 0.5, 26.5, 0),
                      _step(2, 18.0, 8.0, 0.5, 28.5, 0)], "disagg2x2-sync", 2, 4)
    assert sync["timed_steps"] == 2  # nothing runs ahead of a sync step, so its last step counts
    assert sync["steady_step_s"] == sync["step_s"] == 27.5
    assert summarize(steps[:1], "disagg2x2-sync", 2, 4)["error"] == "no step after the first finished"


def test_long_tail_workload_draws_capped_lognormal_lengths_and_the_best_async_mode_is_compared_per_gpu():
    """The long-tail workload (issue 45 item 7): lengths from the prompt's seed (every mode generates the same),
    a median near 3,000, a tail that reaches the cap, nothing below 64; the report compares the best async mode
    with the best sync one on steady tokens/s/GPU."""
    import asyncio

    from bench.e2e import workload
    from bench.e2e.grpo import best_async_vs_sync

    sent: list[int] = []

    async def fake_generate(url, ids, params):  # records the length asked for; no engine needed for the draw
        sent.append(params["max_new_tokens"])
        return {"output_ids": [], "text": "", "meta_info": {"finish_reason": {"type": "length"}}}

    prompt = workload.PromptSample(index=0, prompt="", label="", prompt_ids=[], n=2000, seed=7,
                                   tokenizer=list(range(100)))
    original = workload.generate
    workload.generate = fake_generate
    try:
        samples = asyncio.run(workload.long_tail(prompt, "http://unused", {"max_new_tokens": 28672}))
        first = list(sent)
        sent.clear()
        asyncio.run(workload.long_tail(prompt, "http://unused", {"max_new_tokens": 28672}))
    finally:
        workload.generate = original
    assert first == sent and len(first) == len(samples) == 2000
    lengths = sorted(first)
    assert 2400 < lengths[1000] < 3600 and lengths[0] >= 64
    assert max(lengths) == 28672 and 0.002 < sum(n == 28672 for n in lengths) / 2000 < 0.03
    modes = [{"mode": "colocated4-sync", "staleness_max": 0, "steady_tokens_per_s_per_gpu": 100.0},
             {"mode": "disagg2x2-sync", "staleness_max": 0, "steady_tokens_per_s_per_gpu": 120.0},
             {"mode": "disagg1x3-k2", "staleness_max": 2, "steady_tokens_per_s_per_gpu": 300.0},
             {"mode": "disagg2x2-k1", "staleness_max": 1, "steady_tokens_per_s_per_gpu": 200.0}]
    assert best_async_vs_sync(modes) == {"best_sync": "disagg2x2-sync", "best_async": "disagg1x3-k2",
                                         "best_async_vs_best_sync": 2.5}


@pytest.mark.slow
def test_e2e_grpo_smoke_runs_the_cpu_modes(tmp_path):
    """bench/e2e/grpo.py end to end on the CPU (Ray actors, the nccl transport over gloo): each step trains the
    workload's token count, k = 2 stays within its bound, and the colocated mode (cuda_ipc) is skipped with a
    reason rather than run wrongly."""
    from bench.e2e.workload import PROMPT_TOKENS

    out = tmp_path / "e2e.json"
    modes = "colocated-sync,disagg-sync,disagg-k2"
    subprocess.run([sys.executable, "-m", "bench.e2e.grpo", "--smoke", "--modes", modes,
                    "--prompts", "2", "--steps", "3", "--timeout", "300", "--out", str(out)], check=True, timeout=900)
    modes = {m["mode"]: m for m in json.loads(out.read_text())["modes"]}
    assert "skipped" in modes["colocated-sync"]
    for mode, bound in (("disagg-sync", 0), ("disagg-k2", 2)):
        m = modes[mode]
        assert m["tokens_per_step"] == m["samples"] * (PROMPT_TOKENS + 8), m  # smoke responses: 8 tokens each
        assert m["steps"] == 3 and m["staleness_max"] <= bound and m["tokens_per_s"] > 0


@pytest.mark.slow  # ~2.5 min on 2 CPU cores: two flow runs, each with a Prefect server, Ray and four actors
def test_gpu_fault_smoke_kills_a_rank_mid_step_and_resumes(tmp_path):
    """bench/e2e/fault.py on the CPU (gloo ranks, the toy shape, whose embeddings are tied): `rlflow run` with train
    rank 1 killed as step 2's train stage starts fails, the same command resumes from the checkpoint of step 1, and
    every check of the bench holds (it exits non-zero otherwise)."""
    out = tmp_path / "fault.json"
    subprocess.run([sys.executable, "-m", "bench.e2e.fault", "--smoke", "--prompts", "2", "--timeout", "300",
                    "--out", str(out)], check=True, timeout=700)
    report = json.loads(out.read_text())
    assert report["passed"] and all(report["checks"].values())
    assert report["killed"]["committed_step"] == 1 and report["resumed"]["resumed_from"] == 1
    assert report["steps_rerun"] == [2]


@pytest.mark.slow  # ~50 s on 2 CPU cores: 4 runs of 2 spawned ranks, each importing megatron-core
def test_megatron_multi_gpu_smoke_moe_runs_expert_parallel(tmp_path):
    """--smoke --shape moe: the toy Qwen3-MoE on 2 gloo ranks, data parallel (tp1) and expert parallel (ep2: each
    rank holds 2 of the 4 experts, tokens reach the other rank's by all-to-all): the same fp32 log-probs, and bf16
    train steps with throughput figures, each layout's "ep" recorded."""
    from bench.megatron import multi_gpu as megatron_multi_gpu

    pytest.importorskip("megatron.core")
    out = tmp_path / "moe.json"
    argv = ["--smoke", "--shape", "moe", "--gpus", "2", "--layouts", "tp1,ep2", "--steps", "1", "--deadline", "600"]
    report = megatron_multi_gpu.main([*argv, "--out", str(out)])
    assert report["shape"] == "smoke-moe" and report["model"]["num_experts"] == 4
    parity, throughput = report["sections"]["parity"], report["sections"]["throughput"]
    for name, ep in (("tp1", 1), ("ep2", 2)):
        p, t = parity["layouts"][name], throughput["layouts"][name]
        assert p["error"] is None and t["error"] is None, (p["error"], t["error"])
        assert (p["ep"], t["ep"], t["dp"]) == (ep, ep, 2)
        assert t["tokens_per_s_per_gpu"] > 0 and math.isfinite(t["loss"])
        assert sum(x["local_tokens"] for x in t["ranks"]) == throughput["useful_tokens"]
    assert parity["layouts"]["ep2"]["vs"] == "tp1"
    assert parity["layouts"]["ep2"]["max_abs_diff"] <= megatron_multi_gpu.PARITY_TOLERANCE


def test_flops_per_step_counts_a_dense_shape_as_before_and_an_moe_shape_by_its_active_experts():
    from bench.train.scale import flops_per_step

    lengths = torch.tensor([3, 5])  # 8 tokens, sum of squares 34
    dense = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2}
    dense |= {"num_key_value_heads": 1, "intermediate_size": 16}
    # per layer q, k, v, o = 64 + 32 + 32 + 64 (head_dim 8 / 2 = 4), gate/up/down 3 x 8 x 16: 576; x 2 + head 80
    want = 6 * (2 * 576 + 80) * 8 + 6 * 2 * 8 * 34
    assert flops_per_step(dense, lengths) == flops_per_step(dense | {"head_dim": 4}, lengths) == want == 62400
    # head_dim 6 (q width 12 != hidden 8), 4 experts of width 5, top-2; intermediate_size is not an expert's width
    moe = dense | dict(head_dim=6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=5, intermediate_size=99)
    # per layer q 8 x 12, k and v 8 x 6 each, o 12 x 8: 288; two experts 2 x 3 x 8 x 5 = 240; router 8 x 4 = 32
    want = 6 * (2 * (288 + 240 + 32) + 80) * 8 + 6 * 2 * 12 * 34
    assert flops_per_step(moe, lengths) == want == 62496
    # Mixtral names them num_local_experts, its expert width intermediate_size
    mixtral = {k: v for k, v in moe.items() if k not in ("num_experts", "moe_intermediate_size")}
    assert flops_per_step(mixtral | {"num_local_experts": 4, "intermediate_size": 5}, lengths) == want
    with pytest.raises(ValueError, match="lora_rank on an MoE config"):
        flops_per_step(moe, lengths, lora_rank=4)


def test_megatron_gpus_flops_per_token_is_train_scales_count_of_one_full_row(tmp_path):
    """bench/megatron/gpu.py's MFU (checks.train_flops_per_token, from a model folder) is flops_per_step's count for
    one row of `seq` tokens, per token; its full-attention variant (Megatron-LM's convention) adds the other half
    of the s x s attention."""
    from transformers import Qwen3MoeConfig

    from bench.megatron.checks import train_flops_per_token
    from bench.train.scale import flops_per_step

    cfg = dict(vocab_size=10, hidden_size=8, intermediate_size=99, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=5)
    Qwen3MoeConfig(**cfg).save_pretrained(tmp_path)
    seq = 16
    causal = flops_per_step(cfg, torch.tensor([seq])) / seq
    assert train_flops_per_token(str(tmp_path), seq) == causal
    assert train_flops_per_token(str(tmp_path), seq, causal=False) == causal + 6 * 2 * 12 * seq


def test_train_context_parallel_smoke_splits_one_sample_over_two_ranks(tmp_path):
    """bench/train/context_parallel.py on CPU: one 97-token sample (an odd length, padded to split) on one rank and
    as CP=2 over two; the same loss either way, one micro-batch, MFU None (no peak for a CPU)."""
    from bench.train import context_parallel as train_cp

    out = tmp_path / "cp.json"
    report = train_cp.main(["--smoke", "--deadline", "1800", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    one, two = report["runs"]["97x1"], report["runs"]["97x2"]
    for r in (one, two):
        assert r["error"] is None, r["error"]
        assert r["tokens_per_s_per_gpu"] > 0 and r["mfu"] is None
        assert all(x["micro_batches"] == 1 for x in r["ranks"])
    assert two["context_parallel"] == 2 and two["tokens_per_rank"] == 49
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    with pytest.raises(SystemExit):
        train_cp.main(["--smoke", "--runs", "97by2", "--out", str(out)])
    assert train_cp.parse_runs("65536x2,65536x1+selective+cudnn") == [
        {"name": "65536x2", "tokens": 65536, "gpus": 2},
        {"name": "65536x1+selective+cudnn", "tokens": 65536, "gpus": 1, "ckpt": "selective", "kernel": "cudnn"}]
    with pytest.raises(ValueError, match="unknown option 'sac'"):
        train_cp.parse_runs("65536x1+sac")
