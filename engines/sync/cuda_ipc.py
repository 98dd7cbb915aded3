"""The `cuda_ipc` transport, for colocated workers (train and rollout worker i share a GPU). No byte leaves the
GPU. Handles hold device pointers and offsets only (no code): a receiver rebuilds them with torch's own CUDA-IPC
reducer. Two ways, by how the trainer holds its weights:

- one unsharded train worker: it exports CUDA IPC handles of its parameters once; its rollout worker maps them
  once and, at every sync, copies them into its own weights with one multi-tensor copy (casting to its dtype on
  the way; one kernel when both sides are flat, engines/sync/gpu.py). Nothing travels per sync but the call.
- FSDP2 over several GPUs (`train.num_workers` > 1, verl's colocated layout: every GPU trains and generates):
  no rank holds whole weights, so the other way round: each rollout worker shares its own flat weight buffer
  with its GPU's train rank (`share_weights`: allocated again first if it was released, so the handle is new
  after every release), every rank gathers each weight over NCCL (cast to the rollout dtype first) straight
  into the mapped weights, and the rollout workers are told the version (`weights_written`). Three calls a
  sync, no staging copy, and no rank ever holds a whole weight it does not write. A GPU rank lets go of the
  mapping when it is done, so that a rollout worker that releases its weights gives the memory back.

The train backends' end is here too: `export_ipc_handles` (one rank) and `SharedWeightsWriter` (several).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from rlflow.engines.models.flat_weights import flat_span
from rlflow.engines.models.hf import DTYPES
from rlflow.engines.sync.base import NamedTensors, WeightTransport


class IpcSender(Protocol):
    """A train backend's side: `export_ipc_handles` of its parameters (one unsharded rank), or a
    `SharedWeightsWriter` (a sharded trainer)."""

    def cuda_ipc_handles(self) -> list[tuple[str, tuple]]: ...

    def write_weights_ipc(self, handle: tuple) -> int:
        """A sharded trainer: gather every weight (collective: every rank joins) straight into the colocated
        rollout worker's weights that `handle` maps (its `share_weights`); returns the bytes written, once they
        are there."""
        ...


class IpcReceiver(Protocol):
    def attach_ipc(self, handles: list[tuple[str, tuple]]) -> None: ...

    def update_weights_from_ipc(self, version: int) -> int: ...

    def share_weights(self) -> tuple:
        """A sharded colocated trainer writes the weights: allocate them if released and return the handle its
        GPU's train rank maps them through; generation is refused until `weights_written`."""
        ...

    def weights_written(self, version: int) -> int:
        """The trainer wrote every weight: serve them as `version`."""
        ...


def export_ipc_handles(named: NamedTensors) -> list[tuple[str, tuple]]:
    """(name, handle) per CUDA tensor: the arguments torch's CUDA-IPC reducer rebuilds a shared view from. The
    GPU's queued work is waited for first: the other process reads the tensors as they are in memory."""
    torch.cuda.synchronize()
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


# ---- a sharded trainer writes into its rollout worker's weights ----------------------------------------------
# where each weight a sync names lies in the rollout worker's flat buffer: (name, element offset, shape, stride);
# a view (a stacked MoE parameter's expert) is named like a weight
WeightLayout = list[tuple[str, int, tuple[int, ...], tuple[int, ...]]]
# (kind, where, elements, precision, layout): kind "cuda" with torch's IPC reducer arguments, or on the CPU (the
# tests' gloo ranks) "file" with a shared-memory file's path
SharedWeights = tuple
PRECISIONS = {dtype: name for name, dtype in DTYPES.items()}


def weight_layout(flat: torch.Tensor, targets: dict[str, torch.Tensor]) -> WeightLayout:
    """Where each of `targets` lies inside `flat` (they must all be views of it)."""
    size, out = flat.element_size(), []
    for name, t in targets.items():
        offset, rest = divmod(t.data_ptr() - flat.data_ptr(), size)
        last = offset + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        if rest or t.dtype != flat.dtype or offset < 0 or last >= flat.numel():
            raise ValueError(f"cuda_ipc: weight {name!r} is not inside the shared flat buffer")
        out.append((name, offset, tuple(t.shape), tuple(t.stride())))
    return out


def share_flat(flat: torch.Tensor, targets: dict[str, torch.Tensor], path: str | None = None) -> SharedWeights:
    """The handle of a rollout worker's flat weights: a CUDA IPC handle on a GPU; on the CPU `flat` must be the
    shared-memory file at `path` (torch.from_file(path, shared=True))."""
    layout, precision = weight_layout(flat, targets), PRECISIONS[flat.dtype]
    if flat.is_cuda:
        return "cuda", reduce_tensor(flat)[1], flat.numel(), precision, layout
    if path is None or flat.storage_offset() != 0:
        raise ValueError("cuda_ipc: a CPU weight buffer is shared as a whole shared-memory file; none was given")
    return "file", path, flat.numel(), precision, layout


def open_shared_weights(handle: SharedWeights, device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
    """Map a rollout worker's weights (`share_flat`'s handle): (name -> a view this process writes through, the
    elements of the whole buffer). A file is removed once mapped: both sides hold it then, nothing outlives them."""
    kind, where, numel, precision, layout = handle
    if kind == "cuda":
        flat = open_ipc_handles([("weights", where)], device)[0][1]
    elif kind == "file":
        if not os.path.exists(where):
            raise FileNotFoundError(f"cuda_ipc: the weights file {where} is gone (mapped twice, or its worker ended)")
        flat = torch.from_file(where, shared=True, size=numel, dtype=DTYPES[precision])
        os.unlink(where)
    else:
        raise ValueError(f"cuda_ipc: unknown weights handle kind {kind!r} (expected 'cuda' or 'file')")
    start = flat.storage_offset()  # the layout's offsets count from the buffer's first element
    return {name: flat.as_strided(shape, stride, start + offset) for name, offset, shape, stride in layout}, numel


class SharedWeightsWriter:
    """A sharded train rank's end of cuda_ipc; a train backend holds one and its write_weights_ipc calls it. It
    maps its GPU's rollout worker's weights (`share_weights`' handle), checks that both sides agree on every
    weight's shape, lets the rank gather into them, and waits until they are written. On a GPU the mapping is let
    go after each write: kept, it would hold the worker's memory through its release. A CPU file is mapped once
    (opening it removes it) and kept."""

    def __init__(self) -> None:
        self._mapped: tuple[tuple, dict[str, torch.Tensor], int] | None = None  # (handle key, views, elements)

    def write(self, handle: SharedWeights, device: torch.device, shapes: dict[str, torch.Tensor],
              gather_into: Callable[[dict[str, torch.Tensor]], None]) -> int:
        """Map `handle` on `device`, check that it holds every sent weight (`shapes`: each as a meta tensor) and
        nothing else, and run `gather_into(views)`: the rank's collective that writes every sent weight into its
        view. Returns the bytes written, once they are there."""
        key = handle[:2]
        if self._mapped is None or self._mapped[0] != key:
            self._mapped = key, *open_shared_weights(handle, device)
        _, targets, numel = self._mapped
        if handle[0] == "cuda":
            self._mapped = None
        missing = [n for n in shapes if n not in targets]
        if missing:
            raise KeyError(f"write_weights_ipc: the rollout worker has no weight {missing[:3]}")
        differ = [f"{n}: {tuple(s.shape)} here, {tuple(targets[n].shape)} there" for n, s in shapes.items()
                  if targets[n].shape != s.shape]
        written = sum(targets[n].numel() for n in shapes)
        if differ or written != numel:
            raise ValueError(f"write_weights_ipc: the trainer and the rollout worker disagree on the weights' shapes "
                             f"({differ[:3] or f'{written} elements sent, {numel} held there'})")
        gather_into(targets)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the rollout worker generates from them as soon as this returns
        return written * targets[next(iter(shapes))].element_size()


class CudaIpcTransport(WeightTransport):
    name = "cuda_ipc"
    sender, receiver = (IpcSender,), (IpcReceiver,)

    def connect(self) -> None:
        """Rollout worker i maps train worker i's parameters once (a sharded trainer maps the other way, at
        every push: the rollout weights are allocated again after each release)."""
        if not self.source.collective:
            handles = self.train.call(IpcSender.cuda_ipc_handles)
            self.rollout.call_each(IpcReceiver.attach_ipc, [(h,) for h in handles])

    def push(self, version: int) -> None:
        if not self.source.collective:
            self.rollout.call(IpcReceiver.update_weights_from_ipc, version)
            return
        handles = self.rollout.call(IpcReceiver.share_weights)  # rollout worker i <-> train rank i, one GPU
        self.train.call_each(IpcSender.write_weights_ipc, [(h,) for h in handles])
        self.rollout.call(IpcReceiver.weights_written, version)
