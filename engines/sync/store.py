"""The `store` transport: rank 0 writes each bucket as a safetensors file under `<run>/weights/v<version>/` in
the run store and the rollout workers read it; the version's folder goes once delivered. Slower than memory,
but it works wherever the store does (across clusters, to a rollout fleet outside Ray), and nothing but plain
tensors travels. The bucket helpers here are both sides' (`put_bucket` for senders, `get_bucket` for
receivers); the `disk` transport writes the same files."""

from __future__ import annotations

from typing import Protocol

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rlflow.engines.core.config import StorageConfig
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.base import NamedTensors, WeightTransport


class StoreSender(Protocol):
    """A train backend's side of the store and disk transports: it gathers a bucket and rank 0 writes it with
    `put_bucket`."""

    def put_weights_to_store(self, storage: StorageConfig, run: str, version: int, index: int,
                             names: list[str]) -> None:
        """Write bucket `index` (these HF-named weights) of weight version `version` as safetensors."""
        ...


class StoreReceiver(Protocol):
    def update_weights_from_store(self, storage: StorageConfig, run: str, version: int, index: int) -> int: ...


def version_dir(version: int) -> tuple[str, str]:
    return "weights", f"v{version:08d}"


def put_bucket(storage: StorageConfig, run: str, version: int, index: int, tensors: NamedTensors) -> None:
    data = save_safetensors({name: t.contiguous() for name, t in tensors})
    RunStore(storage, run).write_bytes(data, *version_dir(version), f"bucket-{index:04d}.safetensors")


def get_bucket(storage: StorageConfig, run: str, version: int, index: int) -> NamedTensors:
    data = RunStore(storage, run).read_bytes(*version_dir(version), f"bucket-{index:04d}.safetensors")
    return list(load_safetensors(data).items())


class StoreTransport(WeightTransport):
    name = "store"
    sender, receiver = (StoreSender,), (StoreReceiver,)

    def push(self, version: int) -> None:
        storage, run = self.cfg.storage, self.cfg.name
        for i, names in enumerate(self.source.buckets()):
            self.source.call(StoreSender.put_weights_to_store, storage, run, version, i, names)
            self.rollout.call(StoreReceiver.update_weights_from_store, storage, run, version, i)
        RunStore(storage, run).remove(*version_dir(version))
