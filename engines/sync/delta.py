"""The `delta` transport: the `store` transport's bandwidth-saving sibling. Rank 0 writes each version to the run
store as its change from the version before (engines/sync/delta_format.py: xor of the rollout dtype's bytes in
byte planes, zstd, an xxh3 per tensor), commits it by writing its manifest last, and every rollout worker rebuilds
the version on a host mirror and loads it whole. Any fsspec store works (file://, s3://), so a rollout fleet on
other nodes or clouds can follow it.

Snapshots: the first version this driver publishes (a new run, or the first after a resume: the sender's copy of
the last version died with its process), every `weight_sync.delta.full_every` versions, and whenever the sender
holds no whole previous version. A snapshot prunes every older version, so the store keeps the newest snapshot and
the deltas after it. A receiver that cannot apply the delta it is sent (missed versions, a restarted worker with an
empty mirror, a failed checksum) rebuilds from the newest snapshot and the deltas after it; if no chain reaches the
version (the delta itself is corrupt), the sender writes a snapshot of that version from the copy it holds and the
receivers are asked again. `sync/delta_full_fetches` counts those snapshot reads (docs/metrics.md).

Memory: the sender's host copy and each receiver's mirror are the whole model in the rollout dtype (7B in bf16:
15 GB of host memory on train rank 0 and on each rollout worker's host).
"""

from __future__ import annotations

from typing import Protocol

from rlflow.engines.core.config import StorageConfig
from rlflow.engines.store.run_store import RunStore, worker_storage
from rlflow.engines.sync.base import WeightTransport
from rlflow.engines.sync.delta_format import (
    LAYOUT,
    committed,
    prune_before,
    remove_from,
    write_manifest,
)


class DeltaSender(Protocol):
    """A train backend's side: it gathers a bucket (collective) and rank 0 hands it to its `DeltaPublisher`."""

    def put_weights_delta(self, storage: StorageConfig, run: str, version: int, index: int, names: list[str],
                          dtype: str, base: int | None, level: int) -> dict:
        """Write bucket `index` of `version` (these HF-named weights, in `dtype`) as its delta against the held
        `base` (None: whole); rank 0 returns the bucket's manifest entry, other ranks {}."""
        ...

    def delta_held(self, buckets: int) -> tuple[str, int] | None:
        """Rank 0: (epoch, version) of the whole version it holds, or None."""
        ...

    def put_delta_snapshot(self, storage: StorageConfig, run: str, version: int, level: int) -> list[dict]:
        """Rank 0: a snapshot of the held `version`, from the held bytes; its buckets' manifest entries."""
        ...


class DeltaReceiver(Protocol):
    def update_weights_from_delta(self, storage: StorageConfig, run: str, version: int) -> dict:
        """Rebuild `version` on the worker's mirror from the run store and load it (DeltaFollower.follow's
        result, as a dict: applied, full_fetches, read_bytes, problems)."""
        ...

    def weight_dtype(self) -> str: ...


class DeltaTransport(WeightTransport):
    name = "delta"
    sender, receiver = (DeltaSender,), (DeltaReceiver,)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_full: int | None = None  # the newest snapshot this driver wrote; None: write one next
        self.dtype: str | None = None
        self.metrics: dict[str, float] = {}

    def connect(self) -> None:
        """Ask the rollout workers their dtype: the versions are diffed in it, so what they load is what they hold
        (one dtype for all of them: a version has one)."""
        dtypes = set(self.rollout.call(DeltaReceiver.weight_dtype))
        if len(dtypes) != 1:
            raise ValueError(f"weight_sync.transport delta: the rollout workers hold their weights in several dtypes "
                             f"{sorted(dtypes)}; a version is written in one (set one rollout.precision)")
        self.dtype = dtypes.pop()

    def push(self, version: int) -> None:
        # the workers reach the store with the driver's credentials when the recipe names none (other nodes lack
        # the driver's AWS_* environment): kept in memory, never persisted
        storage, run, settings = worker_storage(self.cfg.storage), self.cfg.name, self.cfg.weight_sync.delta
        store, buckets = RunStore(self.cfg.storage, run), self.source.buckets()
        held = self.train.call_rank0(DeltaSender.delta_held, len(buckets))
        full = held is None or self.last_full is None or version - self.last_full >= settings.full_every
        if self.last_full is None:
            store.remove(LAYOUT)  # a killed run's versions: another timeline, and no receiver should follow it
        else:
            remove_from(store, version)  # a torn or superseded attempt at this version (a retried sync)
        epoch, base = (None, None) if full else held
        entries = [self.source.call(DeltaSender.put_weights_delta, storage, run, version, i, names, self.dtype,
                                    base, settings.zstd_level) for i, names in enumerate(buckets)]
        if epoch is None:
            epoch = self.train.call_rank0(DeltaSender.delta_held, len(buckets))[0]
        manifest = write_manifest(store, version, "full" if full else "delta", epoch, base, self.dtype, entries)
        results = self.rollout.call(DeltaReceiver.update_weights_from_delta, storage, run, version)
        if not all(r["applied"] for r in results):
            if full:
                raise RuntimeError(f"weight_sync.transport delta: rollout workers could not load snapshot {version} "
                                   f"from {store.uri(LAYOUT)}: {[r['problems'] for r in results if not r['applied']]}")
            snapshot = self.train.call_rank0(DeltaSender.put_delta_snapshot, storage, run, version,
                                             settings.zstd_level)
            write_manifest(store, version, "full", epoch, None, self.dtype, snapshot)
            again = self.rollout.call(DeltaReceiver.update_weights_from_delta, storage, run, version)
            if not all(r["applied"] for r in again):
                raise RuntimeError(f"weight_sync.transport delta: rollout workers could not load version {version} "
                                   f"even from a fresh snapshot: {[r['problems'] for r in again if not r['applied']]}")
            results = [{**r, "full_fetches": r["full_fetches"] + a["full_fetches"],
                        "read_bytes": r["read_bytes"] + a["read_bytes"]} for r, a in zip(results, again, strict=True)]
        if "full" in committed(store).get(version, ()):
            self.last_full = version
            prune_before(store, version)
        self.metrics = {
            "sync/delta_full": float(full),
            "sync/delta_bytes": float(manifest["stored_bytes"]),
            "sync/delta_ratio": manifest["stored_bytes"] / max(manifest["full_bytes"], 1),
            "sync/delta_full_fetches": float(sum(r["full_fetches"] for r in results)),
            "sync/delta_read_bytes": float(sum(r["read_bytes"] for r in results)),
        }

    def take_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics
