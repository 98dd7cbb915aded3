"""The weight transports by name: `weight_sync.transport` picks one from `TRANSPORTS`. Adding a transport is
one module (a `WeightTransport` subclass, engines/sync/base.py) and one entry here, plus its name in the config's
`transport` Literal (engines/core/config.py, which cannot import this layer; a test keeps the two equal)."""

from __future__ import annotations

from rlflow.engines.core.config import RLConfig
from rlflow.engines.core.protocols import RolloutBackend, TrainBackend, WorkerGroup
from rlflow.engines.sync.adapter import AdapterTransport
from rlflow.engines.sync.base import WeightSource, WeightTransport
from rlflow.engines.sync.cuda_ipc import CudaIpcTransport
from rlflow.engines.sync.delta import DeltaTransport
from rlflow.engines.sync.disk import DiskTransport
from rlflow.engines.sync.distributed import DistributedTransport
from rlflow.engines.sync.nccl import NcclTransport
from rlflow.engines.sync.ray_objects import RayObjectsTransport
from rlflow.engines.sync.store import StoreTransport

TRANSPORTS: dict[str, type[WeightTransport]] = {
    t.name: t
    for t in (RayObjectsTransport, StoreTransport, DiskTransport, DistributedTransport, CudaIpcTransport, NcclTransport,
              AdapterTransport, DeltaTransport)
}


def make_transport(cfg: RLConfig, train: WorkerGroup[TrainBackend],
                   rollout: WorkerGroup[RolloutBackend]) -> WeightTransport:
    """The recipe's transport between these groups (nothing is connected until its first update)."""
    name = cfg.weight_sync.transport
    if name not in TRANSPORTS:
        raise ValueError(f"weight_sync.transport: unknown transport {name!r} (known: {sorted(TRANSPORTS)})")
    return TRANSPORTS[name](cfg, WeightSource.from_config(cfg, train), rollout)
