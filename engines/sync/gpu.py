"""Flat weights, what both GPU transports (cuda_ipc.py, nccl.py) build on, and the copy-bandwidth probe
their benchmarks compare against.

On GPU both engines keep their weights in one flat buffer (`flatten_`), in HF-name order. A run of
consecutive weights is then one slice of memory (`flat_span`), so a colocated sync is a single cast-copy
kernel, the sender packs a bucket with one kernel, and a receiver broadcasts straight into its weights
with nothing to unpack. Weights that are not laid out that way take the per-tensor path.
"""

from __future__ import annotations

import time

import torch


# ---- flat weights --------------------------------------------------------------------------------------
@torch.no_grad()
def flatten_(params: dict[str, torch.Tensor], shapes: dict[str, torch.Size] | None = None) -> torch.Tensor:
    """Move every tensor of `params` (one dtype, one device) into one contiguous buffer, in dict order, and
    return the buffer. Each tensor (an nn.Parameter stays the same object) becomes a view into it, so an
    optimizer or a tied weight still refers to the right memory. With `shapes`, only allocate tensors of
    those shapes (contents undefined): what re-allocating released weights needs."""
    dtypes, devices = {t.dtype for t in params.values()}, {t.device for t in params.values()}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(f"flatten_: weights must share one dtype and device, found {dtypes} on {devices}")
    shape_of = shapes or {n: t.shape for n, t in params.items()}
    flat = torch.empty(sum(shape_of[n].numel() for n in params), dtype=dtypes.pop(), device=devices.pop())
    offset = 0
    for name, t in params.items():
        numel = shape_of[name].numel()
        view = flat[offset : offset + numel].view(shape_of[name])
        if shapes is None:
            view.copy_(t.data)
        t.data = view
        offset += numel
    return flat


def flat_span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D slice of memory that `tensors` fill when they are consecutive contiguous tensors of one dtype
    inside the first one's storage, in this order (as `flatten_` lays them out); None otherwise. Only
    pointers are compared, so it costs about a microsecond a tensor."""
    first = tensors[0]
    size, start = first.element_size(), first.data_ptr()
    ptr = start
    for t in tensors:
        if t.dtype != first.dtype or t.data_ptr() != ptr or not t.is_contiguous():
            return None
        ptr += t.numel() * size
    numel = (ptr - start) // size
    if first.storage_offset() + numel > first.untyped_storage().nbytes() // size:
        return None  # adjacent by chance, but not one allocation
    return first.detach().as_strided((numel,), (1,), first.storage_offset())


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
