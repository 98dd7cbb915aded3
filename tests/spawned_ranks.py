"""What every rank that a multi-process test spawns ends with. Its own small module: megatron's spawned ranks import
it without conftest's imports (Prefect, the flows), which would add seconds to each rank's start."""

from __future__ import annotations

import torch.distributed as dist


def end_ranks() -> None:
    """A spawned rank's last step: wait for the others, then take the process group down. A rank that exits with
    the group still up can abort in its teardown ("terminate called without an active exception": gloo's threads
    destroyed while running), which mp.spawn reports as the test's failure (seen once in CI)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
