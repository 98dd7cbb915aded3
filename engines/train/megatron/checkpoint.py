"""Megatron's tensor-parallel RNG-tracker state as JSON values (megatron-core's own checkpoint formats use
torch.save). The optimizer state is in engines/train/megatron/optimizer_shards.py."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel


def tracker_rng_state() -> dict[str, list[int]]:
    """Megatron's named CUDA RNG streams (its tracker forks to them for dropout in tensor-parallel regions, so
    each TP rank draws its own or the shared numbers), as JSON values. Streams that are not byte tensors (the
    CUDA-graph-safe tracker's generators) are not saved: such a resume draws fresh dropout masks."""
    states = tensor_parallel.get_cuda_rng_tracker().get_states()
    return {name: s.tolist() for name, s in states.items() if torch.is_tensor(s)}


def set_tracker_rng_state(states: dict[str, list[int]]) -> None:
    """Restore tracker_rng_state()'s streams; the tracker keeps any stream the checkpoint does not have."""
    if not states:
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.set_states(tracker.get_states() | {name: torch.tensor(v, dtype=torch.uint8) for name, v in states.items()})
