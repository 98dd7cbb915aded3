"""The weight-sync stage: the trainer's weights to every rollout worker as the next version, by the recipe's
transport (engines/sync/); and a LoRA run's fresh adapters, pushed once before its first generation."""

from __future__ import annotations

import time

from rlflow.engines.core.protocols import RolloutBackend
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.session.stages.healing import replace_dead_rollout_workers


def run(s: RunEngines, step: int) -> dict[str, float]:
    """Send the trainer's weights to every rollout worker as version step+1, by the recipe's transport."""
    if s.weight_transport is None:  # train_only: no rollout workers; the version still counts updates
        s.weight_version = step + 1
        return {"sync/weight_version": float(s.weight_version)}
    healed = replace_dead_rollout_workers(s, probe=True)  # counted in this step's metrics, as the rollout's are
    s.gpu.before_sync()  # colocated: the optimizer state leaves the GPU before the rollout weights come
    t0 = time.perf_counter()
    version = step + 1
    # max_staleness >= 2: rollouts of later steps generate meanwhile; paused, they continue after the update
    # with the new weights (a transport sends a version in several parts: none is decoded with half of one)
    paused = s.cfg.rollout.max_staleness >= 2
    if paused:
        s.rollout_group.call(RolloutBackend.pause_generation)
    try:
        nbytes = s.weight_transport.update(version)  # what each rollout worker received, in its own dtype
    finally:
        if paused:
            s.rollout_group.call(RolloutBackend.continue_generation)
    s.weight_version = version
    s.fresh_adapter_due = False  # the trained adapter is served
    dt = time.perf_counter() - t0
    s.gpu.for_rollout()  # ... and the weights after: evaluation and the next rollout get the memory
    return {"sync/weight_version": float(version), "sync/bytes": float(nbytes),
            "sync/gb_per_s": nbytes / dt / 1e9} | s.weight_transport.take_metrics() | healed | s.gpu.take_metrics()


def serve_fresh_adapter(s: RunEngines) -> None:
    """A LoRA run's first generation: push the fresh adapters (once; a resumed run's load pushed its own)."""
    if s.fresh_adapter_due:
        s.fresh_adapter_due = False
        s.weight_transport.update(s.weight_version)
