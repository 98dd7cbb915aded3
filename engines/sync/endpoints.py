"""What each weight transport needs from the train side (rank 0 sends) and the rollout side (every worker
receives), beyond the core TrainBackend / RolloutBackend protocols. A backend subclasses the ones it serves;
a transport's worker group checks them at the start of a run."""

from __future__ import annotations

from typing import Protocol

from rlflow.engines.core.config import StorageConfig


class StoreSender(Protocol):
    def put_weights_to_store(self, storage: StorageConfig, run: str, version: int, index: int,
                             names: list[str]) -> None:
        """Write bucket `index` (these HF-named weights) of weight version `version` as safetensors."""
        ...


class StoreReceiver(Protocol):
    def update_weights_from_store(self, storage: StorageConfig, run: str, version: int, index: int) -> int: ...


class DiskReceiver(Protocol):
    def update_weights_from_disk(self, path: str, version: int) -> int:
        """Load every *.safetensors file of a local folder (SGLang's /update_weights_from_disk)."""
        ...


class AdapterSender(Protocol):
    """The trainer's side of LoRA sync (train.lora): only the adapter moves."""

    def save_adapter(self, path: str) -> int:
        """Write the current LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors)
        into the local folder `path`. Collective over the train ranks (each holds a shard); rank 0 writes.
        Returns the adapter's bytes."""
        ...


class AdapterReceiver(Protocol):
    """A rollout worker's side of LoRA sync: SGLang's adapter routes, with their field names."""

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """/load_lora_adapter: serve the PEFT adapter in the local folder `lora_path` under `lora_name`
        (requests then name it in /generate's `lora_path`), replacing the adapter this worker serves under that
        name, if any (SGLang refuses a loaded name: its backend unloads it first)."""
        ...

    def unload_lora_adapter(self, lora_name: str) -> None:
        """/unload_lora_adapter."""
        ...

    def update_weight_version(self, version: int) -> None:
        """/update_weight_version: the version the server stamps on what it generates from now on (a loaded
        adapter does not change it by itself)."""
        ...


class IpcSender(Protocol):
    def cuda_ipc_handles(self) -> list[tuple[str, tuple]]: ...

    def write_weights_ipc(self, handle: tuple) -> int:
        """A sharded trainer: gather every weight (collective: every rank joins) straight into the colocated
        rollout worker's weights that `handle` maps (its `share_weights`); returns the bytes written, once they
        are there (engines/sync/cuda_ipc.py)."""
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


class NcclSender(Protocol):
    def rendezvous_address(self) -> tuple[str, int]: ...

    def nccl_connect(self, host: str, port: int, world_size: int, rollout_precision: str) -> None: ...

    def nccl_send(self, buckets: list[list[str]]) -> int: ...


class NcclReceiver(Protocol):
    def nccl_connect(self, host: str, port: int, rank: int, world_size: int) -> None: ...

    def update_weights_from_nccl(self, buckets: list[list[str]], version: int) -> int: ...


class DistributedSender(Protocol):
    """The trainer's side of SGLang's distributed update (engines/sync/distributed.py)."""

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


class GpuLinkProbe(Protocol):
    """What the GPU benchmarks ask of both sides: the link's bandwidth and a checksum of the weights."""

    def link_bandwidth(self, kind: str, nbytes: int) -> float: ...

    def weights_digest(self, *args: str) -> float: ...
