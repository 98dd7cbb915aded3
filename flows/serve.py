"""Local services for a laptop: a Prefect server, an MLflow server and a process worker (`rlflow serve`), for the
project directory it starts in (prefect.yaml and recipes: `rlflow init`).

The tests start the same services with the same functions. Each service is a child process in its own
process group, stopped by signalling that group (never by name). Each also has a guard process
(engines/cluster/process_group.py) that stops its group when this process ends without stopping it, SIGKILL
included: a killed `rlflow serve` leaves no service holding its port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from rlflow.engines.cluster.process_group import start_guard
from rlflow.engines.core.config.tracking import TRACKING_URI_ENV
from rlflow.flows.project import PREFECT_FILE, require_prefect_file

REPO = Path(__file__).resolve().parent.parent  # the checkout, in an editable install (tests, bench)
WORK_POOL = "rlflow-process"  # the training pool of the shipped prefect.yaml; serve's only pool without one
STOP_GRACE_S = 20.0  # SIGTERM, then SIGKILL: how long a service may take to stop
AUTOMATION_S = 5.0  # how long a stopping serve keeps Prefect up for the automations to reschedule its stopped runs


@dataclass
class Services:
    """Started service processes and their guards; `stop()` ends them (newest first)."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    guards: list[subprocess.Popen] = field(default_factory=list)  # one per service, in the same order
    prefect_api: str | None = None
    mlflow_uri: str | None = None

    def start(self, cmd: list[str], env: dict[str, str], log: Path | None = None, cwd: Path | None = None
              ) -> subprocess.Popen:
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child process owns it
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        self.guards.append(start_guard(proc.pid, STOP_GRACE_S))
        return proc

    def stop(self, timeout: float = STOP_GRACE_S, newest: int | None = None) -> None:
        """One at a time, newest first (`newest`: only that many): the workers while the Prefect server still
        answers them (signalled together, a worker retried the gone server until it was killed, 20 s later), then
        MLflow, then Prefect. (The guards of a killed owner signal every group at once: a worker then takes its
        grace time.)"""
        count = len(self.procs) if newest is None else min(newest, len(self.procs))
        ending = list(zip(reversed(self.procs), reversed(self.guards), strict=True))[:count]
        for proc, guard in ending:
            guard.kill()  # first: no guard may signal the group once it is gone (its id may be reused)
            guard.wait()
            guard.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            with contextlib.suppress(ProcessLookupError):  # a child left in the group (mlflow's job runner)
                os.killpg(proc.pid, signal.SIGKILL)
        del self.procs[len(self.procs) - count:]
        del self.guards[len(self.guards) - count:]


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before answering {url}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")


# Settings of the Prefect servers rlflow starts, its own (`rlflow serve`) and the temporary one a flow run starts
# when PREFECT_API_URL is unset; what the user's environment sets wins. The task-run recorder writes each task
# run's state events as they come, one database transaction each (batch size 1); batched, the server spends half
# the CPU per RL step (docs/benchmarks.md), and a task's state reaches the UI within the flush interval (5 s).
# Analytics off: its heartbeat writes to a fresh SQLite database while the server migrates it and prints a
# "database is locked" traceback at the start of the first run (and it has no network to reach on a cluster).
# The temporary server may take 180 s to answer, not Prefect's 20: on a loaded machine (2 busy cores) 2 of 6
# `rlflow run` starts timed out at 20 s, while migrating its fresh database.
PREFECT_SERVER_DEFAULTS = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
}


def use_prefect_server_defaults(env: dict[str, str] | os._Environ = os.environ) -> None:
    """Set PREFECT_SERVER_DEFAULTS where `env` leaves them unset. Prefect reads its settings once, when first
    imported: call this before that, as the CLI does."""
    for key, value in PREFECT_SERVER_DEFAULTS.items():
        env.setdefault(key, value)


def prefect_env(api_url: str, home: Path | None = None) -> dict[str, str]:
    env = os.environ | {"PREFECT_API_URL": api_url}
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    return env


def start_prefect_server(svc: Services, port: int, home: Path | None = None, log: Path | None = None) -> str:
    """`prefect server start` (SQLite in PREFECT_HOME); returns the API URL once it answers."""
    env = os.environ | {"PREFECT_UI_ENABLED": "true"}
    use_prefect_server_defaults(env)
    if home is not None:
        env |= {"PREFECT_HOME": str(home),
                "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db"}
    env.pop("PREFECT_API_URL", None)
    env["PREFECT_UI_API_URL"] = f"http://127.0.0.1:{port}/api"  # what the UI in the browser calls (default: :4200)
    proc = svc.start([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                     env, log)
    api = f"http://127.0.0.1:{port}/api"
    wait_http(f"{api}/health", proc, "prefect server")
    svc.prefect_api = api
    return api


def launch_mlflow_server(svc: Services, port: int, backend_uri: str, artifacts: Path, log: Path | None = None
                         ) -> tuple[subprocess.Popen, str]:
    """`mlflow server` with a model registry (SQL backend) and artifacts served over HTTP, not yet answering (it
    takes 10-20 s: `rlflow serve` starts Prefect and deploys meanwhile); returns the process and its URI."""
    proc = svc.start([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                      "--backend-store-uri", backend_uri, "--artifacts-destination", str(artifacts),
                      "--workers", "1"], dict(os.environ), log)
    return proc, f"http://127.0.0.1:{port}"


def start_mlflow_server(svc: Services, port: int, backend_uri: str, artifacts: Path, log: Path | None = None) -> str:
    """launch_mlflow_server, then wait until it answers; returns its URI."""
    proc, uri = launch_mlflow_server(svc, port, backend_uri, artifacts, log)
    wait_http(f"{uri}/health", proc, "mlflow server")
    svc.mlflow_uri = uri
    return uri


def ensure_work_pool(api_url: str, name: str = WORK_POOL) -> None:
    """Create the process work pool the deployments name, if it is not there yet (no concurrency limit)."""
    # deferred, as every Prefect import here: the CLI imports this module to set Prefect's defaults before Prefect
    from rlflow.flows.pools import PoolSpec, ensure_pools

    ensure_pools(api_url, [PoolSpec(name)])


def deploy_all(api_url: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> str:
    """`prefect deploy --all` with prefect.yaml in `cwd`; returns its output."""
    env = (env or os.environ) | {"PREFECT_API_URL": api_url, "PYTHONPATH": str(cwd)}
    done = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"], cwd=cwd, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"prefect deploy --all failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def start_worker(svc: Services, api_url: str, checkout: Path = REPO, pool: str = WORK_POOL,
                 env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """A process worker on `pool`; its flow runs execute in `checkout` (RLFLOW_HOME, see prefect.yaml) and send
    heartbeats, which the auto-resume automation watches (flows/auto_resume.py)."""
    env = dict(env or os.environ)
    path = os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH")]))
    env |= {"PREFECT_API_URL": api_url, "RLFLOW_HOME": str(checkout), "PYTHONPATH": path}
    from rlflow.flows.auto_resume import heartbeat_s  # deferred: Prefect (see ensure_work_pool)

    env.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(heartbeat_s()))  # what the heartbeat automation watches
    return svc.start([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"], env,
                     log, cwd=checkout)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def post_train_deployments(prefect_file: Path) -> list[str]:
    """The "flow/deployment" names of prefect.yaml's post-train deployments: those auto-resume watches."""
    raw = yaml.safe_load(prefect_file.read_text()) or {}
    return [f"post-train/{d['name']}" for d in raw.get("deployments") or []
            if str(d.get("entrypoint", "")).endswith(":post_train")]


def serve(prefect_port: int = 4200, mlflow_port: int = 5000, deploy: bool = True, project: Path | None = None,
          pool_limits: dict[str, int] | None = None) -> int:
    """Start everything for the project directory `project` (default: the current one; its prefect.yaml, recipes,
    data, run store, MLflow database and logs), print where it is, and run until Ctrl-C, SIGTERM or SIGHUP, each of
    which stops every service started here (a signal handler turns SIGTERM and SIGHUP into Ctrl-C, so the
    `finally` below runs; Python's default for them would exit at once and leave the servers holding their
    ports).

    Its pools (flows/pools.py): one process worker each, with the concurrency limits of prefect.yaml or
    `pool_limits`. Stopping serve stops the flow runs in progress on them: cancelled through Prefect (each closes its
    engines and keeps what it committed), their process groups ended after a bounded wait, and each left Crashed,
    which Retry and auto-resume take up. Runs an earlier, killed serve left "Running" are ended the same way at
    start."""
    # deferred: Prefect (see ensure_work_pool)
    from rlflow.flows.auto_resume import ensure_auto_resume
    from rlflow.flows.pools import end_orphans, ensure_pools, orphaned_runs, project_pools

    project = (project or Path.cwd()).resolve()
    prefect_file = project / PREFECT_FILE
    if deploy:
        require_prefect_file(project)
    pools = project_pools(prefect_file, pool_limits, default=WORK_POOL)
    names = [p.name for p in pools]
    svc = Services()
    logs = project / ".rlflow-serve"
    logs.mkdir(exist_ok=True)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    api = None
    try:
        mlflow, uri = launch_mlflow_server(svc, mlflow_port, f"sqlite:///{project / 'mlflow.db'}",
                                           project / "mlartifacts", log=logs / "mlflow-server.log")
        api = start_prefect_server(svc, prefect_port, log=logs / "prefect-server.log")
        print(f"Prefect UI      http://127.0.0.1:{prefect_port}   (API {api})", flush=True)
        orphans = orphaned_runs(api, names)
        if orphans:
            print(f"ending {len(orphans)} run(s) an earlier serve left in progress: "
                  + ", ".join(r.name for r in orphans), flush=True)
            end_orphans(api, orphans)
        ensure_pools(api, pools)
        # the deployments' run forms and the worker's flow runs log to this MLflow server (artifacts served over
        # HTTP, so a registered model loads from another machine): a recipe without tracking.uri takes it from here
        tracked = os.environ | {TRACKING_URI_ENV: uri}
        if deploy:
            deploy_all(api, project, env=tracked)
            resumed = post_train_deployments(prefect_file)
            ensure_auto_resume(api, resumed)
            print(f"deployments     post-train/post-train, evaluate/evaluate, pipeline/pipeline (from "
                  f"{prefect_file}); auto-resume after a crash: {', '.join(resumed) or 'none'}", flush=True)
        wait_http(f"{uri}/health", mlflow, "mlflow server")
        svc.mlflow_uri = uri
        print(f"MLflow UI       {uri}   (the deployments' runs log here; from a shell: "
              f"export {TRACKING_URI_ENV}={uri})", flush=True)
        for pool in pools:
            start_worker(svc, api, project, pool.name, env=tracked, log=logs / f"worker-{pool.name}.log")
            limit = "no limit" if pool.concurrency_limit is None else f"at most {pool.concurrency_limit} run(s) at once"
            queues = ", ".join(f"{q} (priority {p})" for q, p in sorted(pool.queues.items(), key=lambda x: x[1]))
            print(f"worker          pool {pool.name}: {limit}{'; queues ' + queues if queues else ''}", flush=True)
        print(f"                flows run in {project}; logs in {logs}", flush=True)
        print(f"Ctrl-C stops all. In another shell: export PREFECT_API_URL={api}", flush=True)
        while all(p.poll() is None for p in svc.procs):
            time.sleep(1)
        print("a service exited; see the logs in", logs, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for sig in handlers:  # a second Ctrl-C must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        stop_runs_then_services(svc, api, names)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def stop_runs_then_services(svc: Services, api: str | None, pools: list[str]) -> None:
    """The runs first (paused pools, cancelled runs, bounded wait), then the workers, then what is left of the runs
    (killed, marked Crashed), then MLflow and Prefect. A Prefect server that does not answer skips to the end."""
    from rlflow.flows.pools import cancel_runs, end_runs, pause_pools  # deferred: Prefect (see ensure_work_pool)

    stopped, t0 = [], time.monotonic()
    workers = sum(1 for p in svc.procs if "worker" in p.args)
    if api is not None and workers:
        print("stopping: pausing the pools, cancelling the runs in progress", flush=True)
        try:  # no run starts now; a pool left running only risks a start that the workers' stop then ends
            pause_pools(api, pools, paused=True)
        except Exception as exc:  # noqa: BLE001 - the runs must still be stopped
            print(f"could not pause the pools: {type(exc).__name__}: {exc}", file=sys.stderr)
        try:
            stopped = cancel_runs(api, pools)
            if stopped:
                print(f"stopped {len(stopped)} run(s) in {time.monotonic() - t0:.1f} s: "
                      + ", ".join(r.name for r in stopped), flush=True)
        except Exception as exc:  # noqa: BLE001 - the services must stop whatever happened to the API
            print(f"could not cancel the runs in progress: {type(exc).__name__}: {exc}", file=sys.stderr)
    svc.stop(newest=workers)
    if stopped:
        try:
            end_runs(api, stopped, "crashed: rlflow serve was stopped while it ran; Retry (or auto-resume, once serve "
                     "runs again) resumes it from its last committed checkpoint")
            time.sleep(AUTOMATION_S)  # the auto-resume automation's reschedule, before the server goes
        except Exception as exc:  # noqa: BLE001
            print(f"could not mark the stopped runs crashed: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"workers stopped, runs ended after {time.monotonic() - t0:.1f} s; stopping MLflow and Prefect", flush=True)
    svc.stop()
    print(f"all services stopped after {time.monotonic() - t0:.1f} s", flush=True)
