"""What every weight transport shares: the train side as the driver sees it, a `WeightSource` (its weight
layout, the bucket plan, the rank-0-or-collective call), the `WeightTransport` base class a transport subclasses,
`together` for collectives driven from one thread, and `free_rendezvous_address` for the groups train rank 0
serves. Transports live one per module beside this one, each with the protocols it calls on either side and the
code of the train backends' end; the registry that names them by `weight_sync.transport` is
engines/sync/transports.py.

A weight update sends HF-named tensors, bucket by bucket, stamped with a weight version so each generated
sample records which policy produced it. Buckets bound the memory a transfer holds at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from rlflow.engines.cluster.addresses import free_port, node_ip
from rlflow.engines.core.config import RLConfig
from rlflow.engines.core.protocols import RolloutBackend, TrainBackend, WorkerGroup
from rlflow.engines.models.flat_weights import fusable_order

NamedTensors = list[tuple[str, torch.Tensor]]


def plan_buckets(layout: list[tuple[str, int]], bucket_bytes: int) -> Iterator[list[str]]:
    """Group weight names into buckets of at most `bucket_bytes` (a single larger tensor gets its own)."""
    bucket, size = [], 0
    for name, nbytes in layout:
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(name)
        size += nbytes
    if bucket:
        yield bucket


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run blocking calls at the same time and return their results in order: the members of a collective each
    return only once all have joined, so they need threads, with in-process workers as with Ray actors. The
    first error is raised at once (the others end with the group's timeout). The threads are daemons: a member
    left waiting in a collective whose peer died (a lost GPU) must not keep the process from exiting."""
    results: list[Any] = [None] * len(calls)
    finished: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            results[i] = call()
            finished.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            finished.put(exc)

    for i, call in enumerate(calls):
        threading.Thread(target=run, args=(i, call), name=f"weight-sync-{i}", daemon=True).start()
    for _ in calls:
        if (exc := finished.get()) is not None:
            raise exc
    return results


def free_rendezvous_address() -> tuple[str, int]:
    """Host and free port for a weight-sync group's TCP store, which the train worker that asks (rank 0 of the
    group: nccl, distributed) serves."""
    return node_ip(), free_port()


def sharded_trainer(cfg: RLConfig) -> bool:
    """Megatron and FSDP2 over several ranks shard the weights: exporting them is a collective every train rank
    joins, and no rank holds them whole."""
    return cfg.train.backend == "megatron" or cfg.train.num_workers > 1


class WeightSource:
    """The train side of a sync as every transport sees it. Rank 0 sends: with one train rank it holds the full
    weights; with sharded weights (Megatron, FSDP2 over several ranks: `collective`) every rank joins the
    gather and rank 0 holds the result. The weight layout and the bucket plan are asked for once and kept (a
    released colocated rollout engine re-allocates its weights inside the update call, so the plan must not
    change)."""

    def __init__(self, train: WorkerGroup[TrainBackend], bucket_bytes: int, collective: bool = False):
        self.train, self.bucket_bytes, self.collective = train, bucket_bytes, collective
        self._layout: list[tuple[str, int]] | None = None
        self._buckets: list[list[str]] | None = None
        self._shapes: dict[str, list[int]] | None = None

    @classmethod
    def from_config(cls, cfg: RLConfig, train: WorkerGroup[TrainBackend]) -> WeightSource:
        return cls(train, int(cfg.weight_sync.bucket_mb * 1024 * 1024), collective=sharded_trainer(cfg))

    def layout(self) -> list[tuple[str, int]]:
        """(HF name, bytes) of every weight, in the flat order of the rollout engine's weights (HF's order with
        each layer's q/k/v and gate/up consecutive: engines/models/flat_weights.py), so that a bucket is one
        slice of the receiver's memory."""
        if self._layout is None:
            nbytes = dict(self.train.call_rank0(TrainBackend.weight_layout))
            self._layout = [(n, nbytes[n]) for n in fusable_order(list(nbytes))]
        return self._layout

    def buckets(self) -> list[list[str]]:
        """Names per bucket, planned once per run."""
        if self._buckets is None:
            self._buckets = list(plan_buckets(self.layout(), self.bucket_bytes))
        return self._buckets

    def shapes(self) -> dict[str, list[int]]:
        if self._shapes is None:
            self._shapes = self.train.call_rank0(TrainBackend.weight_shapes)
        return self._shapes

    def call(self, method: Callable[..., Any], *args: Any) -> Any:
        """Rank 0's `method(*args)`; with sharded weights every rank joins (it gathers collectively)."""
        if not self.collective:
            return self.train.call_rank0(method, *args)
        return self.train.wait(self.train.submit(method, *args))[0]

    def send_objects(self, rollout: WorkerGroup[RolloutBackend], names: list[str] | None, version: int) -> None:
        """Rank 0's HF-named tensors (`names`, or all) to every rollout worker's `update_weights`, actor to actor
        as one Ray object (in-process groups hand the list over)."""
        if not self.collective:
            weights = self.train.submit_rank0(TrainBackend.named_tensors, names)
            rollout.call(RolloutBackend.update_weights, weights, version)
            return
        handles = self.train.submit(TrainBackend.named_tensors, names)  # every rank joins the gather
        rollout.call(RolloutBackend.update_weights, handles[0], version)
        self.train.wait(handles)


class WeightTransport:
    """One way of moving the trainer's weights to the rollout workers, named by `weight_sync.transport`.

    The driver (RLSession) calls `update(version)` at every sync, `reconnect()` after it replaced dead rollout
    workers (followed by `resend`), `resend(version)` after loading a checkpoint, and `close()` at shutdown. A
    transport implements `push(version)` and, when it keeps a link between the two sides, `connect()` (run
    before the first push, and again after a reconnect) and `close()`. `sender` and `receiver` name the
    protocols it needs of the train and the rollout backends, defined beside it in its module."""

    name: ClassVar[str]
    sender: ClassVar[tuple[type, ...]] = ()
    receiver: ClassVar[tuple[type, ...]] = ()

    def __init__(self, cfg: RLConfig, source: WeightSource, rollout: WorkerGroup[RolloutBackend]):
        self.cfg, self.source, self.rollout = cfg, source, rollout
        self.train = source.train
        self.connected = False
        self._received_bytes: int | None = None

    def connect(self) -> None:
        """Set up the link between the two sides (nothing for a transport without one)."""

    def push(self, version: int) -> None:
        """Send the trainer's current weights to every rollout worker as `version`."""
        raise NotImplementedError

    def update(self, version: int) -> int:
        """Deliver weight version `version` to every rollout worker (connecting first if needed); returns the
        bytes each worker received, in its own dtype."""
        if not self.connected:
            self.connect()
            self.connected = True
        self.push(version)
        self.rollout.call(RolloutBackend.end_weight_update)
        return self.received_bytes()

    def reconnect(self) -> None:
        """Rollout workers were replaced: the next update connects again, the new workers included."""
        self.connected = False

    def resend(self, version: int) -> None:
        """All weights to every rollout worker through Ray, whatever the transport (after a worker restart: one
        full update that needs no link; a resumed run's first update goes by `update`, its link is new anyway)."""
        self.source.send_objects(self.rollout, None, version)
        self.rollout.call(RolloutBackend.end_weight_update)

    def close(self) -> None:
        """Release what the link holds (the workers release theirs when they stop)."""
        self.connected = False

    def take_metrics(self) -> dict[str, float]:
        """The transport's own metrics of the last update (`sync/...`), handed over once: none by default."""
        return {}

    def received_bytes(self) -> int:
        if self._received_bytes is None:
            self._received_bytes = self.rollout.call_rank0(RolloutBackend.weight_bytes)
        return self._received_bytes
