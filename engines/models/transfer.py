"""Host data to the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of Python data on `device`; to CUDA through pinned memory, so the host does not wait for
    the GPU's queued work (a plain `torch.tensor(..., device='cuda')` synchronizes)."""
    return tensor_to_device(torch.tensor(data, dtype=dtype), device)


def tensor_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, the same way: a copy from pageable memory waits for the GPU's queue to drain,
    and a training step makes a few per micro-batch (its batch, its packed layout). The copy reads a pinned copy
    of `t`, or `t` itself when it is pinned already: such a `t` must not change until the copy has run."""
    if torch.device(device).type == "cuda" and not t.is_cuda:
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
