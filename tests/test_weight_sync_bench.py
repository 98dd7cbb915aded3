"""bench/gpu_weight_sync.py in its CPU smoke mode, as the device machine runs it (no Ray there): the real
train and rollout backends in separate processes, the nccl transport over gloo, and the process worker group
it drives them through (bench/proc_group.py), whose failures must end a run rather than hang it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.proc_group import ProcessWorkerGroup

REPO = Path(__file__).resolve().parents[1]


def test_smoke_syncs_real_backends_over_gloo_without_ray(tmp_path):
    """Ray is made unimportable (as on the device machine) for the script and its worker processes; every
    update must deliver the trainer's weights to a rollout worker that started from other weights."""
    fake = tmp_path / "no_ray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('ray is not installed on the device machine')\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "sync.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_weight_sync",
            "--smoke",
            "--repeats",
            "2",
            "--timeout",
            "120",
            "--workdir",
            str(tmp_path / "ckpt"),
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["error"] is None and report["size"] == "smoke"
    assert report["skipped"] == [
        {"mode": "cuda_ipc", "reason": "cuda_ipc maps GPU memory between processes: needs CUDA (not run on the CPU)"}
    ]
    assert report["exact_tensors"] == [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ]
    modes = {r["mode"]: r for r in report["modes"]}
    assert sorted(modes) == ["nccl@0.1", "nccl@0.5"]
    assert modes["nccl@0.1"]["buckets"] > modes["nccl@0.5"]["buckets"] >= 1
    for r in modes.values():
        assert (
            r["weights_match"]
            and r["exact_tensors_match"]
            and r["digest_after"] == pytest.approx(r["digest_trainer_bf16"], abs=1e-3)
        )
        assert abs(r["digest_before"] - r["digest_trainer_bf16"]) > 1.0  # the update had something to change
        assert r["bytes"] == report["params"] * 2  # every weight, in bf16
        assert len(r["sync_s_all"]) == 2 and r["link_gb_per_s"] > 0 and r["fraction_of_link"] > 0
    assert "| nccl@0.1 |" in proc.stdout  # the markdown row


class Toy:
    """A worker for the group's own tests."""

    def __init__(self, fail: bool = False):
        if fail:
            raise ValueError("bad toy")

    def echo(self, x: int) -> int:
        return x

    def boom(self) -> None:
        raise KeyError("no such weight")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def test_process_group_answers_in_order_and_names_a_workers_error():
    group = ProcessWorkerGroup(Toy, [{}, {}], [None, None], time.monotonic() + 60, name="toy")
    try:
        group.ready()
        first = group.submit_rank0(Toy.echo, 1)
        assert group.call(Toy.echo, 2) == [2, 2]  # answered after `first`, which waits in order
        assert group.call_each(Toy.echo, [(3,), (4,)]) == [3, 4]
        assert group.wait([first]) == [1]
        assert group.call_one(1, Toy.echo, group.submit_rank0(Toy.echo, 5)) == 5  # a ticket as an argument
        with pytest.raises(RuntimeError, match=r"toy-0 raised:(.|\n)*KeyError: 'no such weight'"):
            group.call_rank0(Toy.boom)
        assert group.call_rank0(Toy.echo, 6) == 6  # the worker lives on after an error
    finally:
        group.shutdown()
    assert not any(p.is_alive() for p in group.procs)


def test_process_group_refuses_to_wait_past_its_deadline_and_reports_a_failed_start():
    group = ProcessWorkerGroup(Toy, [{}], [None], time.monotonic() + 60, name="slow")
    try:
        group.ready()
        group.deadline = time.monotonic() + 1  # the run's time is up in a second
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="slow-0: no answer before the deadline"):
            group.call_rank0(Toy.sleep, 600)
        assert time.monotonic() - t0 < 10
    finally:
        group.shutdown(grace_s=1)  # the hung worker is killed
    assert not any(p.is_alive() for p in group.procs)
    broken = ProcessWorkerGroup(Toy, [{"fail": True}], [None], time.monotonic() + 60, name="broken")
    try:
        with pytest.raises(RuntimeError, match="broken-0 raised:(.|\n)*ValueError: bad toy"):
            broken.ready()
    finally:
        broken.shutdown()
