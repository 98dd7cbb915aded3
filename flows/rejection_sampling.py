"""Rejection sampling as a flow: generate, keep what the verifier accepts, SFT on it, for a number of rounds.

    for each round:  collect (rollout -> reward -> keep reward >= threshold) -> train x steps_per_round
                     -> sync weights -> (eval) -> checkpoint

The verifier is the recipe's reward (reward.fn); sft.rejection sets the threshold, rounds, SFT steps per round
and whether later rounds also train on earlier rounds' samples. Each round's scored samples are committed to
the run store (rounds/<round>/samples.parquet), so a retried or resumed run reuses them; a checkpoint closes
every round, and a resumed run starts at the round after the last committed one.
"""

from __future__ import annotations

import time

from prefect import flow

from rlflow.engines.core.config import RLConfig
from rlflow.engines.session.sft import SFTSession
from rlflow.flows.post_train import evaluation_due
from rlflow.tasks import stages
from rlflow.tasks.run_context import RunContext, open_run


@flow(name="rejection-sampling", log_prints=True)
def rejection_sampling(config: RLConfig) -> dict[str, float]:
    """Run (or resume) `config.name`; returns the last round's metrics. SFT step numbers run over all rounds."""
    run: RunContext = open_run(config, SFTSession.factory(rejection=True),
                               ("sft.rejection.rounds * steps_per_round", config.sft.total_steps(rejection=True)))
    s = stages.bind(config)
    rs, r = config.sft.rejection, run.name
    metrics: dict[str, float] = {}
    status = "FAILED"
    try:
        for rnd in range(run.start_step // rs.steps_per_round, rs.rounds):
            t0 = time.perf_counter()
            round_metrics = s.collect(r, rnd)
            first = rnd * rs.steps_per_round
            for step in range(first, first + rs.steps_per_round):
                metrics = s.train(r, step)
                if step < first + rs.steps_per_round - 1:
                    run.tracker.log_metrics(metrics, step)
                    run.notify(step, metrics)
            metrics |= round_metrics | s.sync_weights(r, step)  # the next round samples from the trained weights
            held_out = {}
            if config.data.eval_path and evaluation_due(config.eval.every, rnd, rs.rounds - 1):  # every N rounds
                held_out = s.evaluate(r, step + 1)  # the model after step + 1 updates, logged at that step
            metrics["time/round"] = time.perf_counter() - t0
            metrics = run.log_step(step, metrics, held_out)
            s.checkpoint(r, step)
            run.notify(step, metrics)
        status = "FINISHED"
    finally:
        run.close(status)
    return metrics
