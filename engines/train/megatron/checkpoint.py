"""Megatron optimizer and RNG-tracker state as safetensors + JSON (megatron-core's own checkpoint formats use
torch.save).

Whatever wrapper megatron builds (fp32, mixed precision, distributed, chained), the update is made by plain torch
optimizers over fp32 main parameters (a data-parallel shard of them with the distributed optimizer). This saves
each of those tensors and its Adam moments under its position: optimizer o, group g, parameter p. The positions
are those of the same model, parallel layout and megatron-core version, which the caller checks.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer, in a fixed order."""
    chained = getattr(optimizer, "chained_optimizers", None)
    parts = chained if chained is not None else [optimizer]
    return [p.optimizer for p in parts]


def optimizer_state(optimizer: Any) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(tensors, scalars): main parameters and moments by position; the step counts as numbers."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, float] = {}
    for key, p, opt in _positions(optimizer):
        tensors[f"{key}.param"] = p.detach().cpu().contiguous()
        for name, value in opt.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"{key}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{key}.{name}"] = float(value)
    return tensors, scalars


@torch.no_grad()
def load_optimizer_state(optimizer: Any, tensors: dict[str, torch.Tensor], scalars: dict[str, float]) -> None:
    """Put saved main parameters and moments back, in place. Every position must be in the saved state."""
    for key, p, opt in _positions(optimizer):
        if f"{key}.param" not in tensors:
            raise KeyError(f"optimizer state has no {key}: saved by another model or parallel layout?")
        p.copy_(tensors[f"{key}.param"])
        state = {name[len(key) + 1:]: t.to(p.device) for name, t in tensors.items()
                 if name.startswith(key + ".") and name != f"{key}.param"}
        state |= {name[len(key) + 1:]: torch.tensor(v) for name, v in scalars.items() if name.startswith(key + ".")}
        if state:
            opt.state[p] = state


def _positions(optimizer: Any):
    for o, opt in enumerate(torch_optimizers(optimizer)):
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                yield f"o{o}.g{g}.p{i}", p, opt


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
