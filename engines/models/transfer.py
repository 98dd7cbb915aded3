"""Host data to the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of Python data on `device`; to CUDA through pinned memory, so the host does not wait for
    the GPU's queued work (a plain `torch.tensor(..., device='cuda')` synchronizes)."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
