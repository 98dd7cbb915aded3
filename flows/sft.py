"""The SFT flow: supervised fine-tuning on prompt/response pairs, one flow run per run, one task per stage.

    train (sft_step) -> [sync weights -> eval] -> log metrics -> (checkpoint)

The loss covers the response tokens only (rlflow.engines.core.algorithms.sft_loss). Same engines, run store, resume and
MLflow tracking as post_train: a run whose name has a committed checkpoint continues from it. A typical cold
start: `rlflow sft` on demonstrations, `rlflow export` the result, then `rlflow run` with model.path set to it.
"""

from __future__ import annotations

import time

from prefect import flow

from rlflow.engines.core.config import RLConfig
from rlflow.engines.session.sft import SFTSession
from rlflow.flows.post_train import CheckpointSchedule, evaluation_due
from rlflow.tasks import stages
from rlflow.tasks.run_context import RunContext, open_run


@flow(name="sft", log_prints=True)
def sft(config: RLConfig) -> dict[str, float]:
    """Run (or resume) the SFT run `config.name` for sft.steps optimizer steps; returns the last step's metrics."""
    run: RunContext = open_run(config, SFTSession.factory(rejection=False), ("sft.steps", config.sft.steps))
    s = stages.bind(config)
    r, last = run.name, config.sft.steps - 1
    metrics: dict[str, float] = {}
    status = "FAILED"
    checkpoints = CheckpointSchedule(config.checkpoint, last)
    evals = bool(config.data.eval_path) and config.eval.every > 0
    try:
        if evals and run.start_step == 0:  # the base model, logged at step 0 (as post_train does)
            run.tracker.log_metrics(s.evaluate(r, 0), 0)
        for step in range(run.start_step, config.sft.steps):
            t0 = time.perf_counter()
            metrics = s.train(r, step)
            held_out = {}
            if evals and evaluation_due(config.eval.every, step, last):
                metrics |= s.sync_weights(r, step)  # the rollout engine evaluates the weights just trained
                held_out = s.evaluate(r, step + 1)
            metrics["time/step"] = time.perf_counter() - t0
            metrics = run.log_step(step, metrics, held_out)
            if checkpoints.due(step):
                s.checkpoint(r, step)
                checkpoints.saved()
            run.notify(step, metrics)
        status = "FINISHED"
    finally:
        run.close(status)
    return metrics
