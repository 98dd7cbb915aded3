"""The driver's side of a step's trace timeline: a span per stage on a lane per stage, merged with the rollout
workers' per-request events into one Chrome trace per traced step (docs/debugging.md)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rlflow.engines.core.trace import TraceRecorder, chrome_trace, merge, now_us, within

STAGE_LANES = ("rollout", "reward", "teacher", "advantages", "train", "sync-weights", "evaluate", "checkpoint")


class StageTimeline:
    def __init__(self, enabled: bool):
        self.recorder = TraceRecorder("driver", enabled=enabled)
        for lane, stage in enumerate(STAGE_LANES, start=1):
            self.recorder.name_thread(lane, stage)
        self._step_start_us: dict[int, float] = {}  # when each step's first stage began
        self._carry: list[list[dict]] = []  # events of the next step that a trace drained early

    @property
    def enabled(self) -> bool:
        return self.recorder.enabled

    @contextmanager
    def span(self, stage: str, step: int) -> Iterator[None]:
        """Record the stage as a span on its lane (free when tracing is off)."""
        if not self.recorder.enabled:
            yield
            return
        self._step_start_us.setdefault(step, now_us())
        lane = STAGE_LANES.index(stage) + 1 if stage in STAGE_LANES else len(STAGE_LANES) + 1
        with self.recorder.span(stage, tid=lane, args={"step": step}):
            yield

    def trace(self, step: int, worker_events: list[list[dict]]) -> dict:
        """The Chrome trace of `step`, from its first stage until now: the driver's stage spans and what one
        drain of each rollout worker returned (per-request events, weight updates)."""
        end = now_us()
        start = self._step_start_us.get(step, end)
        sources = [self.recorder.drain(), *worker_events]
        carry = self._carry + [[]] * (len(sources) - len(self._carry))
        sources = [_dedup_meta(c + s) for c, s in zip(carry, sources, strict=True)]
        # asynchronous training: later steps' rollouts already ran; their events also go to the next trace (with
        # max_staleness >= 2 a trace may so hold some of the steps after it too)
        upcoming = self._step_start_us.get(step + 1)
        self._carry = [within(s, upcoming, end) if upcoming else [] for s in sources]
        for old in [k for k in self._step_start_us if k <= step]:
            del self._step_start_us[old]
        return chrome_trace(within(merge(sources), start, end))


def _dedup_meta(events: list[dict]) -> list[dict]:
    """Lane and process names once each (a carried-over batch of events brings its own)."""
    seen, out = set(), []
    for e in events:
        key = (e["name"], e["tid"]) if e["ph"] == "M" else None
        if key is None or key not in seen:
            out.append(e)
            seen.add(key)
    return out
