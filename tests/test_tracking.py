"""MLflow conventions of a run: chart sections by metric prefix, the classic ML experiment view, provenance tags;
a tracking server that dies mid-run."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.retry import RetriesExhausted, RetryPolicy
from rlflow.engines.store.run_store import RunStore
from rlflow.tasks.mlflow_client import RetryingClient
from rlflow.tasks.run_context import RunContext
from rlflow.tasks.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, Tracker, recipe_hash
from tests.conftest import small_recipe, step_metrics


@pytest.fixture
def uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"


def test_metric_names_keep_their_stage_prefix(uri):
    """MLflow's UI makes a chart section of each prefix before the first `/`: a `.` would put every metric in one."""
    tracker = Tracker(uri, "exp", "run", {"a": 1})
    tracker.log_metrics({"rollout/reward_mean": 0.5, "train/loss": 1.0, "eval/sort/accuracy": 0.25}, step=3)
    tracker.finish()
    logged = MlflowClient(uri).get_run(tracker.run_id).data.metrics
    assert logged == {"rollout/reward_mean": 0.5, "train/loss": 1.0, "eval/sort/accuracy": 0.25}


def test_experiment_opens_in_the_classic_ml_view(uri):
    client = MlflowClient(uri)
    Tracker(uri, "new", "run").finish()
    assert client.get_experiment_by_name("new").tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND

    old = client.create_experiment("made-before")  # e.g. by an earlier rlflow: gets the tag
    Tracker(uri, "made-before", "run").finish()
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND

    client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})  # a user's choice stays
    Tracker(uri, "chosen", "run").finish()
    assert client.get_experiment_by_name("chosen").tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_runs_are_tagged_with_where_they_came_from(uri, tmp_path, monkeypatch):
    repo = tmp_path / "project"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.chdir(repo)
    # Prefect's runtime reads these when set (as in a deployment's flow run)
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__ID", "0b3c")
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__UI_URL", "http://127.0.0.1:4200/runs/flow-run/0b3c")
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__FLOW_NAME", "post-train")
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__NAME", "sort-tiny")
    recipe = {"name": "r", "train": {"lr": 1e-3}}
    tracker = Tracker(uri, "exp", "run", recipe, {"rlflow.run": "r"})
    tags = MlflowClient(uri).get_run(tracker.run_id).data.tags
    assert tags["mlflow.source.git.commit"] == head
    assert tags["prefect.flow_run_id"] == "0b3c"
    assert tags["prefect.flow_run_url"] == "http://127.0.0.1:4200/runs/flow-run/0b3c"
    assert tags["prefect.deployment"] == "post-train/sort-tiny"
    assert tags["rlflow.recipe_hash"] == recipe_hash(recipe) != recipe_hash({"name": "r", "train": {"lr": 2e-3}})
    assert tags["rlflow.run"] == "r"

    # resumed by another flow run: the run's tags name the latest one
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__ID", "9f1d")
    Tracker(uri, "exp", "run", recipe, run_id=tracker.run_id).finish()
    assert MlflowClient(uri).get_run(tracker.run_id).data.tags["prefect.flow_run_id"] == "9f1d"


def test_no_prefect_tags_outside_a_flow_run(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a git checkout either
    tracker = Tracker(uri, "exp", "run", {"a": 1})
    tags = MlflowClient(uri).get_run(tracker.run_id).data.tags
    assert not any(k.startswith("prefect.") for k in tags) and "mlflow.source.git.commit" not in tags
    assert tags["rlflow.recipe_hash"] == recipe_hash({"a": 1})


class _Warnings(logging.Handler):
    """The warnings of a logger and its children (Prefect's logging setup replaces the root's handlers, caplog's)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_tracking_server_killed_mid_run_fails_the_run_with_the_first_error(tmp_path):
    """A real MLflow server, SIGKILLed after step 0 of a run: step 1's log_batch uses up its retries and is the
    error the run raises; the clean-up's set_terminated gets one attempt (no retries: the server is known down)
    and only warns. Before, set_terminated spent a second retry budget and its error replaced log_batch's."""
    from rlflow.engines.core.config import config_from_dict
    from rlflow.engines.store.run_store import RunStore
    from rlflow.flows.post_train import post_train
    from rlflow.flows.serve import Services, start_mlflow_server

    svc, warnings = Services(), _Warnings()
    logging.getLogger("rlflow").addHandler(warnings)  # rlflow.retry's too
    try:
        uri = start_mlflow_server(svc, free_port(), f"sqlite:///{tmp_path}/mlflow-server.db", tmp_path / "artifacts",
                                  log=tmp_path / "mlflow.log")
        server = svc.procs[-1]
        # its first answers take seconds on a loaded machine (imports, the database): not a failure to test here
        RetryingClient(uri, RetryPolicy(retries=5, deadline_s=120), timeout_s=120).get_experiment_by_name("rlflow")
        cfg = config_from_dict(small_recipe(
            tmp_path, cluster={"use_ray": False}, train={"steps": 3, "threads": 1}, eval={"every": 0},
            checkpoint={"every": 0}, rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 1},
            tracking={"uri": uri, "deadline_s": 10}))

        def kill_after_step_0(step: int, metrics: dict) -> None:
            if step == 0:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()

        with pytest.raises(RetriesExhausted, match=rf"MLflow log_batch at {uri}: transient error, gave up after"):
            step_metrics(lambda: post_train(cfg), [kill_after_step_0])
    finally:
        logging.getLogger("rlflow").removeHandler(warnings)
        svc.stop()
    retried = [r.getMessage() for r in warnings.records if r.name == "rlflow.retry"]
    assert retried and all(m.startswith(f"MLflow log_batch at {uri}") for m in retried), retried
    assert any("was not marked FAILED" in r.getMessage() for r in warnings.records if r.name == "rlflow")
    assert RunStore(cfg.storage, cfg.name).read_json("status.json")["status"] == "failed"


def test_closing_a_failed_run_with_a_dead_tracker_raises_nothing_of_its_own(tmp_path, caplog):
    """A failed run whose background checkpoint had committed logs that write's time at close; with the tracking
    server gone too, that call only warns, so the run reports its own first error. Stand-ins for the session, lease,
    tracker and pending commit: what close() calls on them is the behaviour under test."""
    def dead(*_args, **_kwargs):
        raise RetriesExhausted("mlflow log_batch http://127.0.0.1:1: connection refused")

    finished: list[str] = []
    tracker = SimpleNamespace(run_id="r", log_metrics=dead, finish=finished.append)
    pending = SimpleNamespace(cancel=lambda: None, seconds=1.5, step=3)
    lease = SimpleNamespace(held=True, release=lambda: None)
    store = RunStore(str(tmp_path / "runs"), "t")
    ctx = RunContext(SimpleNamespace(name="t"), SimpleNamespace(shutdown=lambda: None), store, lease, tracker,
                     tmp_path / "work", pending=pending)
    with caplog.at_level(logging.WARNING, logger="rlflow"):
        ctx.close("FAILED")
    assert finished == ["FAILED"] and store.read_json("status.json")["status"] == "failed"
    assert "could not log the last checkpoint's write time" in caplog.text
