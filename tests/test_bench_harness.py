"""bench/harness.py, which every bench script's child processes, timings and reports go through: a child's answer is
its last RESULT line; a crash, a silent exit or a hang comes back as an error with the output's tail, never as a
figure; a report is rewritten whole where its folder does not exist yet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import harness

REPO = Path(__file__).resolve().parents[1]


def child(code: str, timeout: float | None = 60, **kwargs) -> dict:
    return harness.run_child(["-c", code], timeout, cwd=REPO, **kwargs)


def test_a_childs_answer_is_its_last_result_line():
    code = ("from bench import harness; print('noise'); harness.emit_result({'step': 1}); "
            "harness.emit_result({'step': 2, 'tokens_per_s': 3.5})")
    out = child(code)
    assert out.pop("wall_s") > 0
    assert out == {"step": 2, "tokens_per_s": 3.5}


def test_a_crash_a_silent_exit_and_a_hang_are_errors_with_the_output():
    crashed = child("from bench import harness; harness.emit_result({'x': 1}); raise SystemExit('boom')")
    assert crashed["error"] == "exit 1" and "boom" in crashed["tail"] and "x" not in crashed
    silent = child("print('no result here')", keep_output=True)
    assert silent["error"] == "exit 0" and silent["output"].strip() == "no result here"
    hung = child("import time; print('started', flush=True); time.sleep(60)", timeout=5, keep_output=True)
    assert hung["error"] == "timed out after 5 s" and "started" in hung["output"]


def test_the_report_is_rewritten_whole_and_its_header_names_the_command(tmp_path):
    out = tmp_path / "new" / "folder" / "report.json"
    harness.write_json(out, {"a": 1, "b": [1, 2]})
    harness.write_json(out, {"a": 2})
    assert json.loads(out.read_text()) == {"a": 2}
    header = harness.report_header("bench.train.scale", ["--smoke", "--out", "x.json"])
    assert header["command"] == "python -m bench.train.scale --smoke --out x.json"
    assert {"date", "device", "gpus", "torch", "python"} <= set(header)
    assert "device" not in harness.report_header("bench.train.multi_gpu", [], name_device=False)


def test_timing_calls_after_the_warm_up_and_device_tables():
    calls = []
    times = harness.timed(lambda: calls.append(len(calls)), repeats=3, warmup=2, on="cpu")
    assert calls == [0, 1, 2, 3, 4] and len(times) == 3 and all(t >= 0 for t in times)
    assert harness.by_device(harness.PEAK_BF16_TFLOPS, "NVIDIA H100 80GB HBM3") == 989.4
    assert harness.by_device(harness.HBM_GB_PER_S, "NVIDIA H200") == 4800.0
    assert harness.by_device(harness.PEAK_BF16_TFLOPS, "cpu") is None


def test_moe_benches_run_their_smoke_shapes(tmp_path):
    """bench/rollout/moe_decode.py and bench/train/routing_replay.py on their CPU smoke shapes: the decode check
    holds (graphs on and off agree, records are whole) and the mismatch report has its three rows."""
    decode, replay = tmp_path / "decode.json", tmp_path / "replay.json"
    for module, out in (("bench.rollout.moe_decode", decode), ("bench.train.routing_replay", replay)):
        subprocess.run([sys.executable, "-m", module, "--smoke", "--out", str(out)], check=True, timeout=600,
                       capture_output=True, cwd=REPO)
    check = json.loads(decode.read_text())["check"]
    assert check["same_tokens"] and check["same_routing_records"] and check["record_vs_full_forward_agreement"] == 1
    points = json.loads(decode.read_text())["points"]
    assert [p["batch"] for p in points] == [2, 4] and all(p["graphs"]["tokens_per_s"] > 0 for p in points)
    report = json.loads(replay.read_text())
    assert {"moe_live", "moe_r3", "dense"} <= set(report) and 0 <= report["routing_flips"] < 1


def test_fp8_decode_bench_runs_its_smoke_shape(tmp_path):
    """bench/rollout/fp8_decode.py on the CPU (bf16 only: the engine refuses fp8 there): timings and the mismatch
    report against the trainer's forward, which for bf16 on bf16 weights is small but measured, not assumed."""
    out = tmp_path / "fp8.json"
    subprocess.run([sys.executable, "-m", "bench.rollout.fp8_decode", "--smoke", "--out", str(out)], check=True,
                   timeout=600, capture_output=True, cwd=REPO)
    point = json.loads(out.read_text())["sizes"]["smoke"]
    assert point["bf16"]["2"]["tokens_per_s"] > 0 and point["bf16"]["4"]["tokens_per_s"] > 0
    assert len(point["bf16"]["4"]["prefill_seconds"]) == 1 and "decode_tokens_per_s" in point["bf16"]["4"]
    report = point["mismatch_vs_bf16_trainer"]["bf16"]
    assert report["tokens"] == 16 and 0 <= report["mean"] <= report["max"] < 0.1


def test_delta_sync_bench_runs_its_smoke_shape(tmp_path):
    """bench/sync/delta.py on the CPU: every transport delivers every version bit for bit, the first delta version
    is a snapshot and the later ones are deltas smaller than the full transports' bytes."""
    out = tmp_path / "delta.json"
    subprocess.run([sys.executable, "-m", "bench.sync.delta", "--smoke", "--out", str(out)], check=True,
                   timeout=600, capture_output=True, cwd=REPO)
    size = json.loads(out.read_text())["sizes"]["smoke"]
    assert "error" not in size, size.get("tail")
    assert [v["delta"]["snapshot"] for v in size["versions"]] == [True, False, False]
    summary = size["summary"]
    assert all(summary[t]["all_exact"] for t in ("delta", "store", "disk"))
    assert 0 < summary["delta"]["median_bytes"] < summary["store"]["median_bytes"] == summary["disk"]["median_bytes"]
