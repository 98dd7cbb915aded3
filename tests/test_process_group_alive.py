"""process_alive / group_alive: one signal-0 probe serves a process and a process group."""

from __future__ import annotations

import os
import subprocess
import sys

from rlflow.engines.cluster.process_group import group_alive, process_alive


def test_alive_while_running_and_gone_once_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert process_alive(child.pid)
        assert group_alive(child.pid)  # a new session's leader: its pgid is its pid
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid)
    assert not group_alive(child.pid)


def test_own_process_and_group_alive() -> None:
    assert process_alive(os.getpid())
    assert group_alive(os.getpgid(0))
