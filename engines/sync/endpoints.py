"""Every weight transport's protocols in one import, for a backend that serves several (the rollout backends
take most transports). Each is defined in its transport's module, beside the transport that calls it and the
train backends' side of it: engines/sync/<transport>.py; `GpuLinkProbe`, the GPU benchmarks' probe of both
sides, in engines/sync/gpu.py."""

from __future__ import annotations

from rlflow.engines.sync.adapter import AdapterReceiver, AdapterSender
from rlflow.engines.sync.cuda_ipc import IpcReceiver, IpcSender
from rlflow.engines.sync.delta import DeltaReceiver, DeltaSender
from rlflow.engines.sync.disk import DiskReceiver
from rlflow.engines.sync.distributed import DistributedReceiver, DistributedSender
from rlflow.engines.sync.gpu import GpuLinkProbe
from rlflow.engines.sync.nccl import NcclReceiver, NcclSender
from rlflow.engines.sync.store import StoreReceiver, StoreSender

__all__ = [
    "AdapterReceiver",
    "AdapterSender",
    "DeltaReceiver",
    "DeltaSender",
    "DiskReceiver",
    "DistributedReceiver",
    "DistributedSender",
    "GpuLinkProbe",
    "IpcReceiver",
    "IpcSender",
    "NcclReceiver",
    "NcclSender",
    "StoreReceiver",
    "StoreSender",
]
