"""A flow process killed with SIGKILL leaves no temporary Prefect server behind (issue 28 item 6); the temporary
server's start-up timeout (issue 49 defect 2)."""

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


STARTUP_TIMEOUT = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
READ_TIMEOUT = """
import sys
from rlflow.flows.cli import prepare_flow_process
assert "prefect" not in sys.modules, "Prefect was imported before its settings' defaults"
prepare_flow_process()  # what `rlflow run|sft|rejection-sample|resume` do before importing Prefect
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
print(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
"""


@pytest.mark.parametrize(("environment", "seconds"), [(None, "180"), ("45", "45")])
def test_the_cli_gives_the_temporary_server_180_s_to_start_unless_the_environment_says(environment, seconds):
    """Prefect's default is 20 s, which 2 of 6 `rlflow run` starts on a loaded machine ran out of. Prefect reads
    the setting once, at import: the value is asked of Prefect in a fresh process, as the CLI starts."""
    env = {k: v for k, v in os.environ.items() if k != STARTUP_TIMEOUT}
    if environment is not None:
        env[STARTUP_TIMEOUT] = environment
    done = subprocess.run([sys.executable, "-c", READ_TIMEOUT], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [seconds]
