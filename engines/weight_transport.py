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
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

NamedTensors = list[tuple[str, torch.Tensor]]


# ---- CUDA IPC ------------------------------------------------------------------------------------------
def export_ipc_handles(named: NamedTensors) -> list[tuple[str, tuple]]:
    """(name, handle) per CUDA tensor: the arguments torch's CUDA-IPC reducer rebuilds a shared view from."""
    from torch.multiprocessing.reductions import reduce_tensor

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
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    out = []
    for name, args in handles:
        args = list(args)
        args[6] = device.index if device.index is not None else torch.cuda.current_device()  # storage_device
        out.append((name, rebuild_cuda_tensor(*args)))
    return out


@torch.no_grad()
def copy_named(dst: dict[str, torch.Tensor], src: NamedTensors) -> int:
    """Copy src tensors into the same-named dst tensors (cast to dst's dtype); returns bytes written."""
    missing = [n for n, _ in src if n not in dst]
    if missing:
        raise KeyError(f"weight sync: unknown parameter(s) {missing[:3]}")
    targets = [dst[n] for n, _ in src]
    sources = [t for _, t in src]
    torch._foreach_copy_(targets, sources)
    return sum(t.numel() * t.element_size() for t in targets)


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
            numel = sum(t.numel() for t in tensors)
            flat = self._buffer(slot, numel, dtype)
            views = list(torch.split(flat, [t.numel() for t in tensors]))
            views = [v.view(t.shape) for v, t in zip(views, tensors, strict=True)]
            if sending:
                torch._foreach_copy_(views, tensors)
            work = self.broadcast(flat)
            pending[slot] = (work, None if sending else (tensors, views))
            total += numel * flat.element_size()
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
