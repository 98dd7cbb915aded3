"""rlflow's log lines in the Prefect run's logs (the UI's Logs tab), not only on the console.

The `rlflow` logger (checkpoints committed, resumes, cleaned leftovers, one summary line per step) is plain
`logging`, so the engines below tasks/ stay free of Prefect. While a flow runs, its records also go to
Prefect's API log handler, linked to the task run that logged them, or to the flow run when a worker
thread without a Prefect context logged them. Set PREFECT_LOGGING_EXTRA_LOGGERS=rlflow instead and
Prefect attaches its handler itself; this module then adds nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prefect.context import FlowRunContext, get_run_context
from prefect.exceptions import MissingContextError
from prefect.logging.handlers import APILogHandler

log = logging.getLogger("rlflow")
# the per-step summary lines: to the Prefect run's logs only, not the console (where `rlflow run` shows a
# progress bar and a worker's terminal would scroll a line per step)
step_log = logging.getLogger("rlflow.steps")
step_log.propagate = False

# per step, these metrics (when the step has them) make the summary line, in this order
SUMMARY = (("rollout/reward_mean", "reward"), ("rollout/accuracy", "accuracy"), ("train/loss", "loss"),
           ("eval/reward_mean", "eval reward"), ("time/step", "step s"))


def send_to_prefect() -> Callable[[], None]:
    """Route the rlflow logger to the current flow run's logs; returns the undo (call it when the run ends).
    Outside a flow run, or when Prefect already handles the logger, it does nothing."""
    flow = FlowRunContext.get()
    if flow is None or flow.flow_run is None or any(isinstance(h, APILogHandler) for h in log.handlers):
        return lambda: None
    handler = APILogHandler()
    handler.setLevel(logging.INFO)
    handler.addFilter(_LinkToFlowRun(str(flow.flow_run.id)))
    levels = {logger: logger.level for logger in (log, step_log)}
    for logger in levels:
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        logger.addHandler(handler)

    def undo() -> None:
        for logger, level in levels.items():
            logger.removeHandler(handler)
            logger.setLevel(level)

    return undo


def step_summary(step: int, steps: int, metrics: dict[str, float]) -> str:
    """One line per step, e.g. 'step 11 (12 of 100): reward 0.412, accuracy 0.250, loss -0.013, step s 0.874'. The
    step counts from 0, as the tasks (train-11) and checkpoints do; the count in brackets is how far the run is."""
    parts = [f"{label} {metrics[key]:.3f}" for key, label in SUMMARY if key in metrics]
    return f"step {step} ({step + 1} of {steps}): " + ", ".join(parts)


class _LinkToFlowRun(logging.Filter):
    """Records logged outside any Prefect run context (a worker thread) belong to the flow run."""

    def __init__(self, flow_run_id: str):
        super().__init__()
        self.flow_run_id = flow_run_id

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "flow_run_id", None) is None:
            try:
                get_run_context()
            except MissingContextError:
                record.flow_run_id = self.flow_run_id
        return True
