"""Stage time limits (orchestration.stage_timeout_s) that hold in whatever thread a stage runs.

Prefect's task timeout interrupts only the main thread, with SIGALRM; in a worker thread (a rollout running ahead,
submitted to the flow's task runner) it can act only once the stage's blocking call returns, and Prefect warns so at
every such task run. rlflow therefore passes Prefect no timeout and enforces the limit here:
- in the main thread, SIGALRM (Prefect's own `timeout` scope) interrupts the stage where it blocks;
- in any other thread, the stage runs in a helper thread that the task's thread waits for, at most the limit; past
  it the task fails and the stage's work is left to the helper, which ends when its blocking call returns (a
  failed run closes its session, and closing the rollout runner ends a rollout still waiting on it).
"""

from __future__ import annotations

import contextvars
import signal
import threading
from collections.abc import Callable
from typing import TypeVar

from prefect.utilities.timeout import timeout

T = TypeVar("T")


class _Expired(TimeoutError):
    """Prefect's alarm scope ran out (turned into the caller's error)."""


def run_within(seconds: float, work: Callable[[], T], expired: Callable[[], BaseException], name: str) -> T:
    """`work()`, or `expired()` raised once it has run `seconds` (0: no limit). `name` names the helper thread."""
    if not seconds:
        return work()
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:
        try:
            with timeout(seconds, timeout_exc_type=_Expired):
                return work()
        except _Expired as exc:
            raise expired() from exc
    return _in_helper_thread(seconds, work, expired, name)


def _in_helper_thread(seconds: float, work: Callable[[], T], expired: Callable[[], BaseException], name: str) -> T:
    """Run `work` in a daemon thread (with this thread's context: Prefect's run context, the run's logger) and wait
    for it at most `seconds`."""
    done = threading.Event()
    outcome: list[tuple[bool, object]] = []
    context = contextvars.copy_context()

    def target() -> None:
        try:
            outcome.append((True, context.run(work)))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which raises it
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=target, name=name, daemon=True).start()
    if not done.wait(seconds):
        raise expired()
    ok, value = outcome[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]
