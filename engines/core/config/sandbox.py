"""sandbox: how model-written code (tool calls, code rewards) is isolated and limited (engines/env/,
docs/security.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlflow.engines.core.config.base import Section


class SandboxLimits(Section):
    """What one call may use; a call may override any of them (`Sandbox.run(limits={...})`), checked the same way."""

    cpu_seconds: float = Field(10, gt=0, description="CPU seconds each process of a call may use (RLIMIT_CPU, "
                               "rounded up): past it the process gets SIGXCPU, and the result says killed "
                               "'cpu_time'.")
    wall_seconds: float = Field(30, gt=0, description="Seconds a call may take from start to end; past it every "
                                "process of the call is killed (killed 'wall_time').")
    memory_mb: int = Field(1024, ge=64, description="Address space of each process of a call in MiB (RLIMIT_AS); "
                           "an allocation past it fails (killed 'memory' when the code reports it). Python itself "
                           "needs about 30.")
    max_processes: int = Field(32, ge=2, description="Processes (and threads) a call may have at once "
                               "(RLIMIT_NPROC in the call's own user namespace): a fork bomb stops there.")
    max_file_mb: int = Field(64, gt=0, description="Largest file a call may write in its scratch folder, in MiB "
                             "(RLIMIT_FSIZE).")
    max_output_bytes: int = Field(65536, gt=0, description="Bytes of stdout and of stderr kept in the result each; "
                                  "the rest is read and dropped (stdout_truncated / stderr_truncated say so).")


class SandboxConfig(SandboxLimits):
    """Where untrusted code runs: backend, the default limits of a call, and how many calls run at once."""

    backend: Literal["auto", "bwrap", "namespaces"] = Field("auto", description="auto: bubblewrap when installed "
                                                            "and working, else Linux namespaces; bwrap or namespaces: "
                                                            "that one or an error. Both need root (a container's "
                                                            "root is enough).")
    allow_unisolated: bool = Field(False, description="When no backend works, run the code anyway with only its "
                                   "rlimits, a clean environment and a scratch cwd: no filesystem, network, process "
                                   "or secret isolation. Off: refuse to start.")
    max_concurrent: int = Field(4, gt=0, description="Calls that run at once in a SandboxPool; more wait for a slot.")
