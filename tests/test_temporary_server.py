"""A flow process killed with SIGKILL leaves no temporary Prefect server behind (issue 28 item 6)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import small_recipe


def _children(pid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the processes whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append((int(entry.name), [a.decode() for a in argv if a]))
    return out


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the server process through /proc")
def test_sigkilled_flow_leaves_no_temporary_prefect_server(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(small_recipe(tmp_path, cluster={"use_ray": False}, train={"steps": 50})))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(tmp_path / "prefect")}
    flow = subprocess.Popen(
        [sys.executable, "-m", "rlflow.flows.cli", "run", str(recipe)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parent.parent,
    )
    server = port = None
    try:
        deadline = time.monotonic() + 120
        while port is None or not _port_open(port):
            assert flow.poll() is None and time.monotonic() < deadline, "no temporary Prefect server came up"
            for pid, argv in _children(flow.pid):
                if "prefect.server.api.server:create_app" in argv:
                    server, port = pid, int(argv[argv.index("--port") + 1])
            time.sleep(0.2)
        flow.kill()  # SIGKILL: no atexit handler runs
        flow.wait()
        deadline = time.monotonic() + 15
        while (_port_open(port) or _alive(server)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _port_open(port), f"the temporary server still listens on {port} after its flow was SIGKILLed"
        assert not _alive(server)
    finally:
        if flow.poll() is None:
            flow.kill()
        if server is not None and _alive(server):
            os.kill(server, signal.SIGKILL)
