"""The evaluation flow: one checkpoint, one or more held-out datasets, its own MLflow run.

    locate + download the checkpoint's HF export -> per dataset: generate n samples per prompt with the
    rollout engine, reward them, score (accuracy, mean reward, pass@k, response length) -> MLflow run
    (tagged with the training run) + Prefect table artifact + markdown report

The checkpoint is a run-store URI (file:// or s3://, read through engines/store/run_store.py), a run in a store
(its newest committed checkpoint), or a local Hugging Face model directory.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from rlflow.engines.core.config import EvaluationConfig, resolve_config
from rlflow.engines.data.rewards import load_reward_fn
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.evaluation import evaluate_dataset
from rlflow.engines.store.run_store import locate_checkpoint
from rlflow.tasks.artifacts import artifact_key, fmt
from rlflow.tasks.tracking import Tracker

DEFAULT_MAX_NEW_TOKENS = 8


def is_hf_model_dir(path: Path) -> bool:
    """A Hugging Face model directory: config.json beside safetensors weights (a run folder has config.json only)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


@functools.lru_cache(maxsize=1)
def rollout_engine(model_dir: str, device: str, threads: int, batch_size: int) -> TorchRolloutBackend:
    """The embedded rollout engine on the checkpoint, loaded once for all datasets."""
    return TorchRolloutBackend(model_dir, device=device, threads=threads, batch_size=batch_size)


def fetch_checkpoint(cfg: EvaluationConfig, workdir: Path) -> tuple[Path, dict]:
    """A local HF model directory for `cfg.checkpoint`, and the checkpoint's meta.json ({} for an HF directory)."""
    local = Path(cfg.checkpoint.removeprefix("file://"))
    if is_hf_model_dir(local):
        return local, {}
    store, step = locate_checkpoint(cfg.checkpoint, cfg.storage)
    model_dir = store.export_model(step, workdir / "model")
    meta = store.read_json("checkpoints", step, "meta.json")
    return model_dir, meta | {"checkpoint_uri": store.uri("checkpoints", step)}


@task(name="load-checkpoint", cache_policy=NO_CACHE, persist_result=False)
def load_checkpoint(cfg: EvaluationConfig, workdir: str) -> dict:
    model_dir, meta = fetch_checkpoint(cfg, Path(workdir))
    return {"model_dir": str(model_dir), **meta}


@task(name="evaluate-dataset", task_run_name="evaluate-{name}", cache_policy=NO_CACHE, persist_result=False)
def evaluate_one(cfg: EvaluationConfig, model_dir: str, name: str) -> tuple[dict[str, float], list[dict]]:
    dataset = next(d for d in cfg.eval.datasets if d.key == name)
    e = cfg.eval
    engine = rollout_engine(model_dir, e.device, e.threads, e.batch_size)
    return evaluate_dataset(engine, load_reward_fn(cfg.reward.fn), cfg.reward.kwargs, dataset, e,
                            e.max_new_tokens or DEFAULT_MAX_NEW_TOKENS)


def report(cfg: EvaluationConfig, source: dict, per_dataset: dict[str, dict], samples: list[dict], url: str) -> str:
    """The markdown report: what was evaluated, a metrics table per dataset, a few samples."""
    keys = list(next(iter(per_dataset.values())))
    lines = [
        f"# Evaluation {cfg.name}",
        "",
        f"- checkpoint: `{source.get('checkpoint_uri', cfg.checkpoint)}`" + (
            f" (step {source['step']})" if "step" in source else ""),
        f"- training run (MLflow): {cfg.training_run_id or source.get('mlflow_run_id') or '-'}",
        f"- evaluation run (MLflow): {url}",
        f"- {cfg.eval.samples_per_prompt} samples per prompt, temperature {cfg.eval.temperature}, "
        f"reward `{cfg.reward.fn}`",
        "",
        "| dataset | " + " | ".join(keys) + " |",
        "| --- | " + " | ".join("---" for _ in keys) + " |",
    ]
    lines += [f"| {name} | " + " | ".join(fmt(m[k]) for k in keys) + " |" for name, m in per_dataset.items()]
    if samples:
        lines += ["", "## Samples", "", "| dataset | prompt | response | label | reward |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {s['dataset']} | `{s['prompt']}` | `{s['response']}` | `{s['label']}` | {s['reward']:.3g} |"
                  for s in samples]
    return "\n".join(lines)


@flow(name="evaluate", log_prints=True)
def evaluate(
    config: EvaluationConfig | None = None, recipe: str | None = None, overrides: list[str] | None = None
) -> dict[str, float]:
    """Evaluate a checkpoint on held-out datasets; returns `<dataset>/<metric>` values.

    Args:
        config: The whole configuration tree (EvaluationConfig). Leave empty to use `recipe`.
        recipe: A recipe file relative to the working directory, read as the CLI reads it
            (e.g. deployments/eval-sort-tiny.yaml). Leave empty when `config` is given.
        overrides: KEY.PATH=VALUE changes applied on top of `config` or `recipe`
            (e.g. checkpoint=runs/sort-tiny/checkpoints/49).
    """
    cfg = resolve_config(EvaluationConfig, config, recipe, overrides)
    workdir = tempfile.mkdtemp(prefix=f"rlflow-eval-{cfg.name}-")
    try:
        source = load_checkpoint(cfg, workdir)
        training_run = cfg.training_run_id or source.get("mlflow_run_id")
        tags = {"rlflow.kind": "evaluation", "rlflow.checkpoint": source.get("checkpoint_uri", cfg.checkpoint)}
        if training_run:
            tags |= {"rlflow.training_run_id": training_run, "mlflow.parentRunId": training_run}
        if flow_run.id:
            tags["prefect.flow_run_id"] = flow_run.id
        recipe_json = cfg.model_dump(mode="json", exclude={"storage": {"key", "secret"}})
        tracker = Tracker(cfg.tracking.uri, cfg.tracking.experiment, cfg.name, recipe_json, tags)
        status = "FAILED"
        try:
            per_dataset, samples = {}, []
            for d in cfg.eval.datasets:
                per_dataset[d.key], rows = evaluate_one(cfg, source["model_dir"], d.key)
                samples += rows
            metrics = {f"{name}/{k}": v for name, m in per_dataset.items() for k, v in m.items()}
            tracker.log_metrics(metrics, step=int(source.get("step", 0)))
            tracker.log_table(samples, "samples/eval.json")
            markdown = report(cfg, source, per_dataset, samples, tracker.url)
            tracker.log_text(markdown, "report.md")
            create_table_artifact([{"dataset": name, **m} for name, m in per_dataset.items()],
                                  key=artifact_key(cfg.name, "metrics"), description=f"Evaluation {cfg.name}: metrics")
            create_markdown_artifact(markdown, key=artifact_key(cfg.name, "report"),
                                     description=f"Evaluation {cfg.name}: report")
            status = "FINISHED"
        finally:
            tracker.finish(status)
        print(f"evaluation {cfg.name}: {metrics} (MLflow: {tracker.url})")
        return metrics
    finally:
        rollout_engine.cache_clear()
        shutil.rmtree(workdir, ignore_errors=True)
