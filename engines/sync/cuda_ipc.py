"""The `cuda_ipc` transport, for colocated workers (train and rollout worker i share a GPU): each train worker
exports CUDA IPC handles of its parameters once; its rollout worker maps them once and, at every sync, copies
them into its own weights with one multi-tensor copy (casting to its dtype on the way; one kernel when both
sides are flat, engines/sync/gpu.py). Nothing travels per sync but the call itself, and no byte leaves the GPU.
Handles hold device pointers and offsets only (no code): a receiver rebuilds them with torch's own CUDA-IPC
reducer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from rlflow.engines.models.flat_weights import flat_span
from rlflow.engines.sync.base import NamedTensors, WeightTransport
from rlflow.engines.sync.endpoints import IpcReceiver, IpcSender


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


class CudaIpcTransport(WeightTransport):
    name = "cuda_ipc"
    sender, receiver = (IpcSender,), (IpcReceiver,)

    def connect(self) -> None:
        """Rollout worker i maps train worker i's parameters (the pair shares a GPU), once."""
        handles = self.train.call(IpcSender.cuda_ipc_handles)
        self.rollout.call_each(IpcReceiver.attach_ipc, [(h,) for h in handles])

    def push(self, version: int) -> None:
        self.rollout.call(IpcReceiver.update_weights_from_ipc, version)
