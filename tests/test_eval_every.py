"""`eval.every`: every N steps and at the last step; 0 disables evaluation, the last step included (issue 49)."""

from __future__ import annotations

import pytest

from rlflow.flows.post_train import evaluation_due
from tests.conftest import step_metrics


@pytest.mark.parametrize(
    ("every", "last", "due"),
    [
        (0, 4, []),  # disabled: not even the last step
        (1, 4, [0, 1, 2, 3, 4]),
        (2, 4, [1, 3, 4]),  # the last step too
        (5, 2, [2]),  # an interval longer than the run: the last step only
    ],
)
def test_evaluation_steps(every, last, due):
    assert [step for step in range(last + 1) if evaluation_due(every, step, last)] == due


def test_a_run_with_eval_every_0_never_evaluates(recipe):
    """The post-train flow with a held-out set and eval.every 0: no step, the last included, has eval metrics."""
    from rlflow.flows.post_train import post_train

    cfg = recipe(cluster={"use_ray": False}, train={"steps": 2, "threads": 1}, eval={"every": 0},
                 checkpoint={"every": 0}, rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 1})
    assert cfg.data.eval_path
    seen, final = step_metrics(lambda: post_train(cfg))
    assert sorted(seen) == [0, 1] and "train/loss" in final
    assert not [k for m in seen.values() for k in m if k.startswith("eval/")], seen
