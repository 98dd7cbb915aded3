"""The multi-GPU bench scripts in their CPU smoke modes (gloo ranks, toy shapes): the same code the 2-GPU machine
runs with nccl, so the first run there does not find a script bug. Also the rank launcher's failure handling."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from bench import megatron_multi_gpu, train_multi_gpu
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
    with pytest.raises(SystemExit):
        train_multi_gpu.main(["--smoke", "--variants", "baseline", "--out", str(tmp_path / "x.json")])


def test_layouts_parse_and_bad_ones_are_named():
    assert [megatron_multi_gpu.parse_layout(x) for x in ("tp1", "tp2", "pp2", "tp2pp2")] == [
        (1, 1),
        (2, 1),
        (1, 2),
        (2, 2),
    ]
    with pytest.raises(ValueError, match="'dp2' is not a layout"):
        megatron_multi_gpu.parse_layout("dp2")


@pytest.mark.slow
def test_megatron_multi_gpu_smoke_runs_every_layout(tmp_path):
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


@pytest.mark.slow
def test_e2e_grpo_smoke_runs_the_cpu_modes(tmp_path):
    """bench/e2e_grpo.py end to end on the CPU (Ray actors, the nccl transport over gloo): each step trains the
    workload's token count, k = 2 stays within its bound, and the colocated mode (cuda_ipc) is skipped with a
    reason rather than run wrongly."""
    import subprocess
    import sys

    from bench.workload_rollout import PROMPT_TOKENS

    out = tmp_path / "e2e.json"
    modes = "colocated-sync,disagg-sync,disagg-k2"
    subprocess.run([sys.executable, "-m", "bench.e2e_grpo", "--smoke", "--modes", modes,
                    "--prompts", "2", "--steps", "3", "--timeout", "300", "--out", str(out)], check=True, timeout=900)
    modes = {m["mode"]: m for m in json.loads(out.read_text())["modes"]}
    assert "skipped" in modes["colocated-sync"]
    for mode, bound in (("disagg-sync", 0), ("disagg-k2", 2)):
        m = modes[mode]
        assert m["tokens_per_step"] == m["samples"] * (PROMPT_TOKENS + 8), m  # smoke responses: 8 tokens each
        assert m["steps"] == 3 and m["staleness_max"] <= bound and m["tokens_per_s"] > 0
