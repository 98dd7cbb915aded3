"""Trainer state parked in host memory while a colocated rollout engine has the GPU (cluster.colocate).

Why storages and not modules: the state is moved by its storages (`UntypedStorage.resize_(0)` frees one,
`resize_(nbytes)` allocates it again, the idiom FSDP2 itself frees gathered parameters with), so every tensor
object stays what it was: FSDP2's sharded parameters and their padded flat shards, views into Megatron's
contiguous buffers, the optimizer's state keyed by parameter. Nothing has to be re-registered after the trip
back, and a view that was missed is not silently left on the old memory: its storage is the one moved.

One host buffer per `HostParking` holds the bytes (pinned when they come from a GPU, so the copies run at the
link's speed). It is allocated once and reused at every step (pinning tens of GB costs seconds), so a parked
trainer holds that much host memory for the run. On a CPU run the same code copies into the host buffer and
frees the original: nothing is gained, but tests run the exact path a GPU run takes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (copies go through it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostParking:
    """Storages moved to one reusable host buffer and back, their GPU memory freed in between."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._parked: list[tuple[torch.UntypedStorage, int, int]] = []  # storage, offset in _host, bytes
        self._device: torch.device | None = None

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    def park(self, tensors: Iterable[torch.Tensor], device: torch.device | str) -> int:
        """Copy every distinct storage of `tensors` that lives on `device` into the host buffer, then free it
        (contents come back with `unpark`). Returns the bytes moved. Parking twice without an unpark is an
        error: the first trip's bytes would be overwritten."""
        if self._parked:
            raise RuntimeError("HostParking.park: already parked (unpark first)")
        device = torch.device(device)
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            s = t.untyped_storage()
            if t.device.type == device.type and s.nbytes() > 0:
                storages.setdefault(s.data_ptr(), s)
        total = sum(s.nbytes() for s in storages.values())
        if not total:
            return 0
        if self._host is None or self._host.numel() < total:
            self._host = None  # the old buffer goes before the larger one is pinned
            self._host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        offset = 0
        for s in storages.values():
            n = s.nbytes()
            self._host[offset : offset + n].copy_(_bytes_of(s), non_blocking=True)
            self._parked.append((s, offset, n))
            offset += n
        _sync(device)  # the copies are done before the memory is given back
        for s, _, _ in self._parked:
            s.resize_(0)
        self._device = device
        return total

    def unpark(self) -> int:
        """Allocate every parked storage again and copy its bytes back; returns the bytes moved."""
        if not self._parked:
            return 0
        total = 0
        for s, offset, n in self._parked:
            s.resize_(n)
            _bytes_of(s).copy_(self._host[offset : offset + n], non_blocking=True)
            total += n
        _sync(self._device)
        self._parked = []
        return total
