"""When each step's rollout runs, under `rollout.max_staleness` k (asynchronous training, docs/rollout.md).

The weights on the rollout workers have version v = the syncs so far: step t trains with version t and its sync
makes version t + 1. A rollout for step t may start once version t - k is on the workers, so while step s trains
(version s there) the rollouts of steps s + 1 .. s + k may run. The loop (the Prefect flow, or
bench/e2e/bare_loop.py) asks `take(step)` for the step's rollout metrics at the start of the step, and calls
`before_sync(step)` before the step's sync:

- k = 0: every rollout runs in the loop's own thread, nothing runs ahead (synchronous);
- k = 1: step s + 1's rollout runs while step s trains and the sync waits for it, so each step's samples come
  from one weight version (one-step-off, as rlflow always ran it: same samples under the same seed);
- k >= 2: the rollouts of steps s + 1 .. s + k run while step s trains and the sync does not wait: the weights
  change under generations in flight, which continue with the new ones (partial rollouts). A sample records the
  first and the last version that generated it; its first is >= t - k, so it is at most k updates stale.

Rollouts ahead run in the loop's executor (Prefect's task runner in the flow). With dynamic sampling each
rollout carries prompts into the next, so each one waits for the one before it (`chain`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class FutureLike(Protocol):
    def result(self) -> dict[str, float]: ...


# (step, the rollout it must wait for, or None) -> a future of the step's rollout metrics
Submit = Callable[[int, FutureLike | None], FutureLike]


class RolloutSchedule:
    def __init__(
        self,
        max_staleness: int,
        last: int,
        run: Callable[[int], dict[str, float]],
        submit: Submit,
        version: Callable[[], int],
        chain: bool = False,
    ):
        """`run(step)` runs a rollout in the caller's thread; `submit` starts one in the executor; `version()` is
        the weight version on the rollout workers now; `last` the run's last step."""
        self.k, self.last, self.chain = max_staleness, last, chain
        self.run, self.submit, self.version = run, submit, version
        self.pending: dict[int, FutureLike] = {}  # rollouts started ahead, by step
        self.done: dict[int, dict[str, float]] = {}  # ... and those already waited for (k = 1's sync waits)

    def take(self, step: int) -> dict[str, float]:
        """The step's rollout metrics (waiting for the rollout started ahead, or running it now), then start the
        rollouts of the later steps that the bound allows."""
        if step in self.done:
            metrics = self.done.pop(step)
        elif step in self.pending:
            t0 = time.perf_counter()
            metrics = self.pending.pop(step).result()
            metrics["time/rollout_wait"] = time.perf_counter() - t0
        else:
            metrics = self.run(step)
        for later in range(step + 1, min(step + self.k, self.last) + 1):
            if later not in self.pending and later not in self.done:
                self._start(later)
        return metrics

    def before_sync(self, step: int) -> dict[str, float]:
        """k = 1: wait for the rollout in flight, so that the sync never changes weights under it; k >= 2: the
        sync goes ahead under the rollouts in flight. Returns the wait (time/rollout_wait) when there was one."""
        if self.k != 1 or step + 1 not in self.pending:
            return {}
        t0 = time.perf_counter()
        self.done[step + 1] = self.pending.pop(step + 1).result()
        return {"time/rollout_wait": time.perf_counter() - t0}

    def in_flight(self) -> list[int]:
        return sorted(self.pending)

    def _start(self, step: int) -> None:
        version = self.version()
        if version < step - self.k:  # the loop's order guarantees it; a reordered loop must not break the bound
            raise RuntimeError(
                f"step {step}: its rollout would start with weight version {version} on the rollout "
                f"workers; rollout.max_staleness ({self.k}) needs version {step - self.k} or newer"
            )
        after = self.pending.get(step - 1) if self.chain else None
        self.pending[step] = self.submit(step, after)
