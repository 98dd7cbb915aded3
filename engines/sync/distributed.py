"""SGLang's distributed weight update, in one place: the group (joined as SGLang joins it), the request bodies
the embedded server's routes and the SGLang backend share, the protocols of both sides, the trainer's end
(`DistributedWeightSender`, which the train backends hold) and the driver's `distributed` transport
(`DistributedTransport`). It is how real SGLang servers take weights without a disk hop and without pickle; the
embedded engine's server speaks it too.

SGLang's pair of routes, with its field names and meanings:

- `POST /init_weights_update_group` {master_address, master_port, rank_offset, world_size, group_name,
  backend}: the server joins a process group of its own (not its tensor-parallel one) as rank
  `rank_offset` (SGLang: rank_offset + its TP rank); the trainer's sending rank is rank 0 and serves the
  rendezvous (a TCP store on master_address:master_port). The call returns once every rank has joined, so
  the trainer joins at the same time (`join_weights_update_group`).
- `POST /update_weights_from_distributed` {names, dtypes, shapes, group_name, weight_version,
  abort_all_requests, flush_cache}: the server receives one broadcast from rank 0 per name, in order, of
  that dtype ("bfloat16", "float32", ...) and shape, and loads them (HF names). The trainer broadcasts at
  the same time (`broadcast_weights`).
- `POST /destroy_weights_update_group` {group_name}.

The group is built the way SGLang builds it (a `tcp://` rendezvous, the store prefixed with the group name,
torch's own process-group constructor), so the trainer's side here also pairs with a real SGLang server of
the same torch version. Backend "gloo" moves CPU tensors (the embedded server on CPU, and the CPU tests);
"nccl" GPU tensors. Nothing is pickled: only tensors travel over the group, names and shapes as JSON.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable
from datetime import timedelta
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from rlflow.engines.models.hf import ROLLOUT_DTYPES
from rlflow.engines.sync.base import NamedTensors, WeightTransport, together

GROUP_NAME = "weight_update_group"  # SGLang's default
INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
UPDATE_FIELDS = {
    "names",
    "dtypes",
    "shapes",
    "group_name",
    "weight_version",
    "abort_all_requests",
    "flush_cache",
    "load_format",
}


class DistributedSender(Protocol):
    """The trainer's side: a train backend's methods that call its `DistributedWeightSender` (rendezvous_address:
    `base.free_rendezvous_address`)."""

    def rendezvous_address(self) -> tuple[str, int]: ...

    def join_weights_update_group(self, master_address: str, master_port: int, world_size: int,
                                  group_name: str = ..., backend: str = "gloo") -> None: ...

    def leave_weights_update_group(self) -> None: ...

    def broadcast_weights_update(self, names: list[str], dtype: str) -> int: ...


class DistributedReceiver(Protocol):
    """A rollout worker's side: SGLang's /init_weights_update_group and /update_weights_from_distributed."""

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = ..., backend: str = ...) -> None: ...

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        version: int, group_name: str = ...) -> int: ...

    def destroy_weights_update_group(self, group_name: str = ...) -> None: ...

    def weight_update_ranks(self) -> int:
        """Ranks this server joins a weight-update group with (SGLang: one per tensor-parallel rank)."""
        ...

    def weight_dtype(self) -> str:
        """The dtype ("bfloat16", ...) the server holds its weights in: what the trainer broadcasts."""
        ...


def join_weights_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 300,
) -> dist.ProcessGroup:
    """Join (rank 0: create and serve the rendezvous of) a weight-update process group, as SGLang does. It is
    separate from any default process group of this process, which it neither needs nor touches."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    options = (
        "backend_options"
        if "backend_options" in inspect.signature(_new_process_group_helper).parameters
        else "pg_options"
    )
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
        **{options: None},
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_weights(group: dist.ProcessGroup, tensors: Iterable[torch.Tensor]) -> int:
    """Rank 0 (the trainer): broadcast each tensor in order (what /update_weights_from_distributed receives;
    each as it is: its dtype and shape are the ones named in that request). Returns the bytes sent."""
    works, total = [], 0
    for t in tensors:
        t = t.detach().contiguous()
        works.append(dist.broadcast(t, src=0, group=group, async_op=True))
        total += t.numel() * t.element_size()
    for w in works:
        w.wait()
    return total


def destroy_weights_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def init_request(master_address: str, master_port: int, rank_offset: int, world_size: int,
                 group_name: str = GROUP_NAME, backend: str = "nccl") -> dict:
    """The body of /init_weights_update_group."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def update_request(names: list[str], dtypes: list[str], shapes: list[list[int]], version: int,
                   group_name: str = GROUP_NAME) -> dict:
    """The body of /update_weights_from_distributed for one bucket (SGLang takes weight_version as a string).
    flush_cache false: SGLang's default flushes after every bucket; the receiver flushes once per update instead
    (end_weight_update)."""
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "weight_version": str(version), "flush_cache": False}


# a train backend's `named_tensors(names, dtype, device)`: HF-named full weights at rank 0, [] on other ranks
# (collective where the weights are sharded)
Gather = Callable[[list[str], torch.dtype, torch.device | str], NamedTensors]


class DistributedWeightSender:
    """A train rank's end of the `distributed` transport; a train backend holds one and its DistributedSender
    methods call it. Rank 0 is rank 0 of the weight-update group and serves its rendezvous; the rollout servers
    join as 1..N through /init_weights_update_group, and receive what it broadcasts through
    /update_weights_from_distributed. The other train ranks join no group: they only take part in the gathers."""

    def __init__(self, rank: int):
        self.rank = rank
        self.group: dist.ProcessGroup | None = None
        self.device: torch.device | str = "cpu"  # where rank 0 gathers what it broadcasts: its GPU for NCCL

    def join(self, master_address: str, master_port: int, world_size: int, group_name: str = GROUP_NAME,
             backend: str = "gloo") -> None:
        """Rank 0 joins (serving the rendezvous); other ranks have nothing to join."""
        if self.rank != 0:
            return
        if self.group is not None:
            raise RuntimeError("join_weights_update_group: leave the current group first (all members together)")
        self.group = join_weights_update_group(master_address, master_port, 0, world_size, group_name, backend)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"

    def leave(self) -> None:
        """Destroy this worker's side of the group, while the servers destroy theirs."""
        if self.group is not None:
            destroy_weights_update_group(self.group)
            self.group = None

    def broadcast(self, gather: Gather, names: list[str], dtype: str) -> int:
        """Gather these weights with the backend's `gather` (every rank joins) and broadcast them in order, as
        `dtype` (what the receivers were told; an LM's weights are all floating point); returns the bytes sent (0
        on other ranks)."""
        # gathered straight onto the GPU that broadcasts (NCCL), in the dtype the servers were told
        tensors = [t for _, t in gather(names, getattr(torch, dtype), self.device)]
        if self.rank != 0:
            return 0
        if self.group is None:
            raise RuntimeError("broadcast_weights_update: join_weights_update_group first")
        return broadcast_weights(self.group, tensors)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the `dtypes` field names it ("float32", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def dtype_names(tensors: Iterable[torch.Tensor]) -> list[str]:
    """The `dtypes` field for these tensors."""
    return [dtype_name(t.dtype) for t in tensors]


class DistributedTransport(WeightTransport):
    """The driver's side: every rollout server (ranks from 1; a server of several tensor-parallel ranks takes
    that many) joins a weight-update group with train rank 0 (rank 0, serving the rendezvous) once, again after
    a worker restart; each bucket's broadcast and every server's /update_weights_from_distributed then run
    together, every weight in the dtype the servers hold it in (gloo for CPU engines, NCCL on GPUs)."""

    name = "distributed"
    sender, receiver = (DistributedSender,), (DistributedReceiver,)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group: str | None = None  # the weight-update group's name, while joined
        self._joins = 0
        self.backend = "nccl" if self.cfg.rollout_device == "cuda" else "gloo"
        self.dtype = dtype_name(ROLLOUT_DTYPES[self.cfg.rollout.precision])  # until connect asks the servers

    def connect(self) -> None:
        """Join a new group, leaving the previous one first (after a worker restart)."""
        self._leave()
        self.dtype = self.servers_dtype()
        ranks = self.rollout.call(DistributedReceiver.weight_update_ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        world = 1 + sum(ranks)
        host, port = self.train.call_rank0(DistributedSender.rendezvous_address)
        name = f"rlflow-weights-{self.cfg.name}-{self._joins}"
        together(partial(self.train.call, DistributedSender.join_weights_update_group, host, port, world, name,
                         self.backend),
                 *[partial(self.rollout.call_one, i, DistributedReceiver.init_weights_update_group, host, port,
                           offsets[i], world, name, self.backend) for i in range(len(self.rollout))])
        self.group, self._joins = name, self._joins + 1

    def servers_dtype(self) -> str:
        """The one dtype every server holds its weights in (SGLang's --dtype, resolved; the embedded engine's
        rollout.precision). A broadcast carries one dtype to all of them, so servers that differ are refused."""
        dtypes = sorted(set(self.rollout.call(DistributedReceiver.weight_dtype)))
        if len(dtypes) != 1:
            raise ValueError(f"weight_sync.transport distributed: the rollout servers hold their weights in different "
                             f"dtypes {dtypes}; give every server the same dtype")
        return dtypes[0]

    def push(self, version: int) -> None:
        shapes, dtype, broadcast = self.source.shapes(), self.dtype, DistributedSender.broadcast_weights_update
        receive = DistributedReceiver.update_weights_from_distributed
        for names in self.source.buckets():
            meta = (names, [dtype] * len(names), [shapes[n] for n in names], version, self.group)
            together(partial(self.source.call, broadcast, names, dtype),
                     *[partial(self.rollout.call_one, i, receive, *meta) for i in range(len(self.rollout))])

    def close(self) -> None:
        self._leave()
        super().close()

    def _leave(self) -> None:
        """The trainer and the servers that still have the group leave it at the same time (with NCCL, a member
        that destroys the group alone waits for the others: measured on 2 GPUs, docs/benchmarks.md)."""
        if self.group is None:
            return
        previous = self.group

        def leave(i: int) -> None:
            with contextlib.suppress(Exception):  # a restarted worker's fresh server never joined it
                self.rollout.call_one(i, DistributedReceiver.destroy_weights_update_group, previous)

        together(partial(self.train.call, DistributedSender.leave_weights_update_group),
                 *[partial(leave, i) for i in range(len(self.rollout))])
        self.group = None
