"""Work pools of a project, as `rlflow serve` runs them: one Prefect work pool per pool of machines (a laptop's CPU,
a GPU node), each with a concurrency limit, its work queues by priority, and a process worker; and the flow runs
on them, which serve stops with itself.

The pools come from the project's prefect.yaml: every `work_pool.name` its deployments use, with the settings of
`definitions.pools` (a block Prefect leaves alone):

    definitions:
      pools:
        rlflow-process: {concurrency_limit: 1, queues: {urgent: 1, default: 10}}

A run submitted while its pool is full waits Scheduled (the UI marks it Late) until a slot frees; a pool's queues
are served by priority (1 first). `rlflow serve --pool-limit NAME=N` overrides a pool's limit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import yaml
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound, PrefectHTTPStatusError
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Cancelling, Crashed
from prefect.workers.process import ProcessWorker

from rlflow.flows.project import ProjectError

STOP_GRACE_S = 60.0  # how long a stopping serve waits for its runs to end (Prefect's own cancel grace is 30 s)
T = TypeVar("T")
BUSY_S = 60.0  # how long a stopping serve keeps asking a server that answers 5xx (its SQLite locked, under load)


@dataclass
class PoolSpec:
    """One work pool: its concurrency limit (None: unlimited) and its queues, {name: priority}."""
    name: str
    concurrency_limit: int | None = None
    queues: dict[str, int] = field(default_factory=dict)


def project_pools(prefect_file: Path, limits: dict[str, int] | None = None, default: str | None = None
                  ) -> list[PoolSpec]:
    """The pools the deployments of `prefect_file` use (or `default` alone, for a serve that does not deploy), with
    `definitions.pools` settings and `limits` over them; errors name the file and the key."""
    raw = yaml.safe_load(prefect_file.read_text()) or {} if prefect_file.is_file() else {}
    names = list(dict.fromkeys(
        (d.get("work_pool") or {}).get("name") for d in raw.get("deployments") or []))
    names = [n for n in names if n] or ([default] if default else [])
    settings = ((raw.get("definitions") or {}).get("pools") or {})
    if not isinstance(settings, dict):
        raise ProjectError(f"{prefect_file}: definitions.pools must map pool names to settings, got {settings!r}")
    pools = []
    for name in names:
        s = settings.get(name) or {}
        unknown = set(s) - {"concurrency_limit", "queues"}
        if unknown:
            raise ProjectError(f"{prefect_file}: definitions.pools.{name}: unknown key(s) {sorted(unknown)}; expected "
                               "concurrency_limit, queues")
        limit = s.get("concurrency_limit")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ProjectError(f"{prefect_file}: definitions.pools.{name}.concurrency_limit: expected a whole number "
                               f">= 0 or nothing, got {limit!r}")
        queues = s.get("queues") or {}
        if not isinstance(queues, dict) or not all(isinstance(p, int) and p >= 1 for p in queues.values()):
            raise ProjectError(f"{prefect_file}: definitions.pools.{name}.queues: expected {{queue: priority >= 1}}, "
                               f"got {queues!r}")
        pools.append(PoolSpec(name, limit, dict(queues)))
    for name, limit in (limits or {}).items():
        match = [p for p in pools if p.name == name]
        if not match:
            raise ProjectError(f"--pool-limit {name}={limit}: no deployment of {prefect_file} uses pool {name!r} "
                               f"(its pools: {', '.join(p.name for p in pools) or 'none'})")
        match[0].concurrency_limit = limit
    return pools


def parse_limits(texts: list[str]) -> dict[str, int]:
    """--pool-limit NAME=N values -> {name: N}; an error names the bad one."""
    out = {}
    for text in texts:
        name, _, value = text.partition("=")
        if not name or not value.isdigit():
            raise ProjectError(f"--pool-limit {text!r}: expected NAME=N, N a whole number (0: the pool takes no run)")
        out[name] = int(value)
    return out


def ensure_pools(api_url: str, pools: list[PoolSpec]) -> None:
    """Create each pool (process type) if missing, set its concurrency limit, and create or re-prioritise its
    queues: what prefect.yaml and the command line say wins over what the server kept from before."""
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        template = ProcessWorker.get_default_base_job_template()
        for pool in pools:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_work_pool(WorkPoolCreate(name=pool.name, type="process", base_job_template=template))
            client.update_work_pool(pool.name, WorkPoolUpdate(concurrency_limit=pool.concurrency_limit,
                                                              is_paused=False))
            for queue, priority in pool.queues.items():
                try:
                    q = client.read_work_queue_by_name(queue, work_pool_name=pool.name)
                    client.update_work_queue(q.id, priority=priority)
                except ObjectNotFound:
                    client.create_work_queue(name=queue, work_pool_name=pool.name, priority=priority)


@dataclass
class StoppedRun:
    """A flow run that serve stops (or found left running), and its process."""

    id: str
    name: str
    pid: int | None  # its flow process on this machine (Prefect's infrastructure_pid)


def _alive(pid: int | None) -> bool:
    """A live flow process: the pid exists, is no zombie, and runs Prefect's engine (a pid an earlier serve
    recorded may belong to another program by now, which must never be signalled)."""
    if pid is None:
        return False
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return fields[0] != "Z" and (b"prefect.engine" in cmdline or b"_workspace_supervisor" in cmdline)


def _wait_ended(runs: list[StoppedRun], grace_s: float) -> None:
    """Wait up to `grace_s` for the flow processes of `runs` to end."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(r.pid) for r in runs):
        time.sleep(0.5)


def _patient(call: Callable[[], T], within_s: float = BUSY_S) -> T:
    """`call()`, asked again while the server answers 5xx or does not answer, for up to `within_s`. A Prefect server
    on SQLite under load answers 503 ("database is locked") for seconds at a time, after the client's own retries:
    a stopping serve that gave up there left its runs Running (a CI run saw it)."""
    deadline, delay = time.monotonic() + within_s, 0.5
    while True:
        try:
            return call()
        except (PrefectHTTPStatusError, httpx.TransportError) as exc:
            status = exc.response.status_code if isinstance(exc, PrefectHTTPStatusError) else 503
            if status < 500 or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 5.0)


def _runs(client: SyncPrefectClient, pools: list[str], states: list[StateType]) -> list[FlowRun]:
    """The flow runs of `pools` in one of `states`."""
    return _patient(lambda: client.read_flow_runs(
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=pools)),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=states)))))


def _pid(run: FlowRun) -> int | None:
    text = str(run.infrastructure_pid or "").rsplit(":", 1)[-1]  # a pid ("hostname:pid" in older Prefect)
    return int(text) if text.isdigit() else None


def _signal_run(run: StoppedRun, sig: signal.Signals) -> None:
    """`sig` to a live flow process's group (the process worker starts each flow in a session of its own), or to the
    process alone where it leads no group: a worker's group must never be signalled."""
    if not _alive(run.pid):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(run.pid) == run.pid:
            os.killpg(run.pid, sig)
        else:
            os.kill(run.pid, sig)


def cancel_runs(api_url: str, pools: list[str], grace_s: float = STOP_GRACE_S) -> list[StoppedRun]:
    """Cancel every flow run in progress on `pools`: marked Cancelling in Prefect (the UI shows why), and SIGTERM to
    its process group at once (the run closes its engines and keeps what it committed); then wait up to `grace_s`
    for their processes to end. Returns them, for `end_runs` once the workers are stopped.

    The SIGTERM is sent here rather than left to the worker: the worker only sees the cancel at its next poll and
    first imports the flow module for its cancellation hooks, which took over a minute on a loaded CI machine."""
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = _runs(client, pools, [StateType.RUNNING, StateType.PENDING])
        stopped = [StoppedRun(str(r.id), r.name, _pid(r)) for r in runs]
        for r in runs:
            _patient(lambda r=r: client.set_flow_run_state(r.id, Cancelling(message="rlflow serve is stopping"),
                                                           force=True))
    for r in stopped:
        _signal_run(r, signal.SIGTERM)
    _wait_ended(stopped, grace_s)
    return stopped


def end_runs(api_url: str, stopped: list[StoppedRun], why: str) -> None:
    """After the workers stopped: SIGKILL the process group of any run still alive, then mark each run CRASHED with
    `why`, a state the UI offers Retry on and the auto-resume automation reschedules (flows/auto_resume.py). A run
    that automation already rescheduled stays scheduled: it resumes when a worker serves its pool again."""
    for r in stopped:
        _signal_run(r, signal.SIGKILL)
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        for r in stopped:
            state = _patient(lambda r=r: client.read_flow_run(r.id)).state
            if state is None or state.type not in (StateType.SCHEDULED, StateType.CRASHED, StateType.COMPLETED):
                _patient(lambda r=r: client.set_flow_run_state(r.id, Crashed(message=why), force=True))


def pause_pools(api_url: str, pools: list[str], paused: bool) -> None:
    """Pause (or resume) the pools: a paused pool's workers start no run, so a run that a stopping serve cancels
    and an automation reschedules is not started again before the worker stops; `ensure_pools` resumes them."""
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        for name in pools:
            _patient(lambda name=name: client.update_work_pool(name, WorkPoolUpdate(is_paused=paused)))


def orphaned_runs(api_url: str, pools: list[str]) -> list[StoppedRun]:
    """Flow runs a previous serve left marked in progress on `pools` (it was killed, or the machine went down): no
    worker of this serve started them, so none would ever report their end, and Cancel would stay "Cancelling"."""
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = _runs(client, pools, [StateType.RUNNING, StateType.PENDING, StateType.CANCELLING])
    return [StoppedRun(str(r.id), r.name, _pid(r)) for r in runs]


def end_orphans(api_url: str, orphans: list[StoppedRun], grace_s: float = STOP_GRACE_S) -> None:
    """End what a previous serve left: SIGTERM a still-running flow process's group (its run closes its engines),
    SIGKILL it after `grace_s`, and mark every such run CRASHED, so Retry and auto-resume can take it."""
    for r in orphans:
        _signal_run(r, signal.SIGTERM)
    _wait_ended(orphans, grace_s)
    end_runs(api_url, orphans, "crashed: left in progress by an earlier rlflow serve that was stopped or killed; "
             "Retry resumes it from its last committed checkpoint")
