"""Fault injection for resume drills and tests: SIGKILL a process at a chosen point of a run.

    RLFLOW_FAULT="<stage>:<step>:<when>:<target>"   e.g. "train:3:before:flow", "rollout:1:after:rollout"

stage is a task name (rollout, reward, teacher, advantages, train, sync-weights, checkpoint, evaluate), when is
`before` or `after` that task's work, or `during@<seconds>`: that long after the work started, from a timer, while
the workers compute (a GPU lost mid-step). target is `flow` (this process), `train`, `rollout` or `critic` (rank 0
of that actor group; `train@1`: rank 1, a rank whose peers are then left in a collective), or `raise`: an
exception in the flow's first attempt only, so a Prefect flow retry (orchestration.flow_retries) gets past it, or
`nan`: after the advantages stage only, the step's advantages become NaN (a numerical blow-up for the run-health
checks to catch: the loss and gradient norm of the train step come out NaN).
Unset (the normal case), it costs one dict lookup per task.
"""

from __future__ import annotations

import os
import signal
import threading

from prefect.context import FlowRunContext

from rlflow.engines.core.protocols import RolloutBackend, TrainBackend

ENV = "RLFLOW_FAULT"


class InjectedFault(RuntimeError):
    """The `raise` fault target's exception."""


def maybe_inject(run, stage: str, step: int, when: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    f_stage, f_step, f_when, target = spec.split(":")
    f_when, _, delay = f_when.partition("@")
    if f_when == "during" and when == "before" and (f_stage, int(f_step)) == (stage, step):
        if target in ("flow", "raise"):
            raise ValueError(f"{ENV}={spec}: `during` kills a worker; its target is train, rollout or critic")
        pid = _worker_pid(run, target)  # asked now: the worker is busy (one call at a time) once the work starts
        timer = threading.Timer(float(delay or 0), os.kill, (pid, signal.SIGKILL))
        timer.daemon = True
        timer.start()
        return
    if (f_stage, int(f_step), f_when) != (stage, step, when):
        return
    if target == "nan":
        if (stage, when) != ("advantages", "after"):
            raise ValueError(f"{ENV}={spec}: `nan` poisons the advantages: give advantages:<step>:after:nan")
        run.session.steps.get(step).advantages.fill_(float("nan"))
        return
    if target == "flow":
        os.kill(os.getpid(), signal.SIGKILL)
    if target == "raise":
        ctx = FlowRunContext.get()
        if ctx is None or ctx.flow_run is None or ctx.flow_run.run_count <= 1:
            raise InjectedFault(f"{ENV}={spec}")
        return
    os.kill(_worker_pid(run, target), signal.SIGKILL)


def _worker_pid(run, target: str) -> int:
    """The process id of the worker `target` names (`train`, `rollout@1`, ...)."""
    s = run.session
    group, _, rank = target.partition("@")
    if group == "rollout":
        return s.rollout_group.call_one(int(rank or 0), RolloutBackend.pid)
    return (s.train_group if group == "train" else s.critic_group).call_one(int(rank or 0), TrainBackend.pid)
