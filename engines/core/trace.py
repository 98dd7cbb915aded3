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
        self._threads: dict[int | str, str] = {}  # tid -> lane name, sent with every drain
        self._lock = threading.Lock()

    def name_thread(self, tid: int | str, name: str) -> None:
        """Give a lane (tid) a name in Perfetto; lanes sort in the order they were named."""
        with self._lock:
            self._threads.setdefault(tid, name)

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
            threads = list(self._threads.items())
        if not events:
            return []
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": self.process}}]
        for i, (tid, name) in enumerate(threads):
            meta += [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": name}},
                     {"name": "thread_sort_index", "ph": "M", "pid": self.pid, "tid": tid, "args": {"sort_index": i}}]
        return [*meta, *events]


def merge(drained: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Events drained from several recorders, each recorder one process in the timeline (pid 1, 2, ...).

    Recorders can share an OS pid (the bare loop keeps its workers in the driver's process), so each
    gets its own pid here; the real one stays in the process name."""
    out: list[dict[str, Any]] = []
    for pid, events in enumerate((e for e in drained if e), start=1):
        for e in events:
            if e["name"] == "process_name":
                e = {**e, "args": {"name": f"{e['args']['name']} (pid {e['pid']})"}}
            out.append({**e, "pid": pid})
    return out


def within(events: list[dict[str, Any]], start_us: float, end_us: float) -> list[dict[str, Any]]:
    """The events that happened (or, for spans, overlap) [start_us, end_us]; lane names are kept."""
    def inside(e: dict[str, Any]) -> bool:
        if e["ph"] == "M":
            return True
        return e["ts"] <= end_us and e["ts"] + e.get("dur", 0.0) >= start_us

    return [e for e in events if inside(e)]


def chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON object Perfetto and chrome://tracing open."""
    return {"traceEvents": sorted(events, key=lambda e: e.get("ts", 0.0)), "displayTimeUnit": "ms"}
