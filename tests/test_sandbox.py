"""The sandbox for model-written code (engines/env/): each escape attempt (network, writes outside scratch, the run's
secrets, a fork bomb, an endless loop, memory exhaustion) is contained and reported, on both backends where they
exist; the pool's concurrency limit holds from threads and from asyncio; the config's errors name their fields."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from rlflow.engines.core.config import RecipeError, SandboxConfig, config_from_dict
from rlflow.engines.env import sandbox as sandbox_module
from rlflow.engines.env.pool import SandboxPool
from rlflow.engines.env.sandbox import Sandbox, SandboxUnavailable

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the isolated backends need root (docs/security.md)")

SMALL = dict(cpu_seconds=2, wall_seconds=10, memory_mb=256, max_processes=32, max_output_bytes=4096)


@pytest.fixture(params=["namespaces", "bwrap"], scope="module")
def sandbox(request) -> Sandbox:
    if os.geteuid() != 0:
        pytest.skip("the isolated backends need root (docs/security.md)")
    if request.param == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    return Sandbox(SandboxConfig(backend=request.param, **SMALL))


def test_runs_code_with_files_and_stdin_and_says_which_backend(sandbox, caplog) -> None:
    code = "import sys, helper; print(helper.VALUE, sys.stdin.read().upper(), open('data/x.txt').read())"
    result = sandbox.run_python(code, files={"helper.py": b"VALUE = 41 + 1\n", "data/x.txt": b"file"},
                                stdin=b"in")
    assert result.ok, result
    assert result.stdout == b"42 IN file\n"
    assert result.isolation == sandbox.config.backend
    assert result.wall_s < 5 and result.cpu_s > 0
    argv = sandbox.run(["/bin/sh", "-c", "echo $HOME; id -u; exit 3"])
    assert (argv.exit_code, argv.stdout, argv.killed) == (3, b"/tmp\n65534\n", None)


@needs_root
def test_the_backend_is_logged(caplog) -> None:
    with caplog.at_level("INFO", logger="rlflow.engines.env.sandbox"):
        box = Sandbox(SandboxConfig(backend="namespaces"))
    assert box.isolation == "namespaces"
    assert "isolation backend namespaces" in caplog.text


def test_no_network_to_the_host_nor_outside(sandbox) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = f"""
import socket
for what, call in [("host", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2)),
                   ("dns", lambda: socket.getaddrinfo("example.com", 80)),
                   ("outbound", lambda: socket.create_connection(("1.1.1.1", 53), timeout=2))]:
    try:
        call()
        print(what, "reached")
    except OSError as e:
        print(what, "blocked", type(e).__name__)
"""
    try:
        result = sandbox.run_python(code)
        with pytest.raises(TimeoutError):
            server.accept()  # nobody connected
    finally:
        server.close()
    assert result.ok, result
    lines = result.stdout.decode().splitlines()
    assert [line.split()[:2] for line in lines] == [["host", "blocked"], ["dns", "blocked"], ["outbound", "blocked"]]
    probe = socket.create_connection  # the same connection from the test process itself does work
    with socket.create_server(("127.0.0.1", 0)) as s:
        probe(s.getsockname()).close()


def test_writes_outside_scratch_fail(sandbox, tmp_path: Path) -> None:
    targets = ["/etc/rlflow-escape", "/usr/rlflow-escape", "/rlflow-escape", "/dev/shm/rlflow-escape",
               "/var/tmp/rlflow-escape", str(tmp_path / "rlflow-escape"), str(Path.cwd() / "rlflow-escape")]
    code = f"""
import os
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("x")
        print("wrote", path)
    except OSError as e:
        print("refused", path, e.errno)
open("inside.txt", "w").write("ok")
print("scratch", open("/tmp/inside.txt").read())
"""
    try:
        result = sandbox.run_python(code)
        escaped = [path for path in targets if Path(path).exists()]
    finally:
        for path in targets:  # an escape is a failure, not a mess left on the host
            Path(path).unlink(missing_ok=True)
    assert escaped == []
    assert result.ok, result
    out = result.stdout.decode().splitlines()
    assert [line.split()[0] for line in out] == ["refused"] * len(targets) + ["scratch"], out
    assert out[-1] == "scratch ok"


def test_the_runs_secrets_are_out_of_reach(sandbox, monkeypatch) -> None:
    secret = "planted-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secret)
    code = f"""
import os, glob
print(dict(os.environ))
for path in ["/proc/{os.getpid()}/environ", "/proc/1/environ", *glob.glob("/proc/[0-9]*/environ"),
             "/root/.aws/credentials", "/root/.bashrc"]:
    try:
        print(path, open(path, "rb").read())
    except OSError as e:
        print(path, "refused", e.errno)
print(sorted(os.listdir("/proc"))[:3], os.listdir("/root"))
"""
    result = sandbox.run_python(code)
    assert result.ok, result
    assert secret.encode() not in result.stdout + result.stderr
    assert b"AWS_" not in result.stdout and b"MLFLOW" not in result.stdout
    assert f"/proc/{os.getpid()}/environ refused".encode() in result.stdout  # the test process is not even seen
    assert b"['.pyenv']" in result.stdout or b"[]" in result.stdout  # /root is an empty cover (+ the interpreter)


def _uid_processes(uid: int) -> int:
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nUid:\t{uid}\t" in text:
            count += 1
    return count


def _leftovers() -> list[str]:
    """Processes of a call still there: the sandbox's uid, or the helper (its source is on its command line),
    zombies included."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline, status = (proc / "cmdline").read_bytes(), (proc / "status").read_text()
        except OSError:
            continue
        if b"The sandbox's own side" in cmdline or "\nUid:\t65534\t" in status:
            found.append(status.splitlines()[0] + " " + proc.name)
    return found


def test_a_fork_bomb_is_contained(sandbox) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _uid_processes(65534))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = sandbox.run_python(bomb, limits={"wall_seconds": 2, "max_processes": 16})
    finally:
        done.set()
        watcher.join()
    assert result.killed == "wall_time", result
    assert result.wall_s < 5
    assert 2 <= peak[0] <= 16 + 3, peak  # it forked, up to its limit (+ bwrap's pid 1 and the supervisor)
    assert _leftovers() == []  # nothing survives the call, not even a zombie


def test_an_endless_loop_is_stopped_by_cpu_time_and_a_sleep_by_wall_time(sandbox) -> None:
    spin = sandbox.run_python("while True:\n    pass\n", limits={"cpu_seconds": 1})
    assert spin.killed == "cpu_time", spin
    assert spin.exit_code < 0 and 0.9 < spin.cpu_s < 3
    sleep = sandbox.run_python("import time\nprint('start', flush=True)\ntime.sleep(60)\n",
                               limits={"wall_seconds": 1})
    assert sleep.killed == "wall_time" and sleep.stdout == b"start\n", sleep
    assert 1 <= sleep.wall_s < 4
    assert _leftovers() == []


def test_no_privilege_inside(sandbox) -> None:
    """No capabilities, no user namespace of its own (where a tmpfs would be memory outside its limits)."""
    result = sandbox.run(["/bin/sh", "-c", "grep CapEff /proc/self/status; unshare --user --map-root-user true "
                          "&& echo userns-made || echo userns-refused; mkdir m; mount -t tmpfs none m 2>/dev/null "
                          "&& echo mounted || echo mount-refused"])
    assert result.stdout.decode().split() == ["CapEff:", "0000000000000000", "userns-refused", "mount-refused"]


def test_memory_exhaustion_fails_inside(sandbox) -> None:
    result = sandbox.run_python("x = bytearray(1 << 30)\nprint('allocated')", limits={"memory_mb": 128})
    assert result.killed == "memory", result
    assert b"allocated" not in result.stdout and b"MemoryError" in result.stderr
    small = sandbox.run_python("x = bytearray(16 << 20)\nprint('allocated')", limits={"memory_mb": 128})
    assert small.ok and small.stdout == b"allocated\n", small


def test_output_is_capped(sandbox) -> None:
    result = sandbox.run_python("import sys\nsys.stdout.write('a' * 100000)\nsys.stderr.write('b' * 10)\n",
                                limits={"max_output_bytes": 1000})
    assert result.ok
    assert result.stdout == b"a" * 1000 and result.stdout_truncated
    assert result.stderr == b"b" * 10 and not result.stderr_truncated


def test_limit_overrides_are_checked_by_name(sandbox) -> None:
    with pytest.raises(ValueError, match="cpu_seconds"):
        sandbox.run_python("pass", limits={"cpu_seconds": -1})
    with pytest.raises(ValueError, match="files:"):
        sandbox.run_python("pass", files={"../out": b"x"})


@needs_root
def test_pool_bounds_concurrency_from_threads_and_asyncio() -> None:
    config = SandboxConfig(backend="namespaces", max_concurrent=2, **SMALL)
    code = "import time\nprint(time.time())\ntime.sleep(0.4)\nprint(time.time())\n"
    with SandboxPool(config) as pool:
        threads = [threading.Thread(target=pool.run_python, args=(code,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert pool.peak == 2 and pool.running == 0

        async def many() -> list:
            return await asyncio.gather(*(pool.arun_python(code) for _ in range(5)))

        results = asyncio.run(many())
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    assert all(r.ok for r in results)
    most = max(sum(a < t < b for a, b in spans) for t in (s for s, _ in spans))
    assert most == 1  # when a call started, one other (never two) was running: 2 at a time, from the code's clock
    assert max(b for _, b in spans) - min(a for a, _ in spans) >= 0.4 * 3 - 0.1  # 5 calls, 2 at a time: 3 rounds


def test_refuses_to_start_without_isolation_unless_allowed(monkeypatch) -> None:
    monkeypatch.setattr(sandbox_module, "probe", lambda backend: "not here (test)")
    with pytest.raises(SandboxUnavailable, match="sandbox.allow_unisolated: true"):
        Sandbox(SandboxConfig())
    with pytest.raises(SandboxUnavailable, match="sandbox.backend"):
        Sandbox(SandboxConfig(backend="bwrap"))
    box = Sandbox(SandboxConfig(allow_unisolated=True, **SMALL))
    result = box.run_python("import os\nprint(sorted(os.environ))")
    assert result.isolation == "none" and result.ok
    assert result.stdout.decode().strip() == str(sorted(sandbox_module.SANDBOX_ENV))


def test_config_errors_name_the_field() -> None:
    raw = {"data": {}, "sandbox": {"backend": "docker", "memory_mb": 1, "max_concurrent": 0, "wall_secs": 3}}
    with pytest.raises(RecipeError) as err:
        config_from_dict(raw)
    text = str(err.value)
    for field in ("sandbox.backend", "sandbox.memory_mb", "sandbox.max_concurrent", "sandbox.wall_secs"):
        assert field in text, text
    assert "did you mean 'wall_seconds'" in text
