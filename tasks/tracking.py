"""MLflow tracking for a run: params from the resolved config, per-step metrics, tables and artifacts.

A step's metrics are written synchronously (one log_batch call per step): once log_metrics returns they are
stored, so a kill right after a step loses none of them. Continuing a run after a resume, a step rerun after the
checkpoint is not logged again: MLflow keeps every point it is sent and cannot delete one, so the points the
interrupted attempt logged for that step stay, once (on CPU the rerun reproduces them bit for bit).
Metric names keep their `/` (`rollout/reward_mean`): MLflow's UI puts each prefix before the first `/` in its
own chart section (docs/metrics.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
from typing import Any

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from mlflow.utils.time import get_current_time_millis
from prefect.runtime import deployment, flow_run

from rlflow.engines.core.config import RLConfig
from rlflow.engines.core.retry import RetryPolicy
from rlflow.tasks.mlflow_client import RetryingClient

log = logging.getLogger("rlflow")

# MLflow 3 opens an experiment in its GenAI view unless this tag says it holds model development (training) runs
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
ATTEMPT_TAG = "rlflow.attempt."  # + n: one tag per attempt of a training run (Tracker.record_attempt)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= flatten(v, key + ".")
        else:
            out[key] = v
    return out


def ensure_experiment(client: MlflowClient, name: str) -> str:
    """The id of experiment `name`, created if missing, tagged to open in MLflow's classic ML view (an experiment
    someone already gave a kind keeps it)."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    served = str(client.tracking_uri).startswith(("http://", "https://"))
    if served and exp.artifact_location.startswith(("/", "file:", "./", "mlruns")):
        log.warning("MLflow experiment %r keeps its artifacts at %s, a path on the tracking server's disk that other "
                    "machines cannot read (it was made by a run that wrote to the database directly, not through the "
                    "server); use another tracking.experiment so new runs' artifacts are served over HTTP", name,
                    exp.artifact_location)
    if EXPERIMENT_KIND_TAG not in exp.tags:
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return exp.experiment_id


def recipe_hash(recipe: dict) -> str:
    """sha256 of the resolved recipe as canonical JSON: two runs with the same hash ran the same settings."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def git_commit(path: str | None = None) -> str | None:
    """HEAD of the git checkout the run is started from (the user's project), if it is one."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path or os.getcwd(), capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_tags(recipe: dict | None = None) -> dict[str, str]:
    """Where a run came from: git commit, Prefect flow run (id and UI link), deployment, recipe hash; each only
    when known (a run outside Prefect has no flow run)."""
    tags: dict[str, str] = {}
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    if run_id := flow_run.id:
        tags["prefect.flow_run_id"] = run_id
        if (url := flow_run.ui_url) and url.startswith(("http://", "https://")):
            tags["prefect.flow_run_url"] = url
        if name := deployment.name:
            tags["prefect.deployment"] = f"{flow_run.flow_name}/{name}"
    if recipe is not None:
        tags["rlflow.recipe_hash"] = recipe_hash(recipe)
    return tags


class Tracker:
    """One MLflow run. Pass `run_id` to continue a run (a resumed training run logs into the same one)."""

    def __init__(self, uri: str, experiment: str, run_name: str, recipe: dict | None = None,
                 tags: dict[str, str] | None = None, run_id: str | None = None, policy: RetryPolicy | None = None,
                 timeout_s: float = 30):
        mlflow.set_tracking_uri(uri)
        self.client = RetryingClient(uri, policy or RetryPolicy(), timeout_s)
        self.recorded: set[tuple[str, int]] = set()  # (key, step) points an interrupted attempt already logged
        self.experiment_id = ensure_experiment(self.client, experiment)
        tags = run_tags(recipe) | (tags or {})
        if run_id is None:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
            if recipe is not None:
                params = {k: str(v)[:6000] for k, v in flatten(recipe).items()}
                items = list(params.items())
                for i in range(0, len(items), 100):
                    batch = [mlflow.entities.Param(k, v) for k, v in items[i : i + 100]]
                    self.client.log_batch(self.run_id, params=batch)
                self.client.log_text(self.run_id, json.dumps(recipe, indent=2), "recipe.json")
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            # the flow run resuming it (a new one, or a retry of the same): the tags say the latest
            self.client.log_batch(run_id, tags=[mlflow.entities.RunTag(k, v) for k, v in tags.items()])

    @classmethod
    def for_training(cls, cfg: RLConfig, run_id: str | None = None) -> Tracker:
        recipe = cfg.model_dump(mode="json", exclude={"storage": {"key", "secret"}})
        return cls(cfg.tracking.uri, cfg.tracking.experiment, cfg.name, recipe, {"rlflow.run": cfg.name}, run_id,
                   cfg.tracking.retry_policy(), cfg.tracking.timeout_s)

    def resume_after(self, step: int) -> None:
        """The run goes on from its checkpoint at `step` (-1: none): remember which points of later steps the
        interrupted attempt logged, so the rerun of those steps does not log them a second time."""
        keys = self.client.get_run(self.run_id).data.metrics
        self.recorded = {(m.key, m.step) for key in keys for m in self.client.get_metric_history(self.run_id, key)
                         if m.step > step}

    def record_attempt(self, start_step: int) -> list[str]:
        """Tag this attempt of the run (`rlflow.attempt.<n>`: its Prefect flow run, the flow run's own attempt
        count, the step it starts at) beside the earlier ones, which stay: the `prefect.flow_run_id` tag says only
        the latest; `rlflow.attempts` says n. Returns the earlier attempts' Prefect flow runs, oldest first."""
        tags = self.client.get_run(self.run_id).data.tags
        earlier = sorted((int(k.removeprefix(ATTEMPT_TAG)), json.loads(v)) for k, v in tags.items()
                         if k.startswith(ATTEMPT_TAG) and k.removeprefix(ATTEMPT_TAG).isdigit())
        n = len(earlier) + 1
        value = {"flow_run_id": flow_run.id, "flow_run_count": flow_run.run_count if flow_run.id else None,
                 "start_step": start_step, "started_ms": get_current_time_millis()}
        self.client.log_batch(self.run_id, tags=[mlflow.entities.RunTag(f"{ATTEMPT_TAG}{n}", json.dumps(value)),
                                                 mlflow.entities.RunTag("rlflow.attempts", str(n))])
        return [fr for _, attempt in earlier if (fr := attempt.get("flow_run_id"))]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write one step's metrics, each (key, step) once per run (the client's log_batch: mlflow.log_metrics
        would first load the whole run, params and tags included, every step)."""
        ts = get_current_time_millis()
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items()
                 if math.isfinite(float(v)) and (k, step) not in self.recorded]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch, synchronous=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set (or overwrite) run tags, e.g. the health checks that fired (tasks/health.py)."""
        if tags:
            self.client.log_batch(self.run_id, tags=[mlflow.entities.RunTag(k, v[:5000]) for k, v in tags.items()])

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        if rows:
            cols = {k: [r[k] for r in rows] for k in rows[0]}
            self.client.log_table(self.run_id, cols, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def flush(self) -> None:
        mlflow.flush_async_logging()

    def finish(self, status: str = "FINISHED") -> None:
        """End the MLflow run with `status`. A finished run raises if the server does not take it; a failed run
        only warns: the error that ended the run is the one to report, not its clean-up's (after the server went
        down mid-run, this costs one attempt: tasks/mlflow_client.py)."""
        mlflow.flush_async_logging()
        if status == "FINISHED":
            self.client.set_terminated(self.run_id, status=status)
            return
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:  # noqa: BLE001 - whatever it is, the run's own error is raised instead
            log.warning("MLflow run %s was not marked %s: %s: %s", self.run_id, status, type(e).__name__, e)

    @property
    def url(self) -> str:
        """A link to the run in the MLflow UI when tracking goes to a server; else where to find it."""
        return run_url(self.client.tracking_uri, self.experiment_id, self.run_id)


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"run {run_id} in {uri}"
