"""MLflow tracking for a run: params from the resolved config, per-step metrics, tables and artifacts.

A step's metrics are written synchronously (one log_batch call per step): once log_metrics returns they are
stored, so a kill right after a step loses none of them. Continuing a run after a resume, a step rerun after the
checkpoint is not logged again: MLflow keeps every point it is sent and cannot delete one, so the points the
interrupted attempt logged for that step stay, once (on CPU the rerun reproduces them bit for bit).
"""

from __future__ import annotations

import json
import math
from typing import Any

import mlflow
from mlflow.entities import Metric
from mlflow.utils.time import get_current_time_millis

from rlflow.engines.core.config import RLConfig
from rlflow.engines.core.retry import RetryPolicy
from rlflow.tasks.mlflow_client import RetryingClient


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= flatten(v, key + ".")
        else:
            out[key] = v
    return out


class Tracker:
    """One MLflow run. Pass `run_id` to continue a run (a resumed training run logs into the same one)."""

    def __init__(self, uri: str, experiment: str, run_name: str, recipe: dict | None = None,
                 tags: dict[str, str] | None = None, run_id: str | None = None, policy: RetryPolicy | None = None,
                 timeout_s: float = 30):
        mlflow.set_tracking_uri(uri)
        self.client = RetryingClient(uri, policy or RetryPolicy(), timeout_s)
        self.recorded: set[tuple[str, int]] = set()  # (key, step) points an interrupted attempt already logged
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        if run_id is None:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags or {})
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

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write one step's metrics, each (key, step) once per run (the client's log_batch: mlflow.log_metrics
        would first load the whole run, params and tags included, every step)."""
        ts = get_current_time_millis()
        batch = [Metric(key, float(v), ts, step) for k, v in metrics.items()
                 if math.isfinite(float(v)) and (key := k.replace("/", "."), step) not in self.recorded]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch, synchronous=True)

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        if rows:
            cols = {k: [r[k] for r in rows] for k in rows[0]}
            self.client.log_table(self.run_id, cols, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def flush(self) -> None:
        mlflow.flush_async_logging()

    def finish(self, status: str = "FINISHED") -> None:
        mlflow.flush_async_logging()
        self.client.set_terminated(self.run_id, status=status)

    @property
    def url(self) -> str:
        """A link to the run in the MLflow UI when tracking goes to a server; else where to find it."""
        return run_url(self.client.tracking_uri, self.experiment_id, self.run_id)


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"run {run_id} in {uri}"
