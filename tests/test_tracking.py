"""MLflow conventions of a run: chart sections by metric prefix, the classic ML experiment view, provenance tags."""

from __future__ import annotations

import subprocess

import pytest
from mlflow.tracking import MlflowClient

from rlflow.tasks.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, Tracker, recipe_hash


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
