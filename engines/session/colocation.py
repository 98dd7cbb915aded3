"""Who holds a shared GPU when train and rollout workers are colocated (cluster.colocate, slime's --colocate).

The rollout engine gives its memory back before the trainer runs (release_memory_occupation) and takes it again
with the next weight sync. With train.offload_during_rollout (on when colocated) the trainer does the same the
other way: the order of one step is

    train step -> trainer parks its optimizer state (the weights stay: the sync reads them)
    -> weight sync (the rollout engine takes back its weights' memory only)
    -> trainer parks its weights -> the engine takes back its KV cache (SGLang: and CUDA graphs; the embedded
    engine allocates its cache as it generates) -> evaluate, next rollout -> the engine releases
    -> trainer onloads -> ...

Every stage that needs the train workers asks for them here (`for_training`, or `resident` when the rollout
engine must keep its weights: checkpoints, a resend to a restarted worker) and every stage that generates asks
for the GPU for rollout (`for_rollout`); each move happens once, whichever stage comes first. The seconds moves
took are reported by the next stage that returns metrics (time/offload, time/onload).
"""

from __future__ import annotations

import time
from typing import Literal

from rlflow.engines.core.config import RLConfig
from rlflow.engines.core.protocols import RolloutBackend, TrainBackend, WorkerGroup
from rlflow.engines.sync.base import sharded_trainer


class ColocatedMemory:
    """The train workers' and the rollout workers' turns on their shared GPUs (a no-op when not colocated)."""

    def __init__(self, cfg: RLConfig, train: WorkerGroup[TrainBackend], rollout: WorkerGroup[RolloutBackend]):
        self.train, self.rollout = train, rollout
        self.colocated = cfg.cluster.colocate and len(rollout) > 0
        self.offloads = cfg.offloads_trainer and self.colocated
        # the cuda_ipc rollout engine maps an unsharded trainer's parameters: they stay where they are (a sharded
        # trainer writes into the engine's weights instead, engines/sync/cuda_ipc.py)
        self.keeps_weights = cfg.weight_sync.transport == "cuda_ipc" and not sharded_trainer(cfg)
        self.parked: Literal["nothing", "optimizer", "all"] = "nothing"
        self._metrics: dict[str, float] = {}

    def for_training(self) -> None:
        """The trainer is about to run a forward or a step: the rollout engine releases, the trainer onloads."""
        if self.colocated:
            self.rollout.call(RolloutBackend.release_memory_occupation)
        self.resident()

    def resident(self) -> None:
        """The trainer's state back on its GPU (the rollout engine keeps what it holds)."""
        if self.parked == "nothing":
            return
        t0 = time.perf_counter()
        results = self.train.call(TrainBackend.onload)
        self.parked = "nothing"
        self._add("onload", time.perf_counter() - t0, results)

    def before_sync(self) -> None:
        """The trainer's weights on its GPU for the sync to read, its optimizer state parked meanwhile."""
        if self.parked == "all":
            self.resident()
        self._park(keep_weights=True)

    def for_rollout(self) -> None:
        """The rollout engine is about to generate: the trainer parks what it may, then the engine takes back
        the rest of its memory (the sync took its weights' already): KV cache and CUDA graphs."""
        self._park(keep_weights=self.keeps_weights)
        if self.colocated:
            self.rollout.call(RolloutBackend.resume_memory_occupation, ["kv_cache", "cuda_graph"])

    def take_metrics(self) -> dict[str, float]:
        """time/offload, time/onload (driver's seconds, summed since the last call) and what moved."""
        out, self._metrics = self._metrics, {}
        return out

    def _park(self, keep_weights: bool) -> None:
        target = "optimizer" if keep_weights else "all"
        if not self.offloads or self.parked == target or self.parked == "all":
            return
        t0 = time.perf_counter()
        results = self.train.call(TrainBackend.offload, keep_weights)
        self.parked = target
        self._add("offload", time.perf_counter() - t0, results)

    def _add(self, kind: str, seconds: float, results: list[dict[str, float]]) -> None:
        m = self._metrics
        m[f"time/{kind}"] = m.get(f"time/{kind}", 0.0) + seconds
        m[f"{kind}/gb"] = m.get(f"{kind}/gb", 0.0) + sum(r["bytes"] for r in results) / 1e9
        if kind == "offload" and "gpu_allocated_gb" in results[0]:  # what the trainer still holds on its GPU
            m["offload/gpu_allocated_gb"] = max(r["gpu_allocated_gb"] for r in results)
