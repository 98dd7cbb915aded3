"""Stopping a child server's whole process group, and the guard that does it when its owner dies.

An SGLang server is a process tree (the HTTP server, its scheduler and detokenizer). The worker starts it as
the leader of a new process group, so one signal reaches the tree. A Ray actor that is SIGKILLed runs no
exit handlers, so each worker also starts a guard:

    python -m rlflow.engines.cluster.process_group <pgid> <grace_s>

The guard reads its stdin until EOF. Only the worker holds the pipe's other end, and the kernel closes it
however the worker ends; the guard then stops the group, as `stop_group` does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is still there."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True


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


def main(argv: list[str]) -> None:
    pgid, grace_s = int(argv[0]), float(argv[1])
    sys.stdin.buffer.read()  # returns at EOF: the owner closed the pipe or died
    stop_group(pgid, grace_s)


if __name__ == "__main__":
    main(sys.argv[1:])
