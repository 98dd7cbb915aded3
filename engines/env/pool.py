"""Many rollout coroutines and threads sharing the machine's sandboxes: at most `max_concurrent` calls run at once,
the others wait for a slot in arrival order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from rlflow.engines.core.config.sandbox import SandboxConfig
from rlflow.engines.env.sandbox import Sandbox, SandboxResult


class SandboxPool:
    """A Sandbox behind a pool of `config.max_concurrent` threads: `run` blocks the calling thread until its call
    is done, `arun` awaits it without blocking the event loop (a cancelled waiter's call that has not started never
    runs). A running call ends within its wall_seconds, so a slot is never held longer."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.sandbox = Sandbox(self.config)
        self._threads = ThreadPoolExecutor(self.config.max_concurrent, thread_name_prefix="sandbox")
        self._lock = threading.Lock()
        self.running = self.peak = 0  # calls running now, and the most that ever ran at once

    @property
    def isolation(self) -> str:
        return self.sandbox.isolation

    def _call(self, command: Sequence[str] | str, kwargs: dict) -> SandboxResult:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            return self.sandbox.run(command, **kwargs)
        finally:
            with self._lock:
                self.running -= 1

    def run(self, command: Sequence[str] | str, *, files: Mapping[str, bytes] | None = None, stdin: bytes = b"",
            limits: Mapping[str, float | int] | None = None) -> SandboxResult:
        """As Sandbox.run, once a slot is free."""
        return self._threads.submit(self._call, command, dict(files=files, stdin=stdin, limits=limits)).result()

    async def arun(self, command: Sequence[str] | str, *, files: Mapping[str, bytes] | None = None,
                   stdin: bytes = b"", limits: Mapping[str, float | int] | None = None) -> SandboxResult:
        """As Sandbox.run, awaiting a free slot."""
        future = self._threads.submit(self._call, command, dict(files=files, stdin=stdin, limits=limits))
        return await asyncio.wrap_future(future)

    def run_python(self, code: str, **kwargs) -> SandboxResult:
        return self.run(code, **kwargs)

    async def arun_python(self, code: str, **kwargs) -> SandboxResult:
        return await self.arun(code, **kwargs)

    def close(self) -> None:
        """Wait for the running calls; queued ones are dropped."""
        self._threads.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
