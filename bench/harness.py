"""What every bench script repeats, in one place: the device a figure was taken on, timing on a GPU, the JSON report,
`--smoke`, and the child process a measurement runs in (so that one crash, hang or leak cannot touch the next).

Figures are comparable only on the same device, so every report starts with `report_header` (date, command, device,
versions). Nothing here imports rlflow: the GPU machines run bench/ without Ray, Prefect or MLflow.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# dense bf16 peak of the SXM cards, TFLOP/s: the MFU denominator (other devices report TFLOP/s only)
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}
# datasheet memory bandwidth of the SXM cards, GB/s
HBM_GB_PER_S = {"H100": 3350.0, "H200": 4800.0}
RESULT = "RESULT "  # a child's result line: RESULT <json>
PROFILE_ENV = "RLFLOW_BENCH_PROFILE"  # set: the scripts that can, profile one more step's kernels


# ---- the device --------------------------------------------------------------------------------------------------
def device() -> str:
    """"cuda" where a GPU is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(gpu: int | None = None) -> str:
    """The GPU's name (torch's), or the CPU's. Asking for a GPU's name starts CUDA in this process: a launcher whose
    spawned ranks own the GPUs takes the name from a rank instead."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(gpu)
    return platform.processor() or "cpu"


def by_device(table: dict[str, float], name: str) -> float | None:
    """The value of the first key of `table` that `name` contains (PEAK_BF16_TFLOPS["H100"] for "NVIDIA H100 80GB
    HBM3"); None for a device the table does not know."""
    return next((v for k, v in table.items() if k in name), None)


def versions() -> dict[str, str | None]:
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}


def report_header(module: str, argv: Sequence[str] | None, name_device: bool = True) -> dict[str, Any]:
    """The fields every report starts with: date, the command that made it, GPUs visible, versions and (unless
    `name_device` is False: see device_name) the device's name."""
    header: dict[str, Any] = {"date": dt.date.today().isoformat(), "command": command(module, argv),
                              "gpus": torch.cuda.device_count(), **versions()}
    if name_device:
        header["device"] = device_name()
    return header


def command(module: str, argv: Sequence[str] | None = None) -> str:
    """`python -m <module> <args>` as it was run (`argv`: main's own arguments; None: this process's)."""
    return " ".join(["python -m", module, *(sys.argv[1:] if argv is None else argv)])


# ---- timing ------------------------------------------------------------------------------------------------------
def sync(on: str | torch.device | None = None) -> None:
    """Wait for the GPU, so a wall-clock interval covers the work queued in it (nothing to wait for on a CPU)."""
    if str(on if on is not None else device()).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeats: int, warmup: int = 0, on: str | None = None) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones, the GPU waited for around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(on)
        t0 = time.perf_counter()
        fn()
        sync(on)
        times.append(time.perf_counter() - t0)
    return times


def mean_time(fn: Callable[[], object], repeats: int, warmup: int = 0, on: str | None = None) -> float:
    """Mean seconds of `repeats` back-to-back calls after `warmup` untimed ones, the GPU waited for once at each end:
    the rate of work queued without a pause (small kernels), where `timed` gives each call's own time."""
    for _ in range(warmup):
        fn()
    sync(on)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(on)
    return (time.perf_counter() - t0) / repeats


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def peak_gib(gpu: int | None = None) -> float | None:
    """The most GPU memory torch allocated since the last reset, GiB; None on a CPU."""
    return torch.cuda.max_memory_allocated(gpu) / 2**30 if torch.cuda.is_available() else None


def say(what: str) -> None:
    """A progress line with the time of day (a device run's log shows where the minutes went)."""
    print(f"[{time.strftime('%X')}] {what}", flush=True)


def profiling() -> bool:
    """Whether RLFLOW_BENCH_PROFILE asks for a kernel profile (and there is a GPU to profile)."""
    return bool(os.environ.get(PROFILE_ENV)) and torch.cuda.is_available()


def kernel_profile(fn: Callable[[], object], rows: int = 25) -> dict[str, Any]:
    """One call of `fn` under torch.profiler, as the GPU saw it: wall seconds, the seconds some kernel was running
    (the union of kernel intervals: the rest is the GPU waiting for the host), kernel seconds by kind of work, the
    top kernels by GPU time, and torch's table of them. A failure is returned as {"error"}: a profile is context and
    must not lose the timings around it."""
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - see the docstring
        return {"error": repr(e)}
    spans, kinds = [], {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        spans.append((e.time_range.start, e.time_range.end))
        kind = next((k for k, frags in KERNEL_KINDS if any(f in e.name.lower() for f in frags)), OTHER_KERNELS)
        kinds[kind] = kinds.get(kind, 0.0) + (e.time_range.end - e.time_range.start) / 1e6
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):  # the union of the intervals, in microseconds
        if b > end:
            busy += b - max(a, end)
            end = b
    top = sorted(((e.key, getattr(e, "self_device_time_total", 0), e.count) for e in prof.key_averages()),
                 key=lambda r: -r[1])
    return {"wall_s": wall, "gpu_busy_s": busy / 1e6, "gpu_busy_fraction": busy / 1e6 / wall if wall else None,
            "kernel_s_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"name": k[:120], "ms": us / 1e3, "count": c} for k, us, c in top[:rows] if us > 0],
            "table": prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows,
                                               max_name_column_width=60)}


OTHER_KERNELS = "other (elementwise, reductions)"
# kernel name fragments -> the kind of work (first match wins; else OTHER_KERNELS)
KERNEL_KINDS = [("attention", ("flash", "fmha", "attention")),  # before matmul: flash kernels name cutlass types
                ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "sm80_", "cublas")),
                ("compiled (triton)", ("triton_",)), ("collectives", ("nccl",)),
                ("copies", ("memcpy", "memset", "copy_kernel", "catarray"))]


# ---- the report and --smoke --------------------------------------------------------------------------------------
def write_json(path: str | Path, data: Any) -> None:
    """The report, rewritten whole (scripts call this after every section: a run cut short keeps what it finished)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def add_smoke(parser: argparse.ArgumentParser) -> None:
    """The one `--smoke` switch: toy sizes on the CPU, as the CPU tests run a script; its numbers mean nothing."""
    parser.add_argument("--smoke", action="store_true",
                        help="a toy shape on the CPU: checks the script itself, its numbers mean nothing")


# ---- child processes ---------------------------------------------------------------------------------------------
def emit_result(result: dict) -> None:
    """A child's answer to run_child: one RESULT line on stdout."""
    print(RESULT + json.dumps(result), flush=True)


def run_child(args: Sequence[str], timeout: float | None = None, *, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, echo: bool = False, keep_output: bool = False) -> dict[str, Any]:
    """`python <args>` in a fresh process under `timeout` seconds: the JSON of its last RESULT line, or {"error",
    "tail"} when it exits non-zero, prints none or runs out of time; "wall_s" either way. `echo`: print the tail of
    its output; `keep_output`: its whole stdout as "output" on an error (a cut-off run's finished steps)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:  # its output comes back as bytes, text=True or not
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        return ({"error": f"timed out after {timeout:g} s", "tail": out[-2000:], "wall_s": time.perf_counter() - t0}
                | ({"output": out} if keep_output else {}))
    if echo:
        print(p.stdout[-3000:], p.stderr[-3000:], sep="\n", flush=True)
    wall = {"wall_s": time.perf_counter() - t0}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT)]
    if p.returncode or not lines:
        return ({"error": f"exit {p.returncode}", "tail": (p.stdout + p.stderr)[-3000:]} | wall
                | ({"output": p.stdout} if keep_output else {}))
    return json.loads(lines[-1][len(RESULT):]) | wall
