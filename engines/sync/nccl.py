"""The `nccl` transport, for disaggregated GPUs: train rank 0 and every rollout worker form a private NCCL group
(its own TCP store, so it never touches the trainer's data-parallel group; gloo when both sides are on the
CPU, so the same code runs in CPU tests and the GPU benchmark's smoke run). Weights go in buckets of the
driver's plan, so both ends agree on it: rank 0 packs a bucket into a flat buffer in the rollout dtype and
broadcasts it; receivers unpack it into their weights (or receive straight into them when they are flat,
engines/sync/gpu.py). Two buffers alternate, so packing bucket i+1 overlaps the broadcast of bucket i.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from rlflow.engines.models.flat_weights import flat_span, views_of
from rlflow.engines.sync.base import WeightTransport


class NcclSender(Protocol):
    """Train rank 0's side: it serves the channel's rendezvous (`base.free_rendezvous_address`), joins as its rank 0
    and sends its whole weights (`NcclChannel.send`)."""

    def rendezvous_address(self) -> tuple[str, int]: ...

    def nccl_connect(self, host: str, port: int, world_size: int, rollout_precision: str) -> None: ...

    def nccl_send(self, buckets: list[list[str]]) -> int: ...


class NcclReceiver(Protocol):
    def nccl_connect(self, host: str, port: int, rank: int, world_size: int) -> None: ...

    def update_weights_from_nccl(self, buckets: list[list[str]], version: int) -> int: ...


class NcclChannel:
    """A private NCCL group (gloo on the CPU): rank 0 is the train worker that sends, ranks 1.. are rollout
    workers."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device, timeout_s: float = 300):
        self.rank, self.world_size, self.device = rank, world_size, device
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        prefixed = dist.PrefixStore("rlflow-weight-sync", store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=timeout_s))
        self._buffers: list[torch.Tensor] = []
        self.broadcast(torch.zeros(1, device=device)).wait()  # connect now, not inside the first timed sync
        self._synchronize()

    def _synchronize(self) -> None:
        """Wait for this device's queued work (nothing to wait for on the CPU: gloo's wait() is the end)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
                views = views_of(flat, tensors)
                if sending:
                    torch._foreach_copy_(views, tensors)
            work = self.broadcast(flat)
            pending[slot] = (work, None if sending else (tensors, views))
            total += flat.numel() * flat.element_size()
        for p in pending:
            if p is not None:
                self._finish(*p)
        self._synchronize()
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
        self._synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            self.broadcast(buf).wait()
        self._synchronize()
        return nbytes * repeats / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self._buffers.clear()


class NcclTransport(WeightTransport):
    name = "nccl"
    sender, receiver = (NcclSender,), (NcclReceiver,)

    def connect(self) -> None:
        """Train rank 0 (rank 0 of a private group) and every rollout worker (ranks 1..) rendezvous."""
        host, port = self.train.call_rank0(NcclSender.rendezvous_address)
        n = len(self.rollout)
        world = 1 + n
        sender = self.train.submit_rank0(NcclSender.nccl_connect, host, port, world, self.cfg.rollout.precision)
        self.rollout.call_each(NcclReceiver.nccl_connect, [(host, port, 1 + i, world) for i in range(n)])
        self.train.wait([sender])

    def push(self, version: int) -> None:
        buckets = self.source.buckets()
        send = self.train.submit_rank0(NcclSender.nccl_send, buckets)
        self.rollout.call(NcclReceiver.update_weights_from_nccl, buckets, version)
        self.train.wait([send])
