"""Weight sync, train -> rollout: HF-named tensors in buckets, stamped with a weight version.

The trainer's rank 0 holds full weights (data parallel), so it is the only sender. Buckets bound the
memory a transfer holds at once; the version travels with every update so each generated sample
records which policy produced it.

Transports, chosen by `weight_sync.transport`:
- ray: rank 0's bucket goes to every rollout worker as one Ray object, actor to actor (in memory).
- store: rank 0 writes each bucket as a safetensors file under `<run>/weights/v<version>/` in the run
  store and the rollout workers read it. Slower, but works wherever the store does (across clusters,
  to a rollout fleet outside Ray), and nothing but plain tensors travels.
- cuda_ipc and nccl: GPU to GPU, set up here and carried out by rlflow.engines.sync.gpu.
- distributed: SGLang's own pair of routes (engines/sync/distributed.py): every rollout server joins a
  process group with train rank 0 through /init_weights_update_group and receives each bucket's broadcast
  through /update_weights_from_distributed (gloo for CPU engines, NCCL on GPUs). It is how real SGLang servers
  take weights without a disk hop and without pickle; the embedded engine's server speaks it too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rlflow.engines.core.config import StorageConfig
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.endpoints import (
    DistributedReceiver,
    DistributedSender,
    IpcReceiver,
    IpcSender,
    NcclReceiver,
    NcclSender,
)

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
    handles = train_group.call(IpcSender.cuda_ipc_handles)
    rollout_group.call_each(IpcReceiver.attach_ipc, [(h,) for h in handles])
    return True


def connect_nccl(train_group, rollout_group, rollout_precision: str) -> bool:
    """nccl: train rank 0 (rank 0 of a private group) and every rollout worker (ranks 1..) rendezvous."""
    host, port = train_group.call_rank0(NcclSender.rendezvous_address)
    world = 1 + len(rollout_group)
    sender = train_group.submit_rank0(NcclSender.nccl_connect, host, port, world, rollout_precision)
    rollout_group.call_each(NcclReceiver.nccl_connect, [(host, port, 1 + i, world) for i in range(len(rollout_group))])
    train_group.wait([sender])
    return True


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run blocking calls at the same time and return their results in order: the members of a collective each
    return only once all have joined, so they need threads, with in-process workers as with Ray actors. The
    first error is raised at once (the others end with the group's timeout)."""
    pool = ThreadPoolExecutor(len(calls), thread_name_prefix="weight-sync")
    futures = [pool.submit(c) for c in calls]
    wait(futures, return_when=FIRST_EXCEPTION)
    pool.shutdown(wait=False)
    for f in futures:
        if f.done() and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]


def connect_distributed(train_group, rollout_group, group_name: str, backend: str, ranks_per_worker: int = 1,
                        previous: str | None = None) -> str:
    """distributed: train rank 0 (rank 0, serving the rendezvous) and every rollout server (ranks from 1; a
    server of `ranks_per_worker` tensor-parallel ranks takes that many) join `group_name`. A previous group
    is left first, by the trainer and the servers that still have it at the same time (with NCCL, a member
    that destroys the group alone waits for the others: measured on 2 GPUs, docs/benchmarks.md)."""
    n = len(rollout_group)

    def leave(i: int) -> None:
        with contextlib.suppress(Exception):  # a restarted worker's fresh server never joined it
            rollout_group.call_one(i, DistributedReceiver.destroy_weights_update_group, previous)

    if previous is not None:
        together(partial(train_group.call, DistributedSender.leave_weights_update_group),
                 *[partial(leave, i) for i in range(n)])
    host, port = train_group.call_rank0(DistributedSender.rendezvous_address)
    world = 1 + n * ranks_per_worker
    join, init = DistributedSender.join_weights_update_group, DistributedReceiver.init_weights_update_group
    together(partial(train_group.call, join, host, port, world, group_name, backend),
             *[partial(rollout_group.call_one, i, init, host, port, 1 + i * ranks_per_worker, world, group_name,
                       backend) for i in range(n)])
    return group_name


def send_distributed(send: Callable[[list[str]], Any], rollout_group, buckets: list[list[str]],
                     shapes: dict[str, list[int]], dtype: str, version: int, group_name: str) -> None:
    """distributed: for each bucket, the trainer's broadcast (`send(names)`) and every server's
    /update_weights_from_distributed run together; every weight travels as `dtype`."""
    for names in buckets:
        meta = (names, [dtype] * len(names), [shapes[n] for n in names], version, group_name)
        receive = DistributedReceiver.update_weights_from_distributed
        together(partial(send, names), *[partial(rollout_group.call_one, i, receive, *meta)
                                         for i in range(len(rollout_group))])
