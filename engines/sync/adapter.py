"""The `adapter` transport (train.lora): only the LoRA adapter moves, through SGLang's adapter routes.

Rank 0 writes the adapter of version v as a PEFT folder under `<weight_sync.disk_dir>/<run>/adapters/v<v>/`
(every train rank joins: each holds a shard of it), every rollout worker loads it under the run's adapter name
(`LoraConfig.ADAPTER_NAME`, what rollout requests name in /generate's `lora_path`) and stamps the version on
what it generates from then on. SGLang keeps its base weights and applies the adapter per request; the embedded
engine merges it into its weights (engines/rollout). The base weights never travel: a 1.5B model's
rank-16 adapter is about 1% of its bytes.

Loading a name a worker serves already replaces that adapter (the SGLang backend unloads it first: SGLang
refuses a name twice), so versions swap between generations; a version's folder goes once the next one is
loaded.
"""

from __future__ import annotations

from typing import Protocol

from rlflow.engines.core.config import LoraConfig
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.base import WeightTransport
from rlflow.engines.sync.disk import disk_folder


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


def adapter_dir(version: int) -> tuple[str, str]:
    return "adapters", f"v{version:08d}"


class AdapterTransport(WeightTransport):
    name = "adapter"
    sender, receiver = (AdapterSender,), (AdapterReceiver,)

    loaded: int | None = None  # the version the rollout workers serve (its folder stays until the next one)
    _bytes: int = 0

    def push(self, version: int) -> None:
        folder: RunStore = disk_folder(self.cfg)
        if version == self.loaded:  # sent again (after a restart or a resume): written anew
            folder.remove(*adapter_dir(version))
            self.loaded = None
        path = folder.path(*adapter_dir(version))
        try:
            self._bytes = self.source.call(AdapterSender.save_adapter, path)
            self.rollout.call(AdapterReceiver.load_lora_adapter, LoraConfig.ADAPTER_NAME, path)
            self.rollout.call(AdapterReceiver.update_weight_version, version)
        except BaseException:
            folder.remove(*adapter_dir(version))
            raise
        previous, self.loaded = self.loaded, version
        if previous is not None:
            folder.remove(*adapter_dir(previous))

    def resend(self, version: int) -> None:
        """The adapter again, by the same route (a restarted worker or a resumed run needs no base weights)."""
        self.push(version)

    def received_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        if self.loaded is not None:
            disk_folder(self.cfg).remove(*adapter_dir(self.loaded))
            self.loaded = None
        super().close()
