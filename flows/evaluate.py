"""The evaluation flow: one checkpoint, one or more held-out datasets, its own MLflow run.

    locate + download the checkpoint's HF export -> per dataset, per shard of its prompts (a Prefect task each):
    generate n samples per prompt with the rollout engine and reward them -> per dataset: merge the shards and
    score (accuracy, mean reward, pass@k, response length) -> MLflow run (tagged with the training run) + Prefect
    table artifact + markdown report

The checkpoint is a run-store URI (file:// or s3://, read through engines/store/run_store.py), a run in a store
(its newest committed checkpoint), or a local Hugging Face model directory.

Shards (`eval.shards`) run on `eval.shard_runner`: threads of this process sharing one engine, or Ray tasks
through prefect-ray's RayTaskRunner, the one place rlflow fans Prefect tasks out on a cluster: each shard is
independent CPU (or GPU) work of seconds to minutes, and a shard's result is a few plain lists. The model
actors of a training run are Ray actors, never Prefect tasks (docs/architecture.md).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from rlflow.engines.cluster.groups import worker_runtime_env
from rlflow.engines.core.config import EvalSamplingConfig, EvaluationConfig, public_tree, resolve_config
from rlflow.engines.data.rewards import load_reward_fn
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.evaluation import eval_rows, generate_and_reward, merge_and_score, shard_bounds
from rlflow.engines.store.run_store import RunStore, locate_checkpoint
from rlflow.tasks.artifacts import artifact_key, fmt
from rlflow.tasks.tracking import Tracker

DEFAULT_MAX_NEW_TOKENS = 8
LOCAL_RAY_OBJECT_STORE_MB = 256  # a shard's result is a few lists; Ray's default takes 30% of the host's memory


def is_hf_model_dir(path: Path) -> bool:
    """A Hugging Face model directory: config.json beside safetensors weights (a run folder has config.json only)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


@functools.lru_cache(maxsize=1)
def rollout_engine(model_dir: str, device: str, threads: int, batch_size: int) -> TorchRolloutBackend:
    """The embedded rollout engine on the checkpoint, loaded once per process: once in the flow process for all
    datasets and thread shards, once in each Ray worker process for all the shards it runs."""
    return TorchRolloutBackend(model_dir, device=device, threads=threads, batch_size=batch_size)


_engine_lock = threading.Lock()  # thread shards start together: one loads the engine, the others wait for it
_fetched: dict[str, str] = {}  # checkpoint -> the model directory this process exported (a Ray worker elsewhere)


def shard_engine(cfg: EvaluationConfig, model_dir: str) -> TorchRolloutBackend:
    with _engine_lock:
        e = cfg.eval
        return rollout_engine(model_dir_here(cfg, model_dir), e.device, e.threads, e.batch_size)


def model_dir_here(cfg: EvaluationConfig, model_dir: str) -> str:
    """The flow's model directory where this process sees it (the flow's machine, a shared disk); else, in a Ray
    worker on another node, this process's own export of the checkpoint, fetched once and removed at exit."""
    if is_hf_model_dir(Path(model_dir)):
        return model_dir
    if cfg.checkpoint not in _fetched:
        workdir = tempfile.mkdtemp(prefix=f"rlflow-eval-{cfg.name}-")
        atexit.register(shutil.rmtree, workdir, True)
        _fetched[cfg.checkpoint] = str(fetch_checkpoint(cfg, Path(workdir))[0])
    return _fetched[cfg.checkpoint]


def fetch_checkpoint(cfg: EvaluationConfig, workdir: Path) -> tuple[Path, dict]:
    """A local HF model directory for `cfg.checkpoint`, and the checkpoint's meta.json ({} for an HF directory)."""
    local = Path(cfg.checkpoint.removeprefix("file://"))
    if is_hf_model_dir(local):
        return local, {}
    store, step = locate_checkpoint(cfg.checkpoint, cfg.storage)
    model_dir = store.export_model(step, workdir / "model")
    meta = store.read_json("checkpoints", step, "meta.json")
    return model_dir, meta | {"checkpoint_uri": store.uri("checkpoints", step),
                              "chat_template": trained_with_chat(store)}


def trained_with_chat(store: RunStore) -> bool:
    """Whether the run rendered its prompts with the chat template (data.chat_template of its stored recipe)."""
    recipe = store.read_json("config.json") if store.exists("config.json") else {}
    return bool(recipe.get("data", {}).get("chat_template", False))


def with_prompt_rendering(cfg: EvaluationConfig, source: dict) -> EvaluationConfig:
    """`cfg` with eval.chat_template decided: as given, else as the checkpoint's run trained (False for an HF
    directory, which records no recipe), so its prompts reach the model as they did in training."""
    if cfg.eval.chat_template is not None:
        return cfg
    rendered = bool(source.get("chat_template", False))
    return cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"chat_template": rendered})})


@task(name="load-checkpoint", cache_policy=NO_CACHE, persist_result=False)
def load_checkpoint(cfg: EvaluationConfig, workdir: str) -> dict:
    model_dir, meta = fetch_checkpoint(cfg, Path(workdir))
    return {"model_dir": str(model_dir), **meta}


@task(name="evaluate-shard", task_run_name="evaluate-{dataset}-from-{first_prompt}", cache_policy=NO_CACHE,
      persist_result=False)
def evaluate_shard(cfg: EvaluationConfig, model_dir: str, dataset: str, rows: list[dict], first_prompt: int) -> dict:
    """Generate and reward one shard of a dataset's prompts (`rows`, from prompt `first_prompt` on). Returns plain
    lists (rewards, lengths, sample rows): no tensors through Prefect or Ray results."""
    e, fn = cfg.eval, cfg.reward.only_fn("the evaluate flow")
    return generate_and_reward(shard_engine(cfg, model_dir), load_reward_fn(fn.fn), fn.kwargs,
                               dataset, rows, first_prompt, e, e.max_new_tokens or DEFAULT_MAX_NEW_TOKENS)


def shard_runner(e: EvalSamplingConfig, num_tasks: int) -> TaskRunner:
    """The task runner of `e.shard_runner`. Ray joins `e.ray_address` or RAY_ADDRESS, else starts a private local
    Ray of shards x threads CPUs ("local": never a stray cluster found in /tmp/ray), shut down when the runner
    exits; workers get the driver's PYTHONPATH so they import rlflow and user rewards as the flow does."""
    if e.shard_runner == "thread":
        return ThreadPoolTaskRunner(max_workers=num_tasks)
    init = {"runtime_env": worker_runtime_env(), "log_to_driver": True}
    address = e.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        init["address"] = address
    else:
        init |= {"address": "local", "num_cpus": e.shards * e.threads, "include_dashboard": False,
                 "object_store_memory": LOCAL_RAY_OBJECT_STORE_MB * 1024 * 1024}
    return RayTaskRunner(init_kwargs=init)


@contextmanager
def shard_task_settings(e: EvalSamplingConfig) -> Iterator[None]:
    """Around submitting shards to Ray: each task gets `threads` CPUs (a GPU on cuda) and this flow run's Prefect
    API. Without PREFECT_API_URL the API is a temporary server started by this process; a worker hydrating the
    flow's settings would start one of its own, so its address is pinned in the settings the tasks carry (it is
    on loopback: a multi-node cluster needs a real server, `rlflow serve` or PREFECT_API_URL). Threads: nothing."""
    if e.shard_runner == "thread":
        yield
        return
    api = nullcontext() if PREFECT_API_URL.value() else temporary_settings(
        {PREFECT_API_URL: str(FlowRunContext.get().client.api_url)})
    with api, remote_options(num_cpus=e.threads, num_gpus=1 if e.device == "cuda" else 0):
        yield


def evaluate_datasets(cfg: EvaluationConfig, model_dir: str) -> tuple[dict[str, dict[str, float]], list[dict]]:
    """Every dataset's shards as tasks on `eval.shard_runner`, all submitted before any is awaited; then each
    dataset is scored once on its merged shards (pass@k included), never as an average of shard metrics."""
    e = cfg.eval
    plan = {}
    for d in e.datasets:
        rows = eval_rows(d, e, cfg.storage.fsspec_options(d.path))
        plan[d.key] = [(start, rows[start:stop]) for start, stop in shard_bounds(len(rows), e.shards)]
    with shard_runner(e, sum(map(len, plan.values()))) as runner, shard_task_settings(e):
        futures = {name: [runner.submit(evaluate_shard, {"cfg": cfg, "model_dir": model_dir, "dataset": name,
                                                         "rows": rows, "first_prompt": start})
                          for start, rows in shards]
                   for name, shards in plan.items()}
        parts = {name: [f.result() for f in fs] for name, fs in futures.items()}
    per_dataset, samples = {}, []
    for name, shard_results in parts.items():
        per_dataset[name], rows = merge_and_score(shard_results, e)
        samples += rows
    return per_dataset, samples


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
        f"reward `{cfg.reward.fn}`, prompts {'in the chat template' if cfg.eval.chat_template else 'as raw text'}",
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


@flow(name="evaluate", log_prints=True, validate_parameters=False)  # a part of `config` is no EvaluationConfig
def evaluate(
    config: EvaluationConfig | None = None, recipe: str | None = None, overrides: list[str] | None = None
) -> dict[str, float]:
    """Evaluate a checkpoint on held-out datasets; returns `eval/<dataset>/<metric>` values (the
    names it logs to MLflow, where they make the run's `eval` chart section).

    Args:
        config: The configuration tree (EvaluationConfig), whole or in part: deep-merged over `recipe`
            (docs/deployments.md). A deployment's run form opens with its recipe here.
        recipe: A recipe file relative to the working directory, read as the CLI reads it
            (e.g. deployments/eval-sort-tiny.yaml): the base that `config` merges into.
        overrides: KEY.PATH=VALUE changes applied last (e.g. checkpoint=runs/sort-tiny/checkpoints/49).
    """
    cfg = resolve_config(EvaluationConfig, config, recipe, overrides)
    cfg.reward.only_fn("the evaluate flow")  # before any shard starts: it scores with one function
    workdir = tempfile.mkdtemp(prefix=f"rlflow-eval-{cfg.name}-")
    try:
        source = load_checkpoint(cfg, workdir)
        cfg = with_prompt_rendering(cfg, source)
        training_run = cfg.training_run_id or source.get("mlflow_run_id")
        tags = {"rlflow.kind": "evaluation", "rlflow.checkpoint": source.get("checkpoint_uri", cfg.checkpoint)}
        if training_run:
            tags |= {"rlflow.training_run_id": training_run, "mlflow.parentRunId": training_run}
        recipe_json = public_tree(cfg)
        tracker = Tracker(cfg.tracking.uri, cfg.tracking.experiment, cfg.name, recipe_json, tags,
                          policy=cfg.tracking.retry_policy(), timeout_s=cfg.tracking.timeout_s)
        status = "FAILED"
        try:
            per_dataset, samples = evaluate_datasets(cfg, source["model_dir"])
            metrics = {f"eval/{name}/{k}": v for name, m in per_dataset.items() for k, v in m.items()}
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
