"""tasks/faults.py's `during@<seconds>` point: a worker killed while its stage computes (a GPU lost mid-step)."""

from __future__ import annotations

import subprocess
import time
from types import SimpleNamespace

import pytest

from rlflow.tasks.faults import ENV, maybe_inject


class _Group:
    def __init__(self, pids: list[int]):
        self.pids = pids

    def call_one(self, rank: int, method, *args):
        return self.pids[rank]


def test_during_kills_the_named_rank_that_long_into_the_stage(monkeypatch):
    workers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    run = SimpleNamespace(session=SimpleNamespace(train_group=_Group([w.pid for w in workers])))
    monkeypatch.setenv(ENV, "train:3:during@0.3:train@1")
    try:
        maybe_inject(run, "train", 2, "before")  # another step: nothing
        maybe_inject(run, "train", 3, "before")  # arms the timer and returns: the stage's work goes on
        assert workers[1].poll() is None
        assert workers[1].wait(timeout=10) == -9  # SIGKILLed by the timer
        time.sleep(0.3)
        assert workers[0].poll() is None  # rank 0 untouched
        maybe_inject(run, "train", 3, "after")  # `during` has no after point
    finally:
        for w in workers:
            w.kill()
            w.wait()


def test_during_names_a_worker_target(monkeypatch):
    monkeypatch.setenv(ENV, "train:1:during@1:flow")
    with pytest.raises(ValueError, match="during.*train, rollout or critic"):
        maybe_inject(SimpleNamespace(), "train", 1, "before")
