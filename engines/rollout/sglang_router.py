"""sglang-router (SGLang's Rust router, `pip install 'rlflow[router]'`, checked with 0.3.2) in front of the rollout
workers' servers, as a child process of the driver.

It is started with no workers and each server is registered through its worker API (`POST /workers {url,
api_key}`, answered 202 and registered in the background; `GET /workers` shows `is_healthy`; `DELETE
/workers/{id}`), which its control-plane key guards: the run's control token. Registering probes the server
(`/health`, `/server_info`, `/model_info`): the embedded server answers those as SGLang does.

It forwards generation (`/generate`, `/v1/completions`, `/v1/chat/completions`, `/health_generate`) and
`/flush_cache`. Routes it does not forward (404: `/abort_request`, the weight, memory and pause routes) go to
each worker directly, as slime does: `functions.abort_tagged` posts to every worker, and the weight transports
call each worker's backend. It takes one request per item: a batched `/generate` (a list of sampling_params) is
refused (422), so the rollout functions' batcher sends items one by one to it (functions.RolloutRunner).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.cluster.process_group import start_guard, stop_group
from rlflow.engines.rollout.http_api import auth_headers

ROUTER_MODULE = "sglang_router.launch_router"
STOP_GRACE_S = 10.0
LOG_TAIL_CHARS = 3000


def sglang_router_installed() -> bool:
    """Whether sglang-router is importable here (the router runs with this interpreter)."""
    return importlib.util.find_spec("sglang_router") is not None


@dataclass
class RouterWorker:
    """One server behind the router, as the session sees it (url, and whether the router finds it healthy)."""

    url: str
    healthy: bool = True


class SGLangRouter:
    """sglang-router serving on `host:port` (0: a free port) in front of `worker_urls`; `url` once they are all
    registered and healthy. `token`: the run's control token, for the router's worker API (its control-plane key)
    and for every worker (their --api-key), which the router then sends them."""

    kind = "sglang-router"

    def __init__(
        self,
        worker_urls: list[str],
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        policy: str = "round_robin",
        timeout_s: float = 60,
        log_dir: str | None = None,
    ):
        if not worker_urls:
            raise ValueError("SGLangRouter: worker_urls is empty")
        if not sglang_router_installed():
            raise RuntimeError("rollout.router: sglang-router is not installed here (pip install 'rlflow[router]')")
        self.token, self.timeout_s = token, timeout_s
        port = port or free_port()
        self.url = f"http://{host}:{port}"
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="rlflow-sglang-router-")) / "router.log"
        command = [
            sys.executable,
            "-m",
            ROUTER_MODULE,
            "--host",
            host,
            "--port",
            str(port),
            "--policy",
            policy,
            "--log-level",
            "warn",
            "--health-check-interval-secs",
            "5",
        ]
        if token:  # its worker API then needs the token; generation stays open, as the workers' is
            command += ["--control-plane-api-keys", f"rlflow:rlflow-run:admin:{token}"]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the router writes it until stop()
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        self._guard = start_guard(self.proc.pid, STOP_GRACE_S)
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(30, connect=5), headers=auth_headers(token))
        self.urls: list[str] = []
        try:
            self._wait(lambda: self._http.get("/health").status_code == 200, "answer /health")
            for url in worker_urls:
                self._add(url)
            self._wait_registered()
        except BaseException:
            self.stop()
            raise

    # ---- workers -----------------------------------------------------------------------------------------
    def _add(self, url: str) -> None:
        r = self._http.post(
            "/workers", json={"url": url.rstrip("/"), **({"api_key": self.token} if self.token else {})}
        )
        if r.status_code not in (200, 201, 202):
            raise RuntimeError(f"sglang-router: POST /workers {url} answered {r.status_code}: {r.text[:300]}")
        self.urls.append(url.rstrip("/"))

    def registered(self) -> dict[str, dict]:
        """The router's workers by URL (GET /workers: id, is_healthy, load, ...)."""
        r = self._http.get("/workers")
        r.raise_for_status()
        return {w["url"].rstrip("/"): w for w in r.json()["workers"]}

    def _wait_registered(self) -> None:
        def ready() -> bool:
            known = self.registered()
            return all(u in known and known[u].get("is_healthy") for u in self.urls)

        self._wait(ready, f"register {self.urls} as healthy")

    @property
    def workers(self) -> list[RouterWorker]:
        """The servers in the session's worker order, healthy as the router sees them (its health checks)."""
        try:
            known = self.registered()
        except httpx.HTTPError:
            return [RouterWorker(u, False) for u in self.urls]
        return [RouterWorker(u, bool(known.get(u, {}).get("is_healthy"))) for u in self.urls]

    def replace(self, index: int, url: str) -> None:
        """A restarted worker's server takes worker `index`'s place: the old one is removed, the new one registered."""
        old = self.urls[index]
        known = self.registered().get(old)
        if known is not None:
            self._http.delete(f"/workers/{known['id']}")
        self.urls.pop(index)
        self._add(url)
        self.urls.insert(index, self.urls.pop())
        self._wait_registered()

    # ---- process -------------------------------------------------------------------------------------------
    def _wait(self, check, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"sglang-router exited with code {self.proc.returncode} before it could {what}; "
                    f"the end of its log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if check():
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sglang-router did not {what} within {self.timeout_s:g} s; the end of its log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_bytes()[-LOG_TAIL_CHARS:].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """Stop the router's process group (SIGTERM, SIGKILL after STOP_GRACE_S) and its guard (once)."""
        guard, self._guard = self._guard, None
        if guard is None:
            return
        stop_group(self.proc.pid, STOP_GRACE_S, leader=self.proc)
        if guard is not None:
            guard.stdin.close()
            try:
                guard.wait(timeout=STOP_GRACE_S + 5)
            except subprocess.TimeoutExpired:
                guard.kill()
                guard.wait()
        self._http.close()
        self._log.close()
