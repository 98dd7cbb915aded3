"""Run untrusted code (a model's tool call, a code reward's test) isolated and limited: `Sandbox(config).run(...)`.

Each call gets a fresh scratch folder, which is its cwd and /tmp and the only place it can write; the rest of the
filesystem is the host's, read-only, with homes, /run and /var/tmp hidden; no network (an empty network namespace);
no environment but a few neutral variables; its own PID namespace, so no other process (the run's, with its
secrets in /proc/<pid>/environ) is visible, and every process it started dies with the call. The work is done by
inner.py, which this module starts as root; see docs/security.md for what is and is not isolated.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pydantic import ValidationError

from rlflow.engines.core.config.sandbox import SandboxConfig, SandboxLimits

log = logging.getLogger(__name__)

INNER_SOURCE = (Path(__file__).parent / "inner.py").read_text()
NOBODY = 65534
HIDDEN = ("/root", "/home", "/run", "/var/tmp", "/mnt", "/media", "/srv")  # covered by empty read-only tmpfs
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
MEMORY_WORDS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
KILL_GRACE_S = 2.0  # after a kill, how long the pipes may take to close


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (never the code's own failure, which is a result)."""


class SandboxUnavailable(SandboxError):
    """No isolation backend works here, and sandbox.allow_unisolated is off (or the named backend is missing)."""


@dataclass(frozen=True)
class SandboxResult:
    """What a call did. exit_code as subprocess's returncode (negative: killed by that signal); killed names the
    limit that ended it ('wall_time', 'cpu_time', 'memory') or is None; cpu_s counts the code's processes that
    ended before the call did (0 for a call killed at its wall time); isolation names the backend used."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    killed: str | None
    wall_s: float
    cpu_s: float
    isolation: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None


def _probe(backend: str) -> str | None:
    """None when `backend` runs code here, else why not (tried for real: a namespace that the kernel, a container's
    seccomp or a missing binary refuses shows only when used)."""
    if os.geteuid() != 0:
        return "needs root (a container's root is enough) to build the read-only view of the filesystem"
    if backend == "bwrap" and shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    config = SandboxConfig(backend=backend, cpu_seconds=5, wall_seconds=20)
    try:
        result = Sandbox(config, _resolved=backend).run("pass")  # this interpreter too: code runs on it
    except SandboxError as e:
        return str(e)
    return None if result.exit_code == 0 else f"a probe exited {result.exit_code}: {result.stderr[-500:]!r}"


@functools.cache
def probe(backend: str) -> str | None:
    return _probe(backend)


def resolve_backend(config: SandboxConfig) -> str:
    """The backend config.backend names and that works here; 'none' only with allow_unisolated."""
    candidates = ["bwrap", "namespaces"] if config.backend == "auto" else [config.backend]
    why = {}
    for backend in candidates:
        why[backend] = probe(backend)
        if why[backend] is None:
            return backend
    reasons = "; ".join(f"{b}: {w}" for b, w in why.items())
    if config.allow_unisolated:
        log.warning("sandbox: no isolation (%s); running code with only rlimits because sandbox.allow_unisolated "
                    "is true", reasons)
        return "none"
    if config.backend != "auto":
        raise SandboxUnavailable(f"sandbox.backend: {config.backend} does not work here ({reasons}); auto picks the "
                                 "one that does")
    raise SandboxUnavailable(f"no sandbox backend works here ({reasons}); both need root (a container's is enough). "
                             "Or set sandbox.allow_unisolated: true to run model-written code without isolation "
                             "(only its rlimits)")


def _limits(base: SandboxLimits, overrides: Mapping[str, float | int] | None) -> SandboxLimits:
    if not overrides:
        return base
    fields = set(SandboxLimits.model_fields)
    try:
        return SandboxLimits.model_validate(base.model_dump(include=fields) | dict(overrides))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors())
        raise ValueError(f"sandbox limits: {problems}") from None


def _scratch_path(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts:
        raise ValueError(f"files: {name!r} must be a relative path inside the scratch folder")
    return path


class Sandbox:
    """Runs code isolated (config.backend), one call at a time per thread; thread-safe (SandboxPool bounds how many
    run at once)."""

    def __init__(self, config: SandboxConfig | None = None, *, _resolved: str | None = None):
        self.config = config or SandboxConfig()
        self.isolation = _resolved or resolve_backend(self.config)
        if _resolved is None:
            log.info("sandbox: isolation backend %s", self.isolation)

    def run(self, command: Sequence[str] | str, *, files: Mapping[str, bytes] | None = None, stdin: bytes = b"",
            limits: Mapping[str, float | int] | None = None) -> SandboxResult:
        """Run `command` (an argv; a str is Python source, run as main.py by this interpreter) in a fresh scratch
        folder holding `files` (relative name -> bytes), with `stdin`, under the config's limits updated by
        `limits`."""
        lim = _limits(self.config, limits)
        files = dict(files or {})
        if isinstance(command, str):
            if "main.py" in files:
                raise ValueError("files: main.py is where the Python code goes; name the file otherwise")
            files["main.py"] = command.encode()
            command = [sys.executable, "-E", "-s", "-B", "main.py"]
        if not command:
            raise ValueError("command: an empty argv")
        call = Path(tempfile.mkdtemp(prefix="rlflow-sandbox-"))
        try:
            return self._run_in(call, list(command), files, stdin, lim)
        finally:
            _remove_call_folder(call)

    def _run_in(self, call: Path, argv: list[str], files: dict[str, bytes], stdin: bytes,
                lim: SandboxLimits) -> SandboxResult:
        scratch, root = call / "scratch", call / "root"
        scratch.mkdir()
        root.mkdir()
        for name, data in files.items():
            path = scratch / _scratch_path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        if self.isolation != "none" and os.geteuid() == 0:
            for path in [call, *scratch.rglob("*"), scratch]:
                os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
        (call / "stdin").write_bytes(stdin)
        status_r, status_w = os.pipe()
        spec = {"backend": self.isolation, "root": str(root), "scratch": str(scratch), "cwd": "/tmp",
                "hide": list(HIDDEN), "keep": _interpreter_folders(), "argv": argv, "env": SANDBOX_ENV,
                "limits": lim.model_dump(), "status_fd": status_w, "bwrap": shutil.which("bwrap") or "",
                "source": INNER_SOURCE}
        start = time.monotonic()
        try:
            with open(call / "stdin", "rb") as stdin_file:
                proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", INNER_SOURCE, json.dumps(spec)],
                                        stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                        cwd=call, pass_fds=[status_w], start_new_session=True)
        finally:
            os.close(status_w)
        with os.fdopen(status_r, "rb") as status_pipe:
            out, err, status, timed_out = _collect(proc, status_pipe, start + lim.wall_seconds, lim.max_output_bytes)
        wall = time.monotonic() - start
        if "setup_error" in status:
            raise SandboxError(f"sandbox ({self.isolation}): {status['setup_error']}; {err[1][-2000:]!r}")
        try:
            code = os.waitstatus_to_exitcode(status["status"])
        except (KeyError, ValueError):  # no report: the helper's own exit code (killed: negative)
            code = proc.returncode
        cpu = status.get("cpu_s", 0.0)
        return SandboxResult(exit_code=code, stdout=out[1], stderr=err[1], killed=_killed(timed_out, code, cpu,
                             err[1], lim), wall_s=wall, cpu_s=cpu, isolation=self.isolation,
                             stdout_truncated=out[0] > len(out[1]), stderr_truncated=err[0] > len(err[1]))

    def run_python(self, code: str, *, files: Mapping[str, bytes] | None = None, stdin: bytes = b"",
                   limits: Mapping[str, float | int] | None = None) -> SandboxResult:
        """Python source run as main.py in the scratch folder (the tool-use case)."""
        return self.run(code, files=files, stdin=stdin, limits=limits)


def _remove_call_folder(call: Path) -> None:
    """The call's folder, but root/ only with rmdir: the host's / was bound there in the helper's (private) mount
    namespace, and if that bind were ever seen here, a recursive delete would walk the host's filesystem."""
    try:
        (call / "root").rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.error("sandbox: %s is not empty, left in place (%s)", call / "root", e)
        return
    shutil.rmtree(call)


def _interpreter_folders() -> list[str]:
    """The folders this interpreter needs, bound back into the view where they sit under a hidden folder."""
    return sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
                  | {sys.prefix, sys.base_prefix})


def _collect(proc: subprocess.Popen, status_pipe, deadline: float, cap: int
             ) -> tuple[tuple[int, bytes], tuple[int, bytes], dict, bool]:
    """Read stdout, stderr (the first `cap` bytes of each kept, all counted) and the status line until the call ends
    or its deadline passes; at the deadline ask the helper to kill the call (SIGTERM), then kill its process group."""
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray(), status_pipe: bytearray()}
    seen = dict.fromkeys(kept, 0)
    timed_out = False
    with selectors.DefaultSelector() as sel:
        for pipe in kept:
            sel.register(pipe, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if timed_out:
                    break  # killed, and something still holds a pipe open past the grace
                timed_out = True
                proc.send_signal(signal.SIGTERM)  # the helper kills the namespace and reaps it
                deadline = time.monotonic() + KILL_GRACE_S
                continue
            for key, _ in sel.select(timeout=min(left, 1.0)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                pipe = key.fileobj
                seen[pipe] += len(chunk)
                room = (cap if pipe is not status_pipe else 65536) - len(kept[pipe])
                kept[pipe] += chunk[:max(room, 0)]
    if timed_out and proc.poll() is None:
        _kill(proc)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    return ((seen[proc.stdout], bytes(kept[proc.stdout])), (seen[proc.stderr], bytes(kept[proc.stderr])),
            _status(bytes(kept[status_pipe])), timed_out)


def _status(text: bytes) -> dict:
    """The supervisor's last report; under bwrap the code shares its uid and could kill it or write here, so
    anything malformed counts as no report."""
    lines = text.splitlines()
    try:
        status = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return {}
    if not isinstance(status, dict):
        return {}
    if isinstance(status.get("setup_error"), str):
        return {"setup_error": status["setup_error"]}
    if isinstance(status.get("status"), int) and isinstance(status.get("cpu_s"), int | float):
        return {"status": status["status"], "cpu_s": float(status["cpu_s"])}
    return {}


def _kill(proc: subprocess.Popen) -> None:
    """The last resort, when the helper did not end the call within KILL_GRACE_S of its SIGTERM."""
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)


def _killed(timed_out: bool, code: int, cpu_s: float, stderr: bytes, lim: SandboxLimits) -> str | None:
    """Which limit ended the call. 'memory' is read from what the code said (Python's MemoryError, C's ENOMEM
    messages) since an exhausted RLIMIT_AS is a failed allocation, not a signal."""
    if timed_out:
        return "wall_time"
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu_s >= lim.cpu_seconds):
        return "cpu_time"
    if code != 0 and any(word in stderr[-4096:] for word in MEMORY_WORDS):
        return "memory"
    return None
