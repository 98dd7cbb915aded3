"""The Prefect tasks of one RL iteration: thin wrappers that run one stage on the run's engines.

Each takes (run name, step), so a task run is keyed by (run, step, stage) and its parameters are two
plain values; it returns a small metric dict (never tensors); the stage's time is added as `time/<stage>`.
Prefect's result cache is off: a stage's output lives in the engines (actor memory) and the run store, and
a cached result could not put it back there. What a retried or resumed run skips is decided by the run
store instead: committed checkpoints, and committed rollout batches that the rollout task reuses.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from prefect import State, Task, task
from prefect.cache_policies import NO_CACHE

from rlflow.engines.core.config import RLConfig
from rlflow.tasks.faults import maybe_inject
from rlflow.tasks.run_context import RunContext, active_run, log
from rlflow.tasks.time_limits import run_within


def _timed(stage: str, fn, *args) -> dict[str, float]:
    t0 = time.perf_counter()
    metrics = fn(*args)
    return metrics | {f"time/{stage}": time.perf_counter() - t0}


def _stage(name: str, in_step: Callable[[int], int] = lambda step: step):
    """A Prefect task for one stage, with the fault-injection points of tasks/faults.py around it. `in_step`: the
    training step whose timeline the stage's span belongs to (the evaluation of weight version v runs in step v - 1)."""

    field = name.replace("-", "_")  # its orchestration.stage_timeout_s field

    def wrap(fn):
        @functools.wraps(fn)
        def body(run: str, step: int) -> dict[str, float]:
            ctx = active_run(run)
            limit = getattr(ctx.cfg.orchestration.stage_timeout_s, field, 0)

            def work() -> dict[str, float]:
                with ctx.session.stage_span(name, in_step(step)):  # the stage's lane in the trace timeline
                    maybe_inject(ctx, name, step, "before")
                    out = fn(ctx, step)
                    maybe_inject(ctx, name, step, "after")
                return out

            return run_within(limit, work, lambda: StageTimeout(timeout_message(ctx.cfg, name, field, step, limit)),
                              f"rlflow-stage-{name}-{step}")

        return task(name=name, task_run_name=f"{name}-{{step}}", cache_policy=NO_CACHE, persist_result=False)(body)

    return wrap


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


@_stage("teacher")
def teacher(run: RunContext, step: int) -> dict[str, float]:
    """On-policy distillation: the teacher scores the step's samples (distill.teacher_path)."""
    return _timed("teacher", run.session.teacher, step)


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
    return run.checkpoint(step)


@_stage("evaluate", in_step=lambda version: max(version - 1, 0))
def evaluate(run: RunContext, step: int) -> dict[str, float]:
    """Held-out evaluation of the policy after `step` updates (weight version `step`): step 0 is the base model,
    before the first update; step s + 1 runs after train step s's weight sync. The flow logs its metrics at
    `step`, so the held-out curve's x is the number of updates. Beside it, the samples of the step just trained."""
    t0 = time.perf_counter()
    metrics, samples = run.session.evaluate(step)
    k = run.cfg.tracking.log_samples
    train_rows = run.session.sample_rows(step - 1, k) if step > 0 else []
    run.tracker.log_table(samples[:k], f"samples/eval_step_{step:06d}.json")
    run.tracker.log_table(train_rows, f"samples/train_step_{step - 1:06d}.json")
    if run.artifacts is not None:
        run.artifacts.samples(step, [{"kind": "rollout", **r} for r in train_rows] +
                              [{"kind": "eval", **r} for r in samples[:k]])
    return metrics | {"time/eval": time.perf_counter() - t0}


@task(name="trace", task_run_name="trace-{step}", cache_policy=NO_CACHE, persist_result=False)
def trace(run: str, step: int) -> dict[str, float]:
    """Log the step's timeline to MLflow as traces/step_<step>.json (Chrome trace JSON: opens in Perfetto)."""
    ctx = active_run(run)
    t0 = time.perf_counter()
    events = ctx.session.trace_events(step)
    ctx.tracker.log_text(json.dumps(events), trace_artifact(step))
    metrics = {"time/trace": time.perf_counter() - t0, "trace/events": float(len(events["traceEvents"]))}
    ctx.tracker.log_metrics(metrics, step)
    return metrics


def trace_artifact(step: int) -> str:
    return f"traces/step_{step:06d}.json"


@_stage("collect")
def collect(run: RunContext, step: int) -> dict[str, float]:
    """Rejection sampling: generate and verify round `step`'s samples (or reuse the round a failed attempt
    committed), then make what rounds <= step accepted the SFT pool. Earlier rounds come from the store."""
    t0 = time.perf_counter()
    rnd = step  # a round of rejection sampling is this task's step
    session = run.session
    for earlier in range(rnd):
        if earlier not in session.rounds:
            table = run.store.load_round(earlier)
            if table is None:
                raise RuntimeError(f"rejection sampling: round {earlier} is missing from {run.store.uri('rounds')}")
            session.rounds[earlier] = table
    stored = run.store.load_round(rnd)
    if stored is not None:
        metrics = session.restore_round(rnd, stored)
        session.rounds[rnd] = stored
        log.info("round %d: reusing the committed samples %s", rnd, run.store.uri("rounds", rnd))
    else:
        session.rounds[rnd], metrics = session.generate_round(rnd)
        run.store.save_round(rnd, session.rounds[rnd])
    return metrics | session.use_rounds(rnd) | {"time/collect": time.perf_counter() - t0}


IDEMPOTENT = ("rollout", "reward", "teacher", "checkpoint", "evaluate", "collect", "trace")


@dataclass(frozen=True)
class Stages:
    """The stage tasks with the recipe's retry settings applied (retries only where a rerun is safe)."""

    rollout: Task
    reward: Task
    teacher: Task
    advantages: Task
    train: Task
    sync_weights: Task
    checkpoint: Task
    evaluate: Task
    trace: Task
    collect: Task


def bind(cfg: RLConfig) -> Stages:
    """The stage tasks with the recipe's retries. Their time limits are enforced in `_stage` (tasks/time_limits.py),
    not by Prefect's task timeout, which cannot interrupt a stage in a worker thread."""
    o = cfg.orchestration
    tasks = {name: globals()[name] for name in Stages.__dataclass_fields__}
    if o.task_retries:
        for name in IDEMPOTENT:
            tasks[name] = tasks[name].with_options(retries=o.task_retries, retry_delay_seconds=o.retry_delay_s,
                                                   retry_condition_fn=_unless_timed_out)
    return Stages(**tasks)


def _unless_timed_out(task: Task, task_run: object, state: State) -> bool:
    """Retry a failed stage unless it ran past its limit: that fails the step (its work may still be running, left
    to a helper thread), and the run resumes from its last checkpoint."""
    return not isinstance(state.data, StageTimeout)


class StageTimeout(TimeoutError):
    """A stage ran past its orchestration.stage_timeout_s limit."""


def timeout_message(cfg: RLConfig, name: str, field: str, step: int, limit: float) -> str:
    """Which stage of which step, the field of its limit, and the user function it was running, by import path."""
    scorer = (f"reward.sources {[s.name or s.kind for s in cfg.reward.sources]}" if cfg.reward.sources
              else f"reward.fn {cfg.reward.fn!r}")
    user = {"reward": f" in {scorer}", "rollout": f" in rollout.fn {cfg.rollout.fn!r}"}
    return (f"stage {name} of step {step} ran longer than orchestration.stage_timeout_s.{field} "
            f"({limit:g} s){user.get(name, '')}; the run resumes from its last checkpoint")
