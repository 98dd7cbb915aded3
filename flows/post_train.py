"""The post-training flow: one flow run per training run, one task per stage per step.

    (eval of the base model) then, per step:
    rollout -> reward -> (teacher) -> advantages -> train -> sync weights -> (eval) -> log metrics -> health
    -> (checkpoint)

An evaluation measures the policy after v updates and is logged at step v (0: the base model, before step 0).

With rollout.max_staleness = k > 0 (asynchronous training) the rollout tasks of up to k later steps run beside
the step that trains (engines/session/schedule.py): with k = 1 the sync waits for the one in flight (one-step-off),
with k >= 2 it updates the weights under them; a sample is never more than k updates stale.
Debug modes (debug.mode): rollout_only stops after reward; train_only replays stored batches and has no
rollout workers, so it skips eval. With debug.trace_every N, every Nth step's timeline goes to MLflow.

Prefect carries step numbers and metric dicts; tensors stay in the Ray actors and the run store.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prefect import flow
from prefect.states import Completed

from rlflow.engines.core.config import CheckpointConfig, RLConfig, resolve_config
from rlflow.engines.session.schedule import RolloutSchedule
from rlflow.tasks import stages
from rlflow.tasks.artifacts import TrainingArtifacts
from rlflow.tasks.health import check_step
from rlflow.tasks.run_context import NothingToResume, RunContext, open_run


def _due(every: int, step: int, last: int) -> bool:
    """Every `every` steps and at the last step (checkpoint.every: 0 still saves the last step)."""
    return step == last or (every > 0 and (step + 1) % every == 0)


def evaluation_due(every: int, step: int, last: int) -> bool:
    """eval.every: after every `every` steps' updates and after the last; 0 disables evaluation, the last step's
    included. (With evaluation on, a fresh run also evaluates its base model before the first update.)"""
    return every > 0 and _due(every, step, last)


class CheckpointSchedule:
    """Which steps save a checkpoint: every `checkpoint.every` steps, the step in which `checkpoint.every_minutes`
    pass since the last save (or the start of this attempt), and the last step. The flow alone decides, so every
    rank saves at the same steps."""

    def __init__(self, cfg: CheckpointConfig, last: int, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.last, self.clock = cfg, last, clock
        self.since = clock()

    def due(self, step: int) -> bool:
        minutes = self.cfg.every_minutes
        late = minutes > 0 and self.clock() - self.since >= minutes * 60
        return late or _due(self.cfg.every, step, self.last)

    def saved(self) -> None:
        self.since = self.clock()


@flow(name="post-train", log_prints=True, validate_parameters=False)  # a part of `config` is no RLConfig
def post_train(
    config: RLConfig | None = None, recipe: str | None = None, overrides: list[str] | None = None
) -> dict[str, float]:
    """Run (or resume) an RL run and return its last step's metrics.

    Args:
        config: The configuration tree (RLConfig), whole or in part: deep-merged over `recipe`
            (docs/deployments.md). A deployment's run form opens with its recipe here.
        recipe: A recipe file relative to the working directory, read as the CLI reads it
            (e.g. deployments/sort-tiny.yaml): the base that `config` merges into.
        overrides: KEY.PATH=VALUE changes applied last (e.g. train.steps=20).
    """
    config = resolve_config(RLConfig, config, recipe, overrides)
    try:
        run: RunContext = open_run(config)
    except NothingToResume as done:  # an automatic resume of a finished run: it stays as it finished
        return Completed(message=str(done))
    s = stages.bind(config)  # the stage tasks, with the recipe's retry settings
    r = run.name  # tasks take (run name, step): Prefect records two plain values per task run
    last = config.train.steps - 1
    metrics: dict[str, float] = {}
    status = "FAILED"
    debug = config.debug
    rollouts = RolloutSchedule(
        config.rollout.max_staleness, last, run=lambda step: s.rollout(r, step),
        submit=lambda step, after: s.rollout.submit(r, step, wait_for=[after] if after is not None else None),
        version=lambda: run.session.weight_version, chain=config.rollout.dynamic_sampling.enabled)
    checkpoints = CheckpointSchedule(config.checkpoint, last)
    evals = debug.mode is None and bool(config.data.eval_path) and config.eval.every > 0
    try:
        run.artifacts = TrainingArtifacts(config.name, config.train.steps, run.start_step, run.tracker.url)
        if evals and run.start_step == 0:  # the base model: the held-out curve starts before the first update
            run.tracker.log_metrics(s.evaluate(r, 0), 0)
        for step in range(run.start_step, config.train.steps):
            t0 = time.perf_counter()
            # the step's samples; later steps' rollouts start as the staleness bound allows and run beside it
            metrics = rollouts.take(step)
            metrics |= s.reward(r, step)
            if debug.trains:
                if config.distill.enabled:  # the teacher scores the student's samples (on-policy distillation)
                    metrics |= s.teacher(r, step)
                metrics |= s.advantages(r, step)
                metrics |= s.train(r, step)
                metrics |= rollouts.before_sync(step)  # k = 1: waits for the rollout in flight; k >= 2 syncs under it
                metrics |= s.sync_weights(r, step)
            held_out = s.evaluate(r, step + 1) if evals and evaluation_due(config.eval.every, step, last) else {}
            metrics["time/step"] = time.perf_counter() - t0
            metrics = run.log_step(step, metrics, held_out)
            check_step(run, step, metrics)  # run health: warns, or fails the run before its checkpoint
            if debug.trains and checkpoints.due(step):  # after logging: a committed step has its metrics
                s.checkpoint(r, step)
                checkpoints.saved()
                run.artifacts.checkpoint(step, metrics, run.store.uri("checkpoints", step))
            if debug.traced(step):
                s.trace(r, step)
            run.artifacts.step_done(step, metrics)
            run.notify(step, metrics)
        status = "FINISHED"
    finally:
        run.close(status)
    return metrics
