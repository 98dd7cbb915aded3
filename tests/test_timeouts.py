"""Stage time limits: a stage that hangs fails its step with an error naming the stage, the limit's field and the
user function, and the run resumes from its last checkpoint. The reward stage runs in the flow's main thread; a
rollout running ahead (one-step-off) runs in a worker thread of the flow's task runner, where Prefect's own task
timeout could not interrupt it (tasks/time_limits.py)."""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import time

import pytest

from rlflow.engines.core.config import config_from_dict
from rlflow.engines.rollout.functions import single_turn
from rlflow.engines.store.run_store import RunStore
from rlflow.flows.post_train import post_train
from rlflow.tasks.stages import StageTimeout
from tests.conftest import small_recipe

CALLS: list[int] = []
HANG_ON_CALL = {"n": 2}  # the reward of step 1 hangs; 0: never
WOKE: list[str] = []  # the hung calls that came back from their sleep (none may before its stage failed)


def as_the_run_imports_it():
    """This module as a run imports its user functions by import path: under pytest that is a second copy, whose
    globals the run's calls use."""
    return importlib.import_module("tests.test_timeouts")


def sometimes_hangs(prompts, responses, labels):
    CALLS.append(len(prompts))
    if len(CALLS) == HANG_ON_CALL["n"]:
        time.sleep(600)  # a verifier stuck on one answer
        WOKE.append("reward")
    return [float(len(r) > 0) for r in responses]


def test_a_hung_reward_fails_its_stage_in_time_and_the_run_resumes(tmp_path):
    cfg = config_from_dict(small_recipe(
        tmp_path, name="hang", train={"steps": 3, "threads": 1}, eval={"every": 0}, checkpoint={"every": 1},
        reward={"fn": "tests.test_timeouts:sometimes_hangs"}, cluster={"use_ray": False},
        orchestration={"stage_timeout_s": {"reward": 3}}))
    run_module = as_the_run_imports_it()
    with pytest.raises(StageTimeout, match=r"stage reward of step 1 ran longer than orchestration\.stage_timeout_s\."
                       r"reward \(3 s\) in reward\.fn 'tests\.test_timeouts:sometimes_hangs'"):
        post_train(cfg)
    assert len(run_module.CALLS) == 2 and run_module.WOKE == []  # failed while step 1's reward slept, not after
    store = RunStore(cfg.storage, cfg.name)
    assert store.committed_steps() == [0]

    run_module.HANG_ON_CALL["n"] = 0
    final = post_train(cfg)  # resumes at step 1
    assert "rollout/reward_mean" in final
    assert store.read_json("status.json")["status"] == "finished" and store.latest_step() == 2


ROLLOUT_CALLS: list[int] = []


async def hangs_after_the_first_step(prompt, router_url, sampling_params):
    """The default rollout, but from the 9th prompt on (step 1's, with 8 prompts a step) it never answers."""
    ROLLOUT_CALLS.append(prompt.index)
    if len(ROLLOUT_CALLS) > 8:
        await asyncio.sleep(600)  # a rollout server that accepted the request and went silent
        WOKE.append("rollout")
    return await single_turn(prompt, router_url, sampling_params)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_hung_rollout_running_ahead_fails_its_stage_in_time(tmp_path):
    """One-step-off: step 1's rollout runs in a worker thread while step 0 trains, and hangs. Its limit still
    holds (the step fails while the rollout still waits), Prefect logs no warning that it cannot interrupt the
    task, and closing the failed run releases the hung rollout's thread."""
    cfg = config_from_dict(small_recipe(
        tmp_path, name="hang-rollout", train={"steps": 3, "threads": 1}, eval={"every": 0}, checkpoint={"every": 1},
        rollout={"max_staleness": 1, "fn": "tests.test_timeouts:hangs_after_the_first_step"},
        cluster={"use_ray": False}, orchestration={"stage_timeout_s": {"rollout": 30}}))
    records = _Records()
    logging.getLogger("prefect").addHandler(records)
    run_module = as_the_run_imports_it()
    try:
        with pytest.raises(StageTimeout, match=r"stage rollout of step 1 ran longer than orchestration\."
                           r"stage_timeout_s\.rollout \(30 s\) in rollout\.fn 'tests\.test_timeouts:"
                           r"hangs_after_the_first_step'"):
            post_train(cfg)
    finally:
        logging.getLogger("prefect").removeHandler(records)
    assert len(run_module.ROLLOUT_CALLS) == 16 and run_module.WOKE == []  # step 1's 8 prompts all still waited
    assert not [m for m in records.messages if "cannot interrupt" in m], records.messages
    assert RunStore(cfg.storage, cfg.name).committed_steps() == []  # step 0's sync waited for step 1's rollout
    for t in [t for t in threading.enumerate() if t.name == "rlflow-stage-rollout-1"]:  # the hung stage's helper
        t.join(timeout=30)  # ... ends: the closed run's rollout runner ended the rollout it was waiting on
        assert not t.is_alive()


def test_stage_limits_are_validated(tmp_path):
    with pytest.raises(ValueError, match=r"orchestration\.stage_timeout_s\.reward"):
        config_from_dict(small_recipe(tmp_path, orchestration={"stage_timeout_s": {"reward": -1}}))
