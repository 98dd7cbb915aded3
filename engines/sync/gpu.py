"""GPU weight-sync transports: CUDA IPC for colocated workers, an NCCL broadcast for disaggregated ones.

Both keep weights on the GPU from the trainer's parameters to the rollout engine's, with no host copy:

- cuda_ipc: train and rollout workers share a GPU. Each train worker exports CUDA IPC handles of its
  parameters once; its colocated rollout worker maps them once and, at every sync, copies them into its
  own weights with one multi-tensor copy (casting to its dtype on the way). Nothing travels per sync
  but the call itself. Handles hold device pointers and offsets only (no code): a receiver rebuilds them
  with torch's own CUDA-IPC reducer.
- nccl: train rank 0 and every rollout worker form a private NCCL group (its own TCP store, so it never
  touches the trainer's data-parallel group). Weights go in buckets: rank 0 packs a bucket into a flat
  buffer in the rollout dtype and broadcasts it; receivers unpack it into their weights. Two buffers
  alternate, so packing bucket i+1 overlaps the broadcast of bucket i.

The bucket plan (names per bucket) comes from the driver, so both ends agree on it.

On GPU both engines keep their weights in one flat buffer (`flatten_`), in HF-name order. A run of
consecutive weights is then one slice of memory (`flat_span`), so a colocated sync is a single cast-copy
kernel, the sender packs a bucket with one kernel, and a receiver broadcasts straight into its weights
with nothing to unpack. Weights that are not laid out that way take the per-tensor path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

NamedTensors = list[tuple[str, torch.Tensor]]


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


# ---- CUDA IPC ------------------------------------------------------------------------------------------
def export_ipc_handles(named: NamedTensors) -> list[tuple[str, tuple]]:
    """(name, handle) per CUDA tensor: the arguments torch's CUDA-IPC reducer rebuilds a shared view from."""
    out = []
    for name, t in named:
        if not t.is_cuda:
            raise ValueError(f"cuda_ipc: weight {name!r} is on {t.device}, not on a GPU")
        _rebuild, args = reduce_tensor(t.detach())
        out.append((name, args))
    return out


def open_ipc_handles(handles: list[tuple[str, tuple]], device: torch.device) -> NamedTensors:
    """Map another process's CUDA tensors into this one (same physical GPU). The mapping lives as long as
    the returned tensors do; the exporter must keep its tensors alive (a model's parameters are)."""
    out = []
    for name, args in handles:
        args = list(args)
        args[6] = device.index if device.index is not None else torch.cuda.current_device()  # storage_device
        out.append((name, rebuild_cuda_tensor(*args)))
    return out


def copy_plan(dst: dict[str, torch.Tensor], src: NamedTensors) -> Callable[[], None]:
    """A function that copies src tensors into the same-named dst tensors (cast to dst's dtype). Planned
    once (the colocated pair maps each other's weights once): when both sides are flat in the same order
    it is one copy kernel for the whole model, otherwise one multi-tensor copy."""
    missing = [n for n, _ in src if n not in dst]
    if missing:
        raise KeyError(f"weight sync: unknown parameter(s) {missing[:3]}")
    targets = [dst[n] for n, _ in src]
    sources = [t for _, t in src]
    dst_span, src_span = flat_span(targets), flat_span(sources)
    if dst_span is not None and src_span is not None and dst_span.numel() == src_span.numel():
        return torch.no_grad()(lambda: dst_span.copy_(src_span))
    return torch.no_grad()(lambda: torch._foreach_copy_(targets, sources))


# ---- NCCL broadcast ------------------------------------------------------------------------------------
class NcclChannel:
    """A private NCCL group: rank 0 is the train worker that sends, ranks 1.. are rollout workers."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device, timeout_s: float = 300):
        torch.cuda.set_device(device)
        self.rank, self.world_size, self.device = rank, world_size, device
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        self.group = dist.ProcessGroupNCCL(dist.PrefixStore("rlflow-weight-sync", store), rank, world_size)
        self._buffers: list[torch.Tensor] = []
        self.broadcast(torch.zeros(1, device=device))  # connect now, not inside the first timed sync
        torch.cuda.synchronize(device)

    def broadcast(self, tensor: torch.Tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.group.broadcast([tensor], opts)

    def _buffer(self, i: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        while len(self._buffers) <= i:
            self._buffers.append(torch.empty(0, dtype=dtype, device=self.device))
        if self._buffers[i].numel() < numel or self._buffers[i].dtype != dtype:
            self._buffers[i] = torch.empty(numel, dtype=dtype, device=self.device)
        return self._buffers[i][:numel]

    @torch.no_grad()
    def send(self, params: dict[str, torch.Tensor], buckets: list[list[str]], dtype: torch.dtype) -> int:
        """Rank 0: broadcast `params` bucket by bucket as `dtype`; returns bytes sent."""
        return self._run(params, buckets, dtype, sending=True)

    @torch.no_grad()
    def receive(self, params: dict[str, torch.Tensor], buckets: list[list[str]]) -> int:
        """Ranks 1..: receive every bucket into `params` (same names and shapes as the sender's)."""
        dtypes = {p.dtype for p in params.values()}
        if len(dtypes) != 1:
            raise ValueError(f"nccl weight sync: rollout weights must share one dtype, found {dtypes}")
        return self._run(params, buckets, dtypes.pop(), sending=False)

    def _run(self, params: dict[str, torch.Tensor], buckets: list[list[str]], dtype: torch.dtype, sending: bool) -> int:
        pending: list = [None, None]  # per buffer: (work, views to unpack) of the broadcast using it
        total = 0
        for i, names in enumerate(buckets):
            slot = i % 2
            if pending[slot] is not None:  # this buffer's previous broadcast must finish before reuse
                self._finish(*pending[slot])
            tensors = [params[n] for n in names]
            span = flat_span(tensors)
            if span is not None and span.dtype == dtype:  # the bucket is one slice already: send or fill it
                work = self.broadcast(span)
                pending[slot] = (work, None)
                total += span.numel() * span.element_size()
                continue
            flat = self._buffer(slot, sum(t.numel() for t in tensors), dtype)
            views = None
            if sending and span is not None:
                flat.copy_(span)  # one cast kernel for the bucket
            else:
                views = list(torch.split(flat, [t.numel() for t in tensors]))
                views = [v.view(t.shape) for v, t in zip(views, tensors, strict=True)]
                if sending:
                    torch._foreach_copy_(views, tensors)
            work = self.broadcast(flat)
            pending[slot] = (work, None if sending else (tensors, views))
            total += flat.numel() * flat.element_size()
        for p in pending:
            if p is not None:
                self._finish(*p)
        torch.cuda.synchronize(self.device)
        return total

    @staticmethod
    def _finish(work, unpack) -> None:
        work.wait()  # the current stream waits for the broadcast (the host does not)
        if unpack is not None:
            torch._foreach_copy_(*unpack)

    @torch.no_grad()
    def measure_bandwidth(self, nbytes: int, repeats: int = 5) -> float:
        """GB/s of a plain broadcast of `nbytes` over this group: the link speed a bucketed sync compares to."""
        buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=self.device)
        self.broadcast(buf).wait()
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            self.broadcast(buf).wait()
        torch.cuda.synchronize(self.device)
        return nbytes * repeats / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self._buffers.clear()


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
