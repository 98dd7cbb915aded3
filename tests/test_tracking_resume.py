"""MLflow tracking across kills and resumes: a step's metrics are stored when logged, and each step is logged once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from mlflow.tracking import MlflowClient

from rlflow.tasks.tracking import Tracker


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_metrics_are_stored_when_log_metrics_returns(tmp_path):
    """A process killed right after logging a step (os._exit: no atexit flush) keeps that step's metrics."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    code = textwrap.dedent(f"""
        import os
        from rlflow.tasks.tracking import Tracker
        t = Tracker({uri!r}, "e", "r")
        print(t.run_id, flush=True)
        t.log_metrics({{"train/loss": 0.5, "rollout/reward_mean": 0.25}}, step=7)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    run_id = out.stdout.split()[0]
    assert _history(uri, run_id, "train/loss") == [(7, 0.5)]
    assert _history(uri, run_id, "rollout/reward_mean") == [(7, 0.25)]


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Steps 3 and 4 ran, then the process died; the run resumes from the checkpoint at step 2 and reruns them:
    MLflow keeps one point per step (it cannot delete the first); the new step 5, and keys new at a rerun step,
    are logged."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = Tracker(uri, "e", "r")
    for step in range(5):
        first.log_metrics({"train/loss": 1.0 / (step + 1)}, step)
    resumed = Tracker(uri, "e", "r", run_id=first.run_id)
    resumed.resume_after(2)
    for step in range(3, 6):
        resumed.log_metrics({"train/loss": 1.0 / (step + 1), "time/checkpoint": 0.1}, step)
    assert _history(uri, first.run_id, "train/loss") == [(s, 1.0 / (s + 1)) for s in range(6)]
    assert [s for s, _ in _history(uri, first.run_id, "time/checkpoint")] == [3, 4, 5]


@pytest.mark.slow  # ~30 s; in CI, test_resume.py's trials check the same (each step once) through real kills
def test_a_flow_retry_logs_each_step_once(tmp_path, monkeypatch):
    """The first attempt logs steps 0-2 and fails in step 3; its retry resumes from the checkpoint at step 1 and
    reruns step 2: the MLflow run has every metric once per step, timings included."""
    from rlflow.engines.core.config import config_from_dict
    from rlflow.engines.store.run_store import RunStore
    from rlflow.flows.post_train import post_train
    from tests.conftest import small_recipe

    raw = small_recipe(
        tmp_path,
        cluster={"use_ray": False},
        train={"steps": 4, "threads": 1},
        eval={"every": 0},
        checkpoint={"every": 2},
        rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 1},
    )
    cfg = config_from_dict(raw)
    monkeypatch.setenv("RLFLOW_FAULT", "train:3:before:raise")
    post_train.with_options(retries=1, retry_delay_seconds=0)(cfg)
    run_id = RunStore(cfg.storage, cfg.name).read_json("status.json")["mlflow_run_id"]
    client = MlflowClient(cfg.tracking.uri)
    keys = client.get_run(run_id).data.metrics
    assert "train/loss" in keys and "time/checkpoint" in keys
    for key in keys:
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert steps == sorted(set(steps)), f"{key}: {steps}"
    assert [s for s, _ in _history(cfg.tracking.uri, run_id, "train/loss")] == [0, 1, 2, 3]
