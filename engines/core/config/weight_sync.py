"""weight_sync: how trained weights reach the rollout engines."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field

from rlflow.engines.core.config.base import Section


class DeltaSyncConfig(Section):
    full_every: int = Field(
        10, ge=1,
        description="transport delta: a full snapshot every this many versions (also the first version, and the "
        "first after a restart); older versions are then deleted, so the store holds at most this many. A receiver "
        "that missed versions or failed a checksum reads the newest snapshot and the deltas after it.",
    )
    zstd_level: int = Field(3, ge=1, le=22, description="transport delta: zstd's compression level (1 fastest).")


class WeightSyncConfig(Section):
    transport: Literal["ray", "store", "disk", "distributed", "cuda_ipc", "nccl", "adapter", "delta"] = Field(
        "ray",
        description="ray: tensors go actor to actor through Ray's object store, bucket by bucket. store: rank 0 "
        "writes safetensors under the run store and rollout workers read them (works wherever the store does). "
        "disk: rank 0 writes safetensors into a folder per version under disk_dir and every rollout worker loads "
        "it (SGLang's /update_weights_from_disk). "
        "distributed: every rollout server joins a process group with train rank 0 and receives its broadcasts "
        "(SGLang's /init_weights_update_group and /update_weights_from_distributed; gloo on CPU, NCCL on GPUs). "
        "cuda_ipc (colocated GPUs): rollout workers copy straight from their train worker's parameters; with "
        "train.num_workers > 1 (FSDP2 shards) each rollout worker shares its weights with its GPU's rank, which "
        "all-gathers every weight straight into them (bucket_mb does not apply). "
        "nccl (separate GPUs, embedded engine): train rank 0 broadcasts buckets to the rollout workers over NCCL "
        "(over gloo when both sides are on the CPU). "
        "adapter (train.lora): rank 0 writes the LoRA adapter in PEFT's format into a folder per version under "
        "disk_dir and every rollout worker loads it (SGLang's /load_lora_adapter); the base weights never move. "
        "delta: like store, but each version is written as its change from the last (xor of the rollout dtype's "
        "bytes, zstd-compressed, an xxh3 checksum per tensor), with a full snapshot every delta.full_every versions; "
        "each side keeps a host copy of the whole model in the rollout dtype (docs/architecture.md, 'The delta "
        "transport').",
    )
    disk_dir: str = Field(
        default_factory=lambda: str(Path(tempfile.gettempdir()) / "rlflow-weights"),
        description="transports disk and adapter: a local folder that train rank 0 and every rollout worker see "
        "(one node, or a shared file system); versions go to <disk_dir>/<run>/weights/v<version>/ (adapters/ for "
        "adapter) and are removed once the next is loaded.",
    )
    bucket_mb: float = Field(64, gt=0, description="Size of one weight bucket, MiB.")
    delta: DeltaSyncConfig = Field(default_factory=DeltaSyncConfig, description="The delta transport's settings.")
