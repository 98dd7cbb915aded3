"""The sandbox's own side: run as `python -I -S -c <this file's text> <spec JSON>` by `Sandbox.run`, never imported
for its functions by rlflow (it needs only the standard library, so it starts without site-packages).

Why ctypes on libc rather than the util-linux `unshare` CLI: Python 3.11 has no os.unshare/mount, and the view of the
filesystem must be built by real root, before the code's user namespace exists. The interpreter often lives under a
0700 home (/root/.pyenv here), which an unprivileged uid cannot even traverse; root binds it into the view, then the
code runs as uid 65534 in a user namespace of its own. That namespace is also what makes RLIMIT_NPROC count each
call's processes apart (and at all: the kernel exempts uid 0 and CAP_SYS_ADMIN holders from it).

Steps (backend "namespaces"): new mount namespace; the host's / bound read-only at <call>/root with the hidden
folders (homes, /run, /var/tmp) covered by empty read-only tmpfs, the interpreter bound back, the scratch folder at
/tmp; new PID, network, IPC and UTS namespaces; pid 1 mounts a fresh /proc, pivots into the view and supervises the
code: forks it, which enters a user namespace mapping only uid/gid 65534, sets its rlimits and execs it; pid 1 reports
the code's wait status and CPU time on the status pipe, then exits, which kills every process left in the namespace.
Backend "bwrap": the same view, then bubblewrap (as uid 65534) makes the namespaces and runs the supervisor inside.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH, AT_FDCWD, AT_RECURSIVE = 2, -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_KEYCTL, KEYCTL_JOIN_SESSION_KEYRING = {"x86_64": 250, "aarch64": 219}, 1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (kernel 5.12+)
NOBODY = 65534

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {source} on {target}")


def set_attr(path: str, attr_set: int, attr_clr: int = 0) -> None:
    """Mount attributes on the whole tree under `path` at once (a remount per submount would miss new ones)."""
    attr = MountAttr(attr_set, attr_clr, 0, 0)
    check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE, ctypes.byref(attr),
                       ctypes.sizeof(attr)), f"mount_setattr {path}")


def unshare(flags: int) -> None:
    check(libc.unshare(flags), f"unshare {flags:#x}")


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def build_view(spec: dict) -> None:
    """The code's filesystem at spec['root'], in a new mount namespace: all read-only but the scratch at /tmp."""
    root, scratch = spec["root"], spec["scratch"]
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing of ours propagates back to the host
    mount("/", root, None, MS_BIND | MS_REC)
    set_attr(root, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
    set_attr(root + "/proc", 0, MOUNT_ATTR_RDONLY)  # a new proc may be mounted only where a writable one is seen
    os.umask(0o022)
    hidden = [h for h in spec["hide"] if os.path.isdir(h) and not os.path.islink(h)]
    for folder in hidden:
        mount("tmpfs", root + folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for keep in spec["keep"]:  # the interpreter, where it lives under a hidden folder
        if any(under(keep, h) for h in hidden) and os.path.isdir(keep):
            os.makedirs(root + keep, exist_ok=True)
            mount(keep, root + keep, None, MS_BIND | MS_REC)
            set_attr(root + keep, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
    for folder in hidden:
        mount(None, root + folder, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    minimal_dev(root + "/dev")
    mount(scratch, root + "/tmp", None, MS_BIND)
    mount(None, root + "/tmp", None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
    for keep in under_scratch(spec):  # the interpreter, where it lives under /tmp (a checkout there): bound back
        os.makedirs(root + keep, exist_ok=True)
        mount(keep, root + keep, None, MS_BIND | MS_REC)
        set_attr(root + keep, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)


def under_scratch(spec: dict) -> list[str]:
    """The interpreter's folders that the scratch, mounted at /tmp, would cover."""
    return [k for k in spec["keep"] if under(k, "/tmp") and os.path.isdir(k)]


def minimal_dev(dev: str) -> None:
    """Only the harmless devices: the host's /dev may hold GPUs (/dev/nvidia*, often 0666), disks, /dev/log."""
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        open(f"{dev}/{name}", "w").close()
        mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")


def report(spec: dict, **fields) -> None:
    os.write(spec["status_fd"], (json.dumps(fields) + "\n").encode())


def enter_nobody_namespace(ready: tuple[int, int], mapped: tuple[int, int]) -> None:
    """The code's own user namespace, where only uid/gid 65534 exist (mapped to 65534 outside by pid 1, which is
    root there): the code has no capability over the mounts and namespaces built as root, its processes are counted
    apart for RLIMIT_NPROC, and it may create no user namespace of its own (max_user_namespaces 0)."""
    unshare(CLONE_NEWUSER)
    os.write(ready[1], b"1")
    if os.read(mapped[0], 1) != b"1":
        raise OSError("the supervisor did not map the user namespace")
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")


def set_limits(limits: dict) -> None:
    cpu = int(-(-limits["cpu_seconds"] // 1))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
    memory = limits["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
    size = limits["max_file_mb"] << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def supervise(spec: dict, own_userns: bool) -> None:
    """Fork the code, reap what ends up here until the code's own process exits, report its status and CPU time;
    never returns."""
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the code (same uid under bwrap) may not ptrace its supervisor
    ready, mapped = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.setpgid(0, 0)
            os.close(spec["status_fd"])
            if own_userns:
                enter_nobody_namespace(ready, mapped)
            for fd in (*ready, *mapped):
                os.close(fd)
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            libc.syscall(SYS_KEYCTL[platform.machine()], KEYCTL_JOIN_SESSION_KEYRING, None)  # not the caller's keys
            set_limits(spec["limits"])
            os.chdir(spec["cwd"])
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        except BaseException as e:  # the code could not start: say why on its stderr, as a shell would
            os.write(2, f"sandbox: cannot run {spec['argv'][0]}: {e}\n".encode())
        os._exit(127)
    try:
        if own_userns and os.read(ready[0], 1) == b"1":  # nothing read: the child failed, and says why
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{child}/{name}", "w") as f:
                    f.write(f"{NOBODY} {NOBODY} 1\n")
            os.write(mapped[1], b"1")
        signal.signal(signal.SIGTERM, lambda *_: kill_group(child))
        status = None
        while status is None:
            pid, st = os.waitpid(-1, 0)
            if pid == child:
                status = st
    except BaseException as e:
        report(spec, setup_error=f"supervisor: {e}")
        os._exit(125)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    report(spec, status=status, cpu_s=usage.ru_utime + usage.ru_stime)
    kill_group(child)  # what the code left running ends with it; as pid 1, this exit kills the rest of the namespace
    os._exit(0)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):  # nothing left in it
        os.killpg(pgid, signal.SIGKILL)


def reap_all() -> int | None:
    """Wait for every child (a subreaper's orphans too); the exit code of the first one."""
    first = None
    while True:
        try:
            _, st = os.waitpid(-1, 0)
        except ChildProcessError:
            return first
        first = os.waitstatus_to_exitcode(st) if first is None else first


def contain(child: int) -> None:
    """The helper's last job, as root outside the namespaces: on SIGTERM (the call's wall time) SIGKILL `child` (pid
    1 of the PID namespace, or bwrap's monitor, whose pid 1 follows it by --die-with-parent); reap everything,
    orphans included (a subreaper), so no zombie is left to the host's init; exit when nothing is left."""
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
    code = reap_all()
    os._exit((code or 0) & 0xFF)


def run_namespaces(spec: dict) -> None:
    build_view(spec)
    unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
    init = os.fork()
    if init == 0:  # pid 1 of the new PID namespace
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
            mount("proc", spec["root"] + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            os.chdir(spec["root"])
            check(libc.syscall(SYS_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
            check(libc.umount2(b".", MNT_DETACH), "detach the host's root")
            os.chdir("/")
        except BaseException as e:
            report(spec, setup_error=f"pid 1: {e}")
            os._exit(125)
        supervise(spec, own_userns=True)
    contain(init)


def run_bwrap(spec: dict) -> None:
    """The view, then bubblewrap as uid 65534 over it: bwrap makes the namespaces (its own user namespace too, with no
    nested ones allowed) and runs this file's supervisor inside."""
    build_view(spec)
    inner = {**spec, "stage": "supervise"}
    args = [spec["bwrap"], "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--uid", str(NOBODY), "--gid", str(NOBODY), "--ro-bind", spec["root"], "/",
            "--bind", spec["scratch"], "/tmp", *(a for k in under_scratch(spec) for a in ("--ro-bind", k, k)),
            "--proc", "/proc",
            "--dev", "/dev", "--remount-ro", "/dev",  # its own /dev/shm would be writable memory
            "--chdir", "/tmp", "--clearenv", "--", sys.executable, "-I", "-S", "-c", spec["source"], json.dumps(inner)]
    monitor = os.fork()
    if monitor == 0:
        try:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            os.execv(spec["bwrap"], args)
        except BaseException as e:
            report(spec, setup_error=f"bwrap: {e}")
        os._exit(125)
    os.close(spec["status_fd"])
    contain(monitor)


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.set_inheritable(spec["status_fd"], spec["backend"] == "bwrap" and spec.get("stage") != "supervise")
    try:
        if spec.get("stage") != "supervise":  # the helper, root, outside
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # the caller gone: clean up as at a timeout
        if spec.get("stage") == "supervise":
            supervise(spec, own_userns=False)
        elif spec["backend"] == "namespaces":
            run_namespaces(spec)
        elif spec["backend"] == "bwrap":
            run_bwrap(spec)
        else:  # "none": rlimits, a clean environment and the scratch as cwd, nothing else
            supervise({**spec, "cwd": spec["scratch"]}, own_userns=False)
    except BaseException as e:
        report(spec, setup_error=f"{spec['backend']}: {e}")
        os._exit(125)


if __name__ == "__main__":
    main()
