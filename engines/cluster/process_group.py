"""Stopping a child server's whole process group, and the guard that does it when its owner dies.

An SGLang server is a process tree (the HTTP server, its scheduler and detokenizer). The worker starts it as
the leader of a new process group, so one signal reaches the tree. A Ray actor that is SIGKILLed runs no
exit handlers, so each worker also starts a guard:

    python -m rlflow.engines.cluster.process_group <pgid> <grace_s>        (start_guard(pgid, grace_s))
    python -m rlflow.engines.cluster.process_group --pid <pid> <grace_s>  (start_guard(pid, grace_s, group=False))
    python -m rlflow.engines.cluster.process_group --deadline <pid> <s>   (start_deadline(s): SIGKILL at a deadline)

The guard reads its stdin until EOF. Only the worker holds the pipe's other end, and the kernel closes it
however the worker ends; the guard then stops the group, as `stop_group` does (with --pid: the one process, as
`stop_process` does; Prefect's temporary API server is one process in its owner's group, flows/temporary_server.py).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is still there."""
    return _signal_reaches(-pgid)


def stop_group(pgid: int, grace_s: float, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM the group, wait up to `grace_s` for every member to exit, then SIGKILL what is left.

    `leader` is the group leader when this process is its parent: it is reaped here, since an unreaped
    zombie would keep the group alive for the whole grace period."""
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    if leader is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            leader.wait(timeout=grace_s)
    while group_alive(pgid) and time.monotonic() < deadline:  # the leader's own children (SGLang's scheduler)
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if leader is not None:
        leader.wait()


def process_alive(pid: int) -> bool:
    """Whether process `pid` is still there (a zombie counts until its parent reaps it)."""
    return _signal_reaches(pid)


def _signal_reaches(target: int) -> bool:
    """Whether signal 0 reaches `target` (os.kill's convention: negative is a process group), i.e. it exists."""
    try:
        os.kill(target, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True


def stop_process(pid: int, grace_s: float) -> None:
    """SIGTERM one process, wait up to `grace_s` for it to exit (its new parent reaps it), then SIGKILL it."""
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def start_guard(target: int, grace_s: float, group: bool = True) -> subprocess.Popen:
    """The guard of process group `target` (group=False: of process `target`). Keep the returned Popen (its
    stdin is the pipe): closing its stdin, or this process ending in any way, makes the guard stop the target;
    kill() the guard to let the target live (e.g. after stopping it yourself)."""
    return subprocess.Popen(
        [sys.executable, "-m", "rlflow.engines.cluster.process_group", *([] if group else ["--pid"]), str(target),
         str(grace_s)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


def start_deadline(seconds: float) -> subprocess.Popen:
    """A process that SIGKILLs this one if it is still alive after `seconds` (kernel-level: it works whatever state
    this interpreter is in, finalizing included). Keep the returned Popen: its stdin is the pipe whose EOF (this
    process ended) tells the deadline process to leave, so a reused pid is never signalled."""
    return subprocess.Popen(
        [sys.executable, "-m", "rlflow.engines.cluster.process_group", "--deadline", str(os.getpid()), str(seconds)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


def main(argv: list[str]) -> None:
    target, seconds = int(argv[-2]), float(argv[-1])
    if argv[0] == "--deadline":
        ended, _, _ = select.select([sys.stdin], [], [], seconds)  # readable at EOF: the owner ended in time
        if not ended:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGKILL)
        return
    sys.stdin.buffer.read()  # returns at EOF: the owner closed the pipe or died
    (stop_group if argv[0] != "--pid" else stop_process)(target, seconds)


if __name__ == "__main__":
    main(sys.argv[1:])
