"""The device a worker's weight sync runs on, and the copy-bandwidth probe the GPU transports' benchmarks
compare against (the flat weight layout they build on is engines/models/flat_weights.py)."""

from __future__ import annotations

import time

import torch


def sync_device(kind: str) -> torch.device:
    """The device a worker's weight sync runs on: its current GPU for 'cuda' (the worker set it when it
    started), the CPU otherwise (the nccl transport's gloo path: tests and CPU runs)."""
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


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
