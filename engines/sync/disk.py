"""The `disk` transport: rank 0 writes a version's buckets as safetensors into a local folder
(`weight_sync.disk_dir`, seen by every worker: one node or a shared file system) and every rollout worker loads
the whole folder at once (SGLang's /update_weights_from_disk). SGLang then reports that folder as its model_path, so
a version's folder stays until the next version is loaded (or the transport closes)."""

from __future__ import annotations

from typing import Protocol

from rlflow.engines.core.config import RLConfig, StorageConfig
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.base import WeightTransport
from rlflow.engines.sync.store import StoreSender, version_dir


class DiskReceiver(Protocol):
    def update_weights_from_disk(self, path: str, version: int) -> int:
        """Load every *.safetensors file of a local folder (SGLang's /update_weights_from_disk)."""
        ...


class DiskTransport(WeightTransport):
    name = "disk"
    sender, receiver = (StoreSender,), (DiskReceiver,)

    loaded: int | None = None  # the version whose folder the servers loaded last (their model_path)

    def push(self, version: int) -> None:
        disk, run = StorageConfig(uri=self.cfg.weight_sync.disk_dir), self.cfg.name
        folder = disk_folder(self.cfg)
        if version == self.loaded:  # sent again (a resend after a restart): the folder is written anew
            folder.remove(*version_dir(version))
            self.loaded = None
        for i, names in enumerate(self.source.buckets()):
            self.source.call(StoreSender.put_weights_to_store, disk, run, version, i, names)
        try:
            self.rollout.call(DiskReceiver.update_weights_from_disk, folder.path(*version_dir(version)), version)
        except BaseException:
            folder.remove(*version_dir(version))
            raise
        previous, self.loaded = self.loaded, version
        if previous is not None:
            folder.remove(*version_dir(previous))

    def close(self) -> None:
        if self.loaded is not None:
            disk_folder(self.cfg).remove(*version_dir(self.loaded))
            self.loaded = None
        super().close()


def disk_folder(cfg: RLConfig) -> RunStore:
    """This run's folder under weight_sync.disk_dir: the versions the disk transport writes go under it."""
    return RunStore(StorageConfig(uri=cfg.weight_sync.disk_dir), cfg.name)


def weight_dirs(cfg: RLConfig) -> list[str]:
    """The folders a rollout server of this run may load weights from over /update_weights_from_disk and
    /load_lora_adapter (besides its model): the disk and adapter transports' versions of this run and, with a
    local run store, the run's folder (checkpoints). Another run's folders and the rest of the file system stay
    out of reach."""
    dirs = [disk_folder(cfg).path("weights"), disk_folder(cfg).path("adapters")]
    store = RunStore(cfg.storage, cfg.name)
    if store.protocol == "file":
        dirs.append(store.run_dir)
    return dirs
