"""Prefect artifacts of a training run: what the Prefect UI shows about it besides task states.

- a progress artifact, moved in 5 % steps (at most ~20 API calls a run, never one per sample);
- a markdown summary at each checkpoint: step, reward, last eval, where the checkpoint is, the MLflow run;
- a table of sample rollouts at each eval;
- a table of the run-health checks that fired (tasks/health.py), when one fires.
Keys are per run name, so the artifact page of a run keeps the history of each.
"""

from __future__ import annotations

import re

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


class TrainingArtifacts:
    """Made once per flow run; each method is one Prefect API call (or none)."""

    PROGRESS_STEP = 5.0  # percent

    def __init__(self, run_name: str, total_steps: int, start_step: int, mlflow_url: str):
        self.run, self.total, self.mlflow_url = run_name, total_steps, mlflow_url
        self.percent = min(100.0, 100.0 * start_step / total_steps)
        self.last_eval: dict[str, float] = {}
        self.progress_id = create_progress_artifact(
            progress=self.percent, key=artifact_key(run_name, "progress"),
            description=f"Training progress of run {run_name} ({total_steps} steps)",
        )

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        if "eval/reward_mean" in metrics:
            self.last_eval = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        percent = min(100.0, 100.0 * (step + 1) / self.total)
        if percent >= 100.0 or percent - self.percent >= self.PROGRESS_STEP:
            self.percent = percent
            update_progress_artifact(self.progress_id, percent)

    def checkpoint(self, step: int, metrics: dict[str, float], uri: str) -> None:
        lines = [
            f"# {self.run}: checkpoint at step {step}",
            "",
            "| | |",
            "| --- | --- |",
            f"| step | {step} of {self.total} |",
            f"| reward (rollout mean) | {fmt(metrics.get('rollout/reward_mean'))} |",
            f"| accuracy (rollout) | {fmt(metrics.get('rollout/accuracy'))} |",
        ]
        evals = {k: v for k, v in metrics.items() if k.startswith("eval/")} or self.last_eval  # this step's, or older
        for k, v in sorted(evals.items()):
            lines.append(f"| {k} (latest eval) | {fmt(v)} |")
        lines += [f"| checkpoint | `{uri}` |", f"| MLflow | {self.mlflow_url} |"]
        create_markdown_artifact("\n".join(lines), key=artifact_key(self.run, "checkpoint"),
                                 description=f"{self.run}: checkpoint summary at step {step}")

    def health(self, step: int, rows: list[dict]) -> None:
        """The run-health findings of this attempt so far (tasks/health.py), one row each."""
        if rows:
            create_table_artifact(rows, key=artifact_key(self.run, "health"),
                                  description=f"{self.run}: run-health checks that fired, as of step {step}")

    def samples(self, step: int, rows: list[dict]) -> None:
        if rows:
            create_table_artifact(rows, key=artifact_key(self.run, "samples"),
                                  description=f"{self.run}: sample rollouts at step {step}")
