"""MLflow tracking for a run: params from the resolved config, per-step metrics, tables and artifacts.

Metric logging is asynchronous (MLflow's own queue), so tracking never sits on a step's critical path.
"""

from __future__ import annotations

import json
import math
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

from engines.config import RLConfig


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

    def __init__(self, cfg: RLConfig, run_id: str | None = None):
        mlflow.set_tracking_uri(cfg.tracking.uri)
        self.client = MlflowClient(cfg.tracking.uri)
        exp = self.client.get_experiment_by_name(cfg.tracking.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.tracking.experiment)
        if run_id is None:
            run = self.client.create_run(exp_id, run_name=cfg.name, tags={"rlflow.run": cfg.name})
            self.run_id = run.info.run_id
            recipe = cfg.model_dump(mode="json", exclude={"storage": {"key", "secret"}})
            params = {k: str(v)[:6000] for k, v in flatten(recipe).items()}
            items = list(params.items())
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=[mlflow.entities.Param(k, v) for k, v in items[i : i + 100]])
            self.client.log_text(self.run_id, json.dumps(recipe, indent=2), "recipe.json")
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        clean = {k.replace("/", "."): float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        mlflow.log_metrics(clean, step=step, run_id=self.run_id, synchronous=False)

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
        return f"{mlflow.get_tracking_uri()} run {self.run_id}"
