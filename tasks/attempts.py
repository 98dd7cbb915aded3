"""Earlier attempts of a run, closed in Prefect when a new attempt takes the run over.

A killed flow process cannot report its own end: the task run it was in stays RUNNING forever on the flow run's
timeline (a "phantom" beside the retried attempt's tasks), and a flow run resumed under another flow run (a new
run of the same name) stays RUNNING too. The new attempt holds the run's lease (engines/store/lease.py), which
proves no earlier process still writes the run; so it marks what those attempts left running as CRASHED.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    TaskRunFilter,
    TaskRunFilterFlowRunId,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.states import Crashed

log = logging.getLogger("rlflow")

AUTO_RESUME_MESSAGE = "rlflow auto-resume: rescheduled after a crash"  # the automations' state (flows/auto_resume.py)
UNFINISHED = [StateType.PENDING, StateType.RUNNING]
ABANDONED = (StateType.PENDING, StateType.RUNNING, StateType.CANCELLING)  # what only a live process could leave


def close_earlier_attempts(current: str | None, earlier: Iterable[str]) -> dict[str, int]:
    """Mark CRASHED what earlier attempts of this run left unfinished: the task runs of `current` (this flow run:
    its earlier attempt's, for this attempt has started none yet) and of the `earlier` flow runs, and those flow
    runs themselves. Returns how many of each it closed. Prefect being unreachable only costs a warning: the run
    goes on, only the timeline keeps the stale states."""
    others = [fr for fr in dict.fromkeys(earlier) if fr and fr != current]
    ids = [fr for fr in [current, *others] if fr]
    if not ids:
        return {"task_runs": 0, "flow_runs": 0}
    message = "crashed: its process ended without reporting (a later attempt of the run took over)"
    closed = {"task_runs": 0, "flow_runs": 0}
    try:
        with get_client(sync_client=True) as client:
            stale = client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=ids),
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=UNFINISHED))))
            for tr in stale:
                client.set_task_run_state(tr.id, Crashed(message=message), force=True)
                closed["task_runs"] += 1
            for fr in others:
                try:
                    run = client.read_flow_run(fr)
                except ObjectNotFound:  # an attempt logged against another Prefect server
                    continue
                if run.state is not None and run.state.type in ABANDONED:
                    client.set_flow_run_state(fr, Crashed(message=message), force=True)
                    closed["flow_runs"] += 1
    except Exception as exc:  # noqa: BLE001 - the run matters more than its timeline's tidiness
        log.warning("could not close the earlier attempts' task runs in Prefect: %s: %s", type(exc).__name__, exc)
        return closed
    if any(closed.values()):
        log.info("marked crashed what earlier attempts left running: %d task run(s), %d flow run(s)",
                 closed["task_runs"], closed["flow_runs"])
    return closed


def automatic_resumes(flow_run_id: str) -> int:
    """How many attempts of this flow run the auto-resume automations started: Running states whose latest
    reschedule before them is the automations' AwaitingRetry (this attempt's included). Counted by attempt, not by
    reschedule: Prefect's trigger service has fired one automation several times for one Crashed event (an
    AwaitingRetry 4 times in 3 s), which must not use up the limit. Human retries from the UI do not count."""
    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(flow_run_id)
    return automatic_attempts(sorted(states, key=lambda s: s.timestamp))


def automatic_attempts(states: list) -> int:
    """`automatic_resumes` on a state history, oldest first (anything with .name, .type and .message)."""
    count, automatic = 0, False
    for state in states:
        if state.name == "AwaitingRetry":
            automatic = state.message == AUTO_RESUME_MESSAGE
        elif state.type == StateType.RUNNING:
            count += automatic
            automatic = False
    return count
