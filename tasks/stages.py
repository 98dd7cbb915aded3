"""The Prefect tasks of one RL iteration: thin wrappers that run one stage on the run's engines.

Each returns a small metric dict (never tensors); the stage's time is added as `time/<stage>`.
Prefect caching is off: a stage's output lives in the engines and the run store, not in task results.
"""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.run_context import RunContext, log


def _timed(stage: str, fn, *args) -> dict[str, float]:
    t0 = time.perf_counter()
    metrics = fn(*args)
    return metrics | {f"time/{stage}": time.perf_counter() - t0}


def _stage(name: str):
    return task(name=name, task_run_name=f"{name}-{{step}}", cache_policy=NO_CACHE, persist_result=False)


@_stage("rollout")
def rollout(run: RunContext, step: int) -> dict[str, float]:
    """Generate the step's samples, or reuse the batch a failed attempt at this step already committed."""
    t0 = time.perf_counter()
    stored = run.store.load_rollout(step) if run.cfg.checkpoint.save_rollouts else None
    if stored is not None:
        metrics = run.session.restore_rollout(step, stored)
        log.info("step %d: reusing the committed rollout batch %s", step, run.store.uri("steps", step))
    else:
        metrics = run.session.rollout(step)
        if run.cfg.checkpoint.save_rollouts:
            run.store.save_rollout(step, run.session.rollout_table(step))
    return metrics | {"time/rollout": time.perf_counter() - t0}


@_stage("reward")
def reward(run: RunContext, step: int) -> dict[str, float]:
    return _timed("reward", run.session.reward, step)


@_stage("advantages")
def advantages(run: RunContext, step: int) -> dict[str, float]:
    return _timed("advantages", run.session.advantages, step)


@_stage("train")
def train(run: RunContext, step: int) -> dict[str, float]:
    return _timed("train", run.session.train, step)


@_stage("sync-weights")
def sync_weights(run: RunContext, step: int) -> dict[str, float]:
    return _timed("sync", run.session.sync_weights, step)


@_stage("checkpoint")
def checkpoint(run: RunContext, step: int) -> dict[str, float]:
    return _timed("checkpoint", run.checkpoint, step)


@_stage("evaluate")
def evaluate(run: RunContext, step: int) -> dict[str, float]:
    t0 = time.perf_counter()
    metrics, samples = run.session.evaluate(step)
    run.tracker.log_table(samples[: run.cfg.tracking.log_samples], f"samples/eval_step_{step:06d}.json")
    return metrics | {"time/eval": time.perf_counter() - t0}
