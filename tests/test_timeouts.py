"""Stage time limits: a stage that hangs fails its step with an error naming the stage, the limit's field and the
user function, and the run resumes from its last checkpoint."""

from __future__ import annotations

import time

import pytest

from rlflow.engines.core.config import config_from_dict
from rlflow.engines.store.run_store import RunStore
from rlflow.flows.post_train import post_train
from rlflow.tasks.stages import StageTimeout
from tests.conftest import small_recipe

CALLS: list[int] = []
HANG_ON_CALL = {"n": 2}  # the reward of step 1 hangs; 0: never


def sometimes_hangs(prompts, responses, labels):
    CALLS.append(len(prompts))
    if len(CALLS) == HANG_ON_CALL["n"]:
        time.sleep(600)  # a verifier stuck on one answer
    return [float(len(r) > 0) for r in responses]


def test_a_hung_reward_fails_its_stage_in_time_and_the_run_resumes(tmp_path):
    cfg = config_from_dict(small_recipe(
        tmp_path, name="hang", train={"steps": 3, "threads": 1}, eval={"every": 0}, checkpoint={"every": 1},
        reward={"fn": "tests.test_timeouts:sometimes_hangs"}, cluster={"use_ray": False},
        orchestration={"stage_timeout_s": {"reward": 3}}))
    t0 = time.monotonic()
    with pytest.raises(StageTimeout, match=r"stage reward of step 1 ran longer than orchestration\.stage_timeout_s\."
                       r"reward \(3 s\) in reward\.fn 'tests\.test_timeouts:sometimes_hangs'"):
        post_train(cfg)
    assert time.monotonic() - t0 < 120  # not the 600 s the reward sleeps
    store = RunStore(cfg.storage, cfg.name)
    assert store.committed_steps() == [0]

    HANG_ON_CALL["n"] = 0
    final = post_train(cfg)  # resumes at step 1
    assert "rollout/reward_mean" in final
    assert store.read_json("status.json")["status"] == "finished" and store.latest_step() == 2


def test_stage_limits_are_validated(tmp_path):
    with pytest.raises(ValueError, match=r"orchestration\.stage_timeout_s\.reward"):
        config_from_dict(small_recipe(tmp_path, orchestration={"stage_timeout_s": {"reward": -1}}))
