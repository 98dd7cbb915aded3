"""Weight sync, train -> rollout: HF-named tensors in buckets, stamped with a weight version.

The trainer's rank 0 holds full weights (data parallel), so it is the only sender. Buckets bound the
memory a transfer holds at once; the version travels with every update so each generated sample
records which policy produced it.

Transports, chosen by `weight_sync.transport`:
- ray: rank 0's bucket goes to every rollout worker as one Ray object, actor to actor (in memory).
- store: rank 0 writes each bucket as a safetensors file under `<run>/weights/v<version>/` in the run
  store and the rollout workers read it. Slower, but works wherever the store does (across clusters,
  to a rollout fleet outside Ray), and nothing but plain tensors travels.
- cuda_ipc and nccl: GPU to GPU, set up here and carried out by engines.weight_transport.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from engines.config import StorageConfig
from tasks.run_store import RunStore

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


def version_dir(version: int) -> tuple[str, str]:
    return "weights", f"v{version:08d}"


def put_bucket(storage: StorageConfig, run: str, version: int, index: int, tensors: NamedTensors) -> None:
    data = save_safetensors({name: t.contiguous() for name, t in tensors})
    RunStore(storage, run).write_bytes(data, *version_dir(version), f"bucket-{index:04d}.safetensors")


def get_bucket(storage: StorageConfig, run: str, version: int, index: int) -> NamedTensors:
    data = RunStore(storage, run).read_bytes(*version_dir(version), f"bucket-{index:04d}.safetensors")
    return list(load_safetensors(data).items())


def connect_ipc(train_group, rollout_group) -> bool:
    """cuda_ipc: rollout worker i maps train worker i's parameters (the pair shares a GPU), once."""
    handles = train_group.call("cuda_ipc_handles")
    rollout_group.call_each("attach_ipc", [(h,) for h in handles])
    return True


def connect_nccl(train_group, rollout_group, rollout_precision: str) -> bool:
    """nccl: train rank 0 (rank 0 of a private group) and every rollout worker (ranks 1..) rendezvous."""
    host, port = train_group.call_rank0("rendezvous_address")
    world = 1 + len(rollout_group)
    sender = train_group.submit_rank0("nccl_connect", host, port, world, rollout_precision)
    rollout_group.call_each("nccl_connect", [(host, port, 1 + i, world) for i in range(len(rollout_group))])
    train_group.wait([sender])
    return True
