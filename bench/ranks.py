"""Run one function on N ranks, each a fresh spawned process on this host, under one time limit.

Why not torch.multiprocessing.spawn: a benchmark on a lent machine must never wait on a hung collective. Here
the parent polls its ranks: when one dies (an exception, out of memory) the others, likely blocked in a
collective waiting for it, are killed at once instead of after NCCL's timeout, and when the time limit passes
every rank still alive is killed. Each rank picks its own GPU (rlflow's process-group setup maps rank r to
GPU r % visible GPUs), so CUDA_VISIBLE_DEVICES decides which GPUs a run gets.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench import harness


def _rank_main(target: Callable, rank: int, world: int, args: tuple) -> None:
    try:
        target(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def run_ranks(target: Callable, world: int, timeout: float, *args) -> None:
    """target(rank, world, *args) in `world` spawned processes; raise TimeoutError if any is still running after
    `timeout` seconds, RuntimeError if one exits non-zero (the rest are killed then; tracebacks go to stderr).
    `target` must be a module-level function (spawn imports it by name)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(target, rank, world, args)) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed: list[tuple[int, int]] = []
    while True:
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        running = [p for p in procs if p.is_alive()]
        if failed or not running or time.monotonic() > deadline:
            break
        running[0].join(0.2)
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:
        p.kill()
    for p in procs:
        p.join()
    if failed:
        rank, code = failed[0]
        raise RuntimeError(
            f"{getattr(target, '__name__', target)}: rank {rank} exited with {code} (its traceback "
            f"is printed above){'; the other ranks were killed' if stuck else ''}"
        )
    if stuck:
        raise TimeoutError(f"{getattr(target, '__name__', target)}: still running after {timeout:.0f} s (killed)")


@contextmanager
def rank_result(out: str, rank: int) -> Iterator[dict]:
    """The dict a rank fills with its figures, written to `out`.<rank>.json however the rank ends: with its GPU
    (rank r takes GPU r % visible, as rlflow's process-group setup does) and peak memory, and on an exception an
    "error" naming it before the exception goes on (the rank exits, the launcher stops the rest;
    run_and_collect then reports an out-of-memory rank's error instead of "rank exited with 1")."""
    cuda = torch.cuda.is_available()
    gpu = rank % torch.cuda.device_count() if cuda else None
    if cuda:
        torch.cuda.set_device(gpu)
        torch.cuda.reset_peak_memory_stats(gpu)
    result: dict = {"rank": rank, "device": harness.device_name(gpu)}
    try:
        yield result
    except BaseException as e:
        first = (str(e).splitlines() or [""])[0]
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        result["error"] = f"out of memory: {first}" if oom else f"{type(e).__name__}: {first}"
        raise
    finally:
        if cuda:
            result["peak_gib"] = torch.cuda.max_memory_allocated(gpu) / 2**30
            result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(gpu) / 2**30
        Path(f"{out}.{rank}.json").write_text(json.dumps(result))


def run_and_collect(target: Callable, world: int, timeout: float, out: str, *args) -> tuple[list[dict], str | None]:
    """run_ranks(target, world, timeout, *args, out) and what the ranks wrote through rank_result: (the ranks'
    dicts, the error that ended the run or None). An out-of-memory rank's message wins over the launcher's."""
    error = None
    try:
        run_ranks(target, world, timeout, *args, out)
    except (RuntimeError, TimeoutError) as e:
        error = str(e)
    ranks = [json.loads(p.read_text()) for r in range(world) if (p := Path(f"{out}.{r}.json")).exists()]
    oom = next((r for r in ranks if r.get("error", "").startswith("out of memory")), None)
    if oom is not None:
        error = f"rank {oom['rank']}: {oom['error']}"
    return ranks, error


def step_figures(ranks: list[dict], steps: int, useful_tokens: int, flops: float) -> dict:
    """Throughput of an N-rank run from the ranks' "step_s" lists: a step ends when its slowest rank's does; the
    median step; useful tokens/s in all and per GPU; TFLOP/s and MFU per GPU (harness.PEAK_BF16_TFLOPS by device
    name; None if unknown); peak memory per rank."""
    n = len(ranks)
    step = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    step_s = sorted(step)[len(step) // 2]
    peak = harness.by_device(harness.PEAK_BF16_TFLOPS, ranks[0]["device"])
    tflops = flops / step_s / n / 1e12
    return {
        "step_s": step,
        "step_s_median": step_s,
        "tokens_per_s": useful_tokens / step_s,
        "tokens_per_s_per_gpu": useful_tokens / step_s / n,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak else None,
        "loss": ranks[0].get("loss"),
        "grad_norm": ranks[0].get("grad_norm"),  # with the loss: a kernel or layout that computes another step shows
        "peak_gib_per_rank": [r.get("peak_gib") for r in ranks],
    }


def time_left(timeout: float, end: float) -> float:
    """The time limit of the next run: --timeout, or less where the script's --deadline (monotonic `end`) is
    nearer, so that a few slow or hung runs cannot take the whole device budget."""
    return min(timeout, end - time.monotonic())


def rendezvous(out: str) -> str:
    """The init_method of one run's process group: a file next to its results, new for each run, so no two runs
    (nor a port another process takes between being picked and bound, as with tcp://) can meet by mistake."""
    path = Path(f"{out}.rendezvous")
    path.unlink(missing_ok=True)
    return f"file://{path.resolve()}"


def add_workload_args(p: argparse.ArgumentParser, shapes: dict, steps: int) -> None:
    """The flags both multi-GPU benches share: the model shape, bench/train/scale.py's RL workload per GPU, the timed
    steps and the whole script's deadline. `finish_workload_args` completes them after parsing."""
    p.add_argument("--shape", choices=sorted(shapes), default="1.5b")
    harness.add_smoke(p)
    p.add_argument("--steps", type=int, default=steps, help="timed steps (after one warm-up); the median is reported")
    p.add_argument("--samples", type=int, default=64, help="samples per GPU (the batch is N x this)")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response-min", type=int, default=64)
    p.add_argument("--response-max", type=int, default=1792)
    p.add_argument(
        "--deadline",
        type=float,
        default=570,
        help="seconds for the whole script: a run that would start later is skipped, one that would end later gets "
        "less than --timeout (default: under a 10-minute device call)",
    )


def finish_workload_args(a: argparse.Namespace) -> None:
    """The deadline as a clock time; --smoke shrinks the workload to a toy run on CPU, on the toy shape ("smoke";
    "smoke-moe" for --shape moe, the toy MoE shape of a script that has one)."""
    a.end = time.monotonic() + a.deadline
    if a.smoke:
        a.shape = "smoke-moe" if a.shape == "moe" else "smoke"
        a.samples, a.prompt, a.response_min, a.response_max = 4, 16, 4, 48
        a.steps = min(a.steps, 2)
