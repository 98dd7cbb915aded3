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

from rlflow.engines.cluster.process_group import start_guard
from rlflow.flows.project import require_prefect_file

REPO = Path(__file__).resolve().parent.parent  # the checkout, in an editable install (tests, bench)
WORK_POOL = "rlflow-process"  # the pool prefect.yaml's deployments use
STOP_GRACE_S = 20.0  # SIGTERM, then SIGKILL: how long a service may take to stop


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

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """One at a time, newest first: the worker while the Prefect server still answers it (signalled together,
        the worker retried the gone server until it was killed, 20 s later), then MLflow, then Prefect. (The
        guards of a killed owner signal every group at once: the worker then takes its grace time.)"""
        for proc, guard in zip(reversed(self.procs), reversed(self.guards), strict=True):
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
        self.procs.clear()
        self.guards.clear()


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
    """Create the process work pool the deployments name, if it is not there yet."""
    # prefect reads its settings when imported: this module sets their defaults first (use_prefect_server_defaults)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        template = ProcessWorker.get_default_base_job_template()
        with contextlib.suppress(ObjectAlreadyExists):
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))


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
    """A process worker on `pool`; its flow runs execute in `checkout` (RLFLOW_HOME, see prefect.yaml)."""
    env = dict(env or os.environ)
    path = os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH")]))
    env |= {"PREFECT_API_URL": api_url, "RLFLOW_HOME": str(checkout), "PYTHONPATH": path}
    return svc.start([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"], env,
                     log, cwd=checkout)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def serve(prefect_port: int = 4200, mlflow_port: int = 5000, deploy: bool = True, project: Path | None = None) -> int:
    """Start everything for the project directory `project` (default: the current one; its prefect.yaml, recipes,
    data, run store, MLflow database and logs), print where it is, and run until Ctrl-C, SIGTERM or SIGHUP, each of
    which stops every service started here (a signal handler turns SIGTERM and SIGHUP into Ctrl-C, so the
    `finally` below runs; Python's default for them would exit at once and leave the servers holding their
    ports)."""
    project = (project or Path.cwd()).resolve()
    if deploy:
        require_prefect_file(project)
    svc = Services()
    logs = project / ".rlflow-serve"
    logs.mkdir(exist_ok=True)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        mlflow, uri = launch_mlflow_server(svc, mlflow_port, f"sqlite:///{project / 'mlflow.db'}",
                                           project / "mlartifacts", log=logs / "mlflow-server.log")
        api = start_prefect_server(svc, prefect_port, log=logs / "prefect-server.log")
        print(f"Prefect UI      http://127.0.0.1:{prefect_port}   (API {api})", flush=True)
        ensure_work_pool(api)
        if deploy:
            deploy_all(api, project)
            print(f"deployments     post-train/post-train, evaluate/evaluate, pipeline/pipeline (from "
                  f"{project / 'prefect.yaml'})", flush=True)
        wait_http(f"{uri}/health", mlflow, "mlflow server")
        svc.mlflow_uri = uri
        print(f"MLflow UI       {uri}   (use it in recipes: tracking.uri={uri})", flush=True)
        start_worker(svc, api, project, log=logs / "worker.log")
        print(f"worker          pool {WORK_POOL}, runs flows in {project}; logs in {logs}", flush=True)
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
        svc.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
