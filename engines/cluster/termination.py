"""SIGTERM ends the driver within a deadline, whatever its cleanup waits for.

A SIGTERM (a scheduler's stop, `kill`, a Prefect cancellation) raises SystemExit in the main thread: Ray's
handler does, and where no Python handler is set this one does, so `finally` blocks write the run's status and
Ray, Prefect and MLflow shut down. That cleanup can wait without bound: the interpreter joins every non-daemon
thread at exit (a stage's worker thread with a user function hung in it), Ray's shutdown waits on its processes
and its C++ core worker tears down after the interpreter stops running Python. So the handler installed here
also starts a deadline process (engines/cluster/process_group.py) that SIGKILLs this one if it is still alive
`deadline_s` later; a thread in this process could not, since no Python thread runs once the interpreter is
finalizing. A kill loses nothing committed: it is no worse than SIGKILL, which a run resumes from
(tests/test_resume.py); the temporary Prefect server has its own guard (flows/temporary_server.py) and a local
Ray's processes die with their driver.

Python runs a signal handler in the main thread between bytecodes: a main thread stuck inside one long C call
(a catastrophic regex in a reward) delays the handler, and with it the deadline, until that call returns.
"""

from __future__ import annotations

import signal
import subprocess
import threading

from rlflow.engines.cluster.process_group import start_deadline

EXIT_DEADLINE_S = 10.0  # after SIGTERM; the issue asked for an end within 15 s
_deadlines: list[subprocess.Popen] = []  # held for the life of this process: their pipes' EOF tells them it ended


def bound_exit_on_sigterm(deadline_s: float = EXIT_DEADLINE_S) -> None:
    """Make SIGTERM end this process within `deadline_s`: the handler in place runs as before (SIG_DFL: a
    SystemExit, so cleanup runs), and a deadline process SIGKILLs this one if cleanup still runs at the deadline.
    Call again after something installs its own handler (ray.init does); idempotent; a no-op outside the
    main thread (where Python refuses to set handlers) or when SIGTERM is ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN or getattr(previous, "rlflow_deadline", False):
        return

    def on_sigterm(signum: int, frame) -> None:
        if not _deadlines:
            _deadlines.append(start_deadline(deadline_s))
        if callable(previous):
            previous(signum, frame)
        raise SystemExit(128 + signum)

    on_sigterm.rlflow_deadline = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, on_sigterm)
