"""Committing a checkpoint that its workers write in the background (checkpoint.async_save).

The checkpoint stage returns once every worker holds its state in host memory. A `PendingCommit` thread then
watches the checkpoint's folder for every worker's `written` marker (engines/train/fsdp.py:BackgroundSave) and
commits the checkpoint as a synchronous save would be (meta.json, COMMITTED, `latest`). A worker's `failed`
marker, or the run closing first, leaves it uncommitted, so a resumed run takes the checkpoint before it. The
next checkpoint stage, and the end of a finished run, wait for it and raise what went wrong: a failed write fails
the run at its next checkpoint instead of going unnoticed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class PendingCommit:
    def __init__(self, step: int, markers: list[str], exists: Callable[[str], bool], read_error: Callable[[str], str],
                 commit: Callable[[], None], poll_s: float = 1.0):
        """`markers`: the files the workers leave when written (relative to the checkpoint folder); `exists` and
        `read_error` look in that folder; `commit` runs once all are there (in this object's thread)."""
        self.step, self.markers, self.exists, self.read_error = step, markers, exists, read_error
        self.commit, self.poll_s = commit, poll_s
        self.started = time.perf_counter()
        self.error: str | None = None
        self.seconds: float | None = None  # from the save's return to the commit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rlflow-commit-step{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if not self._written():
                return
            if self._stop.is_set():  # the run closed while the last marker arrived
                return
            self.commit()
            self.seconds = time.perf_counter() - self.started
        except Exception as exc:  # a store that failed us: raised in the run's thread by result()
            self.error = f"{type(exc).__name__}: {exc}"

    def _written(self) -> bool:
        """Wait for every marker: True once all are there; False if a worker's write failed or the run closed."""
        waiting = list(self.markers)
        while waiting:
            for marker in list(waiting):
                failed = marker.replace("written_", "failed_")
                if self.exists(failed):
                    self.error = f"{failed}: {self.read_error(failed)}"
                    return False
                if self.exists(marker):
                    waiting.remove(marker)
            if waiting and self._stop.wait(self.poll_s):
                return False  # the run closed first: left uncommitted
        return True

    def result(self, problem: Callable[[], str | None] = lambda: None, check_s: float = 5.0) -> float:
        """Wait for the commit; the seconds the write took after the stage returned. RuntimeError if the
        checkpoint was not committed: a worker's write failed, the commit itself did, or `problem` (asked every
        `check_s` while waiting: the run calls this between stages, when the workers have no other call to
        answer) names one, such as a worker that died or whose writer ended without its marker."""
        while self._thread.is_alive():
            self._thread.join(timeout=check_s)
            if self._thread.is_alive() and (reason := problem()) is not None:
                self.cancel()
                raise RuntimeError(f"checkpoint of step {self.step} was not committed: {reason}")
        if self.error is not None or self.seconds is None:
            reason = self.error or "the run closed before every worker's write was done"
            raise RuntimeError(f"checkpoint of step {self.step} was not committed: {reason}")
        return self.seconds

    def cancel(self) -> None:
        """The run ends without it: stop watching. A commit already under way finishes (it is a few small writes);
        one not yet started does not happen."""
        self._stop.set()
        self._thread.join()
