"""Prefect's temporary API server, tied to the flow process that starts it.

Without PREFECT_API_URL, Prefect runs a flow against a temporary server: a uvicorn child process
(prefect.server.api.server.SubprocessASGIServer) that it stops from an atexit handler. A flow process killed
with SIGKILL (the OOM killer, a scheduler, `kill -9`) runs no atexit handler, so the server lived on with its
port open. Here the server Prefect starts gets a guard (engines/cluster/process_group.py): a small process
that reads a pipe only this process holds and stops the server when the pipe closes, which the kernel does
however this process ends.
"""

from __future__ import annotations

import functools
import subprocess
import threading
from collections.abc import Callable

from rlflow.engines.cluster.process_group import start_guard
from rlflow.engines.core.retry import ServiceError

STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL: Prefect's own stop() waits as long


def guard_temporary_server() -> None:
    """Make the temporary server Prefect starts for this process (if it starts one: PREFECT_API_URL unset) one
    that dies with it. Call before the first flow runs; a no-op with an API URL or when already done."""
    # Prefect's server module takes seconds to import: only a run that may start a temporary server pays it
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    guarded = _guarded_class()
    if PREFECT_API_URL.value() or isinstance(SubprocessASGIServer._instances.get(None), guarded):
        return
    # Prefect looks its server up as SubprocessASGIServer() (port None): the instance under that key is the one
    SubprocessASGIServer._instances[None] = guarded()


def start_temporary_server_early() -> Callable[[], None]:
    """Start the (guarded) temporary server now, in a thread, when this process will need one (PREFECT_API_URL
    unset), so its few seconds of start-up pass while the caller imports torch and the engines; returns the wait
    for it, to call before the first flow runs (Prefect takes a started server as up, healthy or not). Call after
    guard_temporary_server; a no-op wait otherwise."""
    from prefect.server.api.server import SubprocessASGIServer  # slow to import: see above
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    server = SubprocessASGIServer._instances.get(None)
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value() or server is None or server.running:
        return lambda: None
    failed: list[BaseException] = []

    def start() -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by the wait
            failed.append(exc)

    thread = threading.Thread(target=start, name="prefect-temporary-server", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failed:
            raise failed[0]

    return wait


def require_prefect_api() -> None:
    """With an API URL (PREFECT_API_URL, or the Prefect profile's), its server must answer before a flow starts:
    a ServiceError naming the URL if not (the flow call would fail later, with Prefect's traceback)."""
    from prefect.client.orchestration import get_client  # slow to import: see above
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return
    with get_client(sync_client=True) as client:
        problem = client.api_healthcheck()
    if problem is not None:
        raise ServiceError(f"the Prefect API at {url} (PREFECT_API_URL) does not answer: {type(problem).__name__}: "
                           f"{problem}. Start its server (`rlflow serve`), or unset PREFECT_API_URL for a temporary "
                           "server of the run's own.")


@functools.cache
def _guarded_class() -> type:
    """Defined on first use: Prefect's server module is slow to import."""
    from prefect.server.api.server import SubprocessASGIServer  # slow to import: see above

    class GuardedServer(SubprocessASGIServer):
        """SubprocessASGIServer whose uvicorn process has a guard that stops it when this process ends."""

        _instances: dict = {}  # its own registry: constructing one must not return Prefect's default instance
        _guard: subprocess.Popen | None = None

        def _run_uvicorn_command(self) -> subprocess.Popen:
            self._drop_guard()  # a restart (Prefect's port was taken): that process is gone
            proc = super()._run_uvicorn_command()
            self._guard = start_guard(proc.pid, STOP_GRACE_S, group=False)
            return proc

        def stop(self) -> None:
            self._drop_guard()  # first: no guard may signal the pid once the server is gone (pids are reused)
            super().stop()

        def _drop_guard(self) -> None:
            guard, self._guard = self._guard, None
            if guard is not None:
                guard.kill()
                guard.wait()
                guard.stdin.close()

    return GuardedServer
