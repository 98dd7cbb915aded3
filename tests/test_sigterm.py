"""SIGTERM ends a run promptly and leaves it resumable (issue 28 item 3): the handler's cleanup runs, and a
deadline (engines/cluster/termination.py) ends the process even when something it waits for hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import small_recipe

ROOT = Path(__file__).resolve().parent.parent

HUNG_EXIT = textwrap.dedent("""
    import signal, sys, threading, time
    from rlflow.engines.cluster.termination import bound_exit_on_sigterm
    if sys.argv[1] == "ray-like":  # ray.init installs one that calls sys.exit(15)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    bound_exit_on_sigterm(2.0)
    threading.Thread(target=time.sleep, args=(600,)).start()  # non-daemon: the interpreter joins it at exit
    try:
        print("ready", flush=True)
        time.sleep(600)
    finally:
        print("cleanup ran", flush=True)
""")


@pytest.mark.parametrize("handler", ["default", "ray-like"])
def test_sigterm_ends_the_process_by_the_deadline_after_cleanup(handler):
    """A thread that never ends would hold the interpreter's exit forever; the deadline process kills it after
    2 s, once the main thread's cleanup (finally) has run. Without a handler in place, SIGTERM still unwinds the
    stack (the default action would end the process at once, with no cleanup)."""
    proc = subprocess.Popen([sys.executable, "-c", HUNG_EXIT, handler], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == -signal.SIGKILL and 1.5 < took < 10, (rc, took)  # the deadline process killed it
    assert proc.stdout.read().strip() == "cleanup ran"


@pytest.mark.slow
def test_sigterm_mid_run_ends_the_flow_promptly_and_keeps_it_resumable(tmp_path):
    """`rlflow run` on Ray (the CPU demo's shape, smaller), SIGTERM once a checkpoint is committed: the process
    ends well within 30 s (measured 5-13 s on 2 busy cores), status failed, the committed checkpoints kept."""
    raw = small_recipe(tmp_path, train={"steps": 200, "threads": 1}, checkpoint={"every": 2}, eval={"every": 0})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(tmp_path / "p")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlflow.flows.cli", "run", str(tmp_path / "r.yaml")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    run = tmp_path / "runs" / "t"
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints").is_dir() or not any((run / "checkpoints").iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was committed"
            time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 30, took
    assert json.loads((run / "status.json").read_text())["status"] == "failed"
    from rlflow.engines.store.run_store import RunStore

    assert RunStore(str(tmp_path / "runs"), "t").latest_step() is not None  # what a resume starts from
