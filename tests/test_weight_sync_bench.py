"""bench/sync/weight_sync.py in its CPU smoke mode, as the device machine runs it (no Ray there): the real
train and rollout backends in separate processes, the nccl transport over gloo (and, with a trainer sharded over
two gloo ranks, cuda_ipc over shared-memory files and the distributed transport), and the process worker group
it drives them through (bench/sync/proc_group.py), whose failures must end a run rather than hang it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.sync.proc_group import ProcessWorkerGroup
from bench.sync.weight_sync import main

REPO = Path(__file__).resolve().parents[1]


def run_smoke(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The script's --smoke run (2 timed updates a mode) with Ray made unimportable (as on the device machine) for
    it and its worker processes: (the finished process, its JSON report)."""
    fake = tmp_path / "no_ray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('ray is not installed on the device machine')\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "sync.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.sync.weight_sync",
            "--smoke",
            "--repeats",
            "2",
            "--timeout",
            "120",
            "--workdir",
            str(tmp_path / "ckpt"),
            "--out",
            str(out),
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_smoke_syncs_real_backends_over_gloo_without_ray(tmp_path):
    """Every update must deliver the trainer's weights to a rollout worker that started from other weights."""
    proc, report = run_smoke(tmp_path)
    assert report["error"] is None and report["size"] == "smoke" and report["train_ranks"] == 1
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


def test_smoke_syncs_a_trainer_sharded_over_two_ranks_to_every_rollout_worker(tmp_path):
    """--train-ranks 2: two FSDP2 gloo ranks. cuda_ipc (colocated, one rollout worker per rank; shared-memory files
    on the CPU) and distributed (two rollout workers of their own, gathered buckets broadcast from rank 0) must
    each leave both rollout workers with the trainer's weights; each mode's link is measured in the run."""
    proc, report = run_smoke(tmp_path, "--train-ranks", "2")
    assert report["error"] is None and report["train_ranks"] == 2 and report["skipped"] == []
    modes = {r["mode"]: r for r in report["modes"]}
    assert sorted(modes) == ["cuda_ipc", "distributed@0.1"]
    for r in modes.values():
        assert r["train_ranks"] == 2 and r["rollout_workers"] == 2
        assert r["weights_match"] and r["weights_match_each"] == [True, True] and r["exact_tensors_match"]
        assert r["digests_after"] == pytest.approx([r["digest_trainer_bf16"]] * 2, abs=1e-3)
        assert abs(r["digest_before"] - r["digest_trainer_bf16"]) > 1.0  # the update had something to change
        assert r["bytes"] == report["params"] * 2  # what one rollout worker receives, in bf16
        assert len(r["sync_s_all"]) == 2 and r["link_gb_per_s"] > 0 and r["fraction_of_link"] > 0
    ipc = modes["cuda_ipc"]
    assert ipc["link"].startswith("gloo (CPU) all-gather over 2 ranks") and len(ipc["link_gb_per_s_each_rank"]) == 2
    assert ipc["in_worker_s"] > 0 and ipc["buckets"] is None
    assert modes["distributed@0.1"]["buckets"] > 1 and modes["distributed@0.1"]["in_worker_s"] is None
    assert "| cuda_ipc, 2 train ranks |" in proc.stdout


def test_nccl_is_refused_for_a_sharded_trainer(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--smoke", "--train-ranks", "2", "--modes", "nccl@1", "--out", str(tmp_path / "x.json")])
    assert exit_.value.code == 2
    assert "the nccl transport broadcasts one unsharded train rank's parameters" in capsys.readouterr().err


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
