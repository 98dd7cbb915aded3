"""Timeline events in Chrome trace format (open the JSON in Perfetto or chrome://tracing).

Rollout workers record per-request events (queued, start, first token, finish, abort, weight update),
the flow records one span per stage; every process records into its own `TraceRecorder` and the
driver merges what they drain into one file per step. Timestamps are wall-clock microseconds, so
events from different processes line up on one axis.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def now_us() -> float:
    return time.time_ns() / 1000.0


class TraceRecorder:
    """Collects events in memory until `drain()`; thread-safe, and free when disabled."""

    def __init__(self, process: str, enabled: bool = True):
        self.process, self.enabled = process, enabled
        self.pid = os.getpid()
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)

    def instant(self, name: str, *, tid: int | str = 0, args: dict | None = None, ts_us: float | None = None) -> None:
        """A point in time: a request queued, its first token, a weight update."""
        if self.enabled:
            self._add({"name": name, "ph": "i", "s": "t", "ts": now_us() if ts_us is None else ts_us,
                       "pid": self.pid, "tid": tid, "args": args or {}})

    def complete(self, name: str, start_us: float, end_us: float, *, tid: int | str = 0,
                 args: dict | None = None) -> None:
        """A span that already ended: a request from start to finish, a stage."""
        if self.enabled:
            self._add({"name": name, "ph": "X", "ts": start_us, "dur": max(end_us - start_us, 0.0),
                       "pid": self.pid, "tid": tid, "args": args or {}})

    @contextmanager
    def span(self, name: str, *, tid: int | str = 0, args: dict | None = None) -> Iterator[None]:
        start = now_us()
        try:
            yield
        finally:
            self.complete(name, start, now_us(), tid=tid, args=args)

    def drain(self) -> list[dict[str, Any]]:
        """The events recorded since the last drain (plain JSON values), with this process's name."""
        with self._lock:
            events, self._events = self._events, []
        if not events:
            return []
        meta = {"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": self.process}}
        return [meta, *events]


def chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON object Perfetto and chrome://tracing open."""
    return {"traceEvents": sorted(events, key=lambda e: e.get("ts", 0.0)), "displayTimeUnit": "ms"}
