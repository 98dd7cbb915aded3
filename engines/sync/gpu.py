"""The device a worker's weight sync runs on, and the bandwidth probes (a device copy, an all-gather) the GPU
transports' benchmarks compare against, with `GpuLinkProbe`, what the benchmarks ask of both sides (the flat
weight layout the GPU transports build on is engines/models/flat_weights.py)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist


class GpuLinkProbe(Protocol):
    """What the GPU benchmarks ask of both sides: the link's bandwidth and a checksum of the weights."""

    def link_bandwidth(self, kind: str, nbytes: int) -> float: ...

    def weights_digest(self, *args: str) -> float: ...


def sync_device(kind: str) -> torch.device:
    """The device a worker's weight sync runs on: its current GPU for 'cuda' (the worker set it when it
    started), the CPU otherwise (the nccl transport's gloo path: tests and CPU runs)."""
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


@contextlib.contextmanager
def plain_segments() -> Iterator[None]:
    """GPU memory allocated inside comes from plain cudaMalloc segments even when the allocator is set to
    expandable segments (PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF): what a rollout worker's weights need when a
    sharded trainer maps them at every sync. CUDA IPC opens an expandable segment piece by piece in the other
    process; a 7B model's 15 GB took 0.13 s more a sync that way (docs/benchmarks.md). Setting the allocator's
    options replaces the whole string, so the rest of it is kept, and the string is put back as it was."""
    if not torch.cuda.is_available():
        yield
        return
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    before = get() if get is not None else (os.environ.get("PYTORCH_ALLOC_CONF")
                                             or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if not EXPANDABLE.search(before):
        yield
        return
    torch.cuda.memory._set_allocator_settings(EXPANDABLE.sub("expandable_segments:False", before))
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings(before)


EXPANDABLE = re.compile(r"expandable_segments:\s*true", re.IGNORECASE)


@torch.no_grad()
def device_copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10, source_dtype=torch.bfloat16) -> float:
    """GB/s of a plain device-to-device copy on one GPU into a bf16 tensor of `nbytes` (bytes written per
    second). source_dtype=float32 measures the fp32 -> bf16 cast copy a colocated sync does."""
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    src = torch.empty(dst.numel(), dtype=source_dtype, device=device)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return nbytes * repeats / (time.perf_counter() - t0) / 1e9


@torch.no_grad()
def all_gather_bandwidth(device: torch.device, nbytes: int, group: dist.ProcessGroup | None = None,
                         repeats: int = 10) -> float:
    """GB/s of an all-gather among the ranks of `group` (None: the default group) into a bf16 output of `nbytes`
    (down to a multiple of the ranks): output bytes per second per rank, what each rank of a sharded trainer
    receives and writes when every rank gathers every weight (cuda_ipc over FSDP2). Collective: every rank calls
    it (gloo on the CPU)."""
    shard = nbytes // 2 // dist.get_world_size(group)
    part = torch.empty(shard, dtype=torch.bfloat16, device=device)
    out = torch.empty(shard * dist.get_world_size(group), dtype=torch.bfloat16, device=device)
    dist.all_gather_into_tensor(out, part, group=group)  # the first connects; it also lines the ranks up
    _synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dist.all_gather_into_tensor(out, part, group=group)
    _synchronize(device)
    return out.numel() * out.element_size() * repeats / (time.perf_counter() - t0) / 1e9


def _synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (a CPU collective has ended when it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
