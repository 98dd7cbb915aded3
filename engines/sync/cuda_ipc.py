"""The `cuda_ipc` transport, for colocated workers (train and rollout worker i share a GPU). No byte leaves the
GPU. Handles hold device pointers and offsets only (no code): a receiver rebuilds them with torch's own CUDA-IPC
reducer. Two ways, by how the trainer holds its weights:

- one unsharded train worker: it exports CUDA IPC handles of its parameters once; its rollout worker maps them
  once and, at every sync, copies them into its own weights with one multi-tensor copy (casting to its dtype on
  the way; one kernel when both sides are flat, engines/sync/gpu.py). Nothing travels per sync but the call.
- FSDP2 over several GPUs (`train.num_workers` > 1, verl's colocated layout: every GPU trains and generates):
  no rank holds whole weights, so each rank shares one *staging buffer* with its rollout worker, once. Per bucket,
  every rank gathers the bucket's weights (an all-gather, cast to the rollout dtype before it) into its staging
  buffer, then every rollout worker copies the bucket out of its own. The buffer (one bucket) is kept for the run,
  and a sync holds about two buckets per GPU (the gathered one beside it); the full model is never held by a rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from rlflow.engines.models.flat_weights import flat_span, views_of
from rlflow.engines.models.hf import DTYPES
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


def named_targets(dst: dict[str, torch.Tensor], names: list[str]) -> list[torch.Tensor]:
    """The receiver's tensors for the sent names, in their order; an unknown name fails, naming it."""
    unknown = [n for n in names if n not in dst]
    if unknown:
        raise KeyError(f"weight sync: unknown parameter(s) {unknown[:3]}")
    return [dst[n] for n in names]


def copy_plan(dst: dict[str, torch.Tensor], src: NamedTensors) -> Callable[[], None]:
    """A function that copies src tensors into the same-named dst tensors (cast to dst's dtype). Planned
    once (the colocated pair maps each other's weights once): when both sides are flat in the same order
    it is one copy kernel for the whole model, otherwise one multi-tensor copy."""
    targets = named_targets(dst, [n for n, _ in src])
    sources = [t for _, t in src]
    dst_span, src_span = flat_span(targets), flat_span(sources)
    if dst_span is not None and src_span is not None and dst_span.numel() == src_span.numel():
        return torch.no_grad()(lambda: dst_span.copy_(src_span))
    return torch.no_grad()(lambda: torch._foreach_copy_(targets, sources))


# ---- the staging buffer of a sharded trainer ----------------------------------------------------------------
StagingHandle = tuple  # ("cuda", torch's IPC reducer arguments) or ("file", path, numel, precision)


def allocate_staging(numel: int, precision: str, device: torch.device, path: str,
                     current: torch.Tensor | None = None) -> tuple[torch.Tensor, StagingHandle]:
    """A flat buffer of `numel` elements in `precision` ("bf16", "fp32") that the colocated rollout worker maps, and
    its handle. On a GPU through CUDA IPC; on the CPU (the tests' gloo ranks) a shared-memory file at `path`, which
    the other process maps the same way. A GPU buffer `current` of that size is shared again rather than replaced
    (a reconnect after a rollout worker restart): torch keeps a freed buffer that another process mapped until that
    process lets go, which a killed worker never does."""
    dtype = DTYPES[precision]
    if device.type == "cuda":
        fits = current is not None and current.is_cuda and current.numel() == numel and current.dtype == dtype
        buf = current if fits else torch.empty(numel, dtype=dtype, device=device)
        return buf, ("cuda", reduce_tensor(buf)[1])
    buf = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    return buf, ("file", path, numel, precision)


def open_staging(handle: StagingHandle, device: torch.device) -> torch.Tensor:
    """Map a colocated trainer's staging buffer (`allocate_staging`'s handle)."""
    kind = handle[0]
    if kind == "cuda":
        return open_ipc_handles([("staging", handle[1])], device)[0][1]
    if kind == "file":
        _, path, numel, precision = handle
        if not os.path.exists(path):
            raise FileNotFoundError(f"cuda_ipc: the staging file {path} is gone (mapped twice, or its trainer ended)")
        buf = torch.from_file(path, shared=True, size=numel, dtype=DTYPES[precision])
        os.unlink(path)  # both sides have it mapped: no file outlives them
        return buf
    raise ValueError(f"cuda_ipc: unknown staging handle kind {kind!r} (expected 'cuda' or 'file')")


@torch.no_grad()
def pack(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> int:
    """Write tensors one after the other from the buffer's start (cast to its dtype); returns elements written."""
    sizes = [t.numel() for t in tensors]
    if sum(sizes) > buffer.numel():
        raise ValueError(f"cuda_ipc: a bucket of {sum(sizes)} elements does not fit the staging buffer of "
                         f"{buffer.numel()} (weight_sync.bucket_mb changed after the link was made?)")
    if tensors:
        torch._foreach_copy_(views_of(buffer, tensors), tensors)
    return sum(sizes)


def unpack_plan(buffer: torch.Tensor, targets: dict[str, torch.Tensor], names: list[str],
                numel: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(destinations, sources): the named targets and their views of a packed buffer, checked against the sender's
    element count so that a layout mismatch fails instead of loading shifted weights."""
    dst = named_targets(targets, names)
    held = sum(t.numel() for t in dst)
    if held != numel:
        raise ValueError(f"cuda_ipc: the trainer staged {numel} elements for {len(names)} weights, which hold "
                         f"{held} here: the two sides disagree on the weights' shapes")
    return dst, views_of(buffer, dst)


class CudaIpcTransport(WeightTransport):
    name = "cuda_ipc"
    sender, receiver = (IpcSender,), (IpcReceiver,)

    def connect(self) -> None:
        """Rollout worker i maps train worker i's parameters, or (sharded trainer) its staging buffer, once."""
        if self.source.collective:
            shapes = self.source.shapes()
            numel = max(sum(math.prod(shapes[n]) for n in names) for names in self.source.buckets())
            handles = self.train.call(IpcSender.cuda_ipc_staging, numel, self.cfg.rollout.precision)
            self.rollout.call_each(IpcReceiver.attach_ipc_staging, [(h,) for h in handles])
            return
        handles = self.train.call(IpcSender.cuda_ipc_handles)
        self.rollout.call_each(IpcReceiver.attach_ipc, [(h,) for h in handles])

    def push(self, version: int) -> None:
        if not self.source.collective:
            self.rollout.call(IpcReceiver.update_weights_from_ipc, version)
            return
        for names in self.source.buckets():  # each side waits for the other: one staging buffer per GPU
            staged = self.train.call(IpcSender.stage_weights, names)
            self.rollout.call_each(IpcReceiver.update_weights_from_staging,
                                   [(names, numel, version) for numel in staged])
