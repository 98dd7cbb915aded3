"""Micro-batches for the Megatron backend: padded (the default) or packed (padding-free, `megatron.packing`).

Packed: samples are grouped by summed length within a token budget (engines/train/microbatch.py, the grouping
the torch backend uses) and run as one token stream in megatron's THD layout, each sample attending to itself
only, so a micro-batch costs what its tokens cost. Padded: consecutive rows cut to their group's longest row,
within rows x width <= budget. Either way a micro-batch also keeps its rows right-padded, which is the layout the
losses and results use. Losses are scaled by each micro-batch's share of the mini-batch, so the grouping does not
change the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlflow.engines.core.batch import TrainBatch
from rlflow.engines.models.packed import PackedRows
from rlflow.engines.train.microbatch import packed_micro_batches


@dataclass
class Micro:
    """One micro-batch: which rows of the batch it holds, those rows right-padded to their longest, and (packed
    mode) their tokens as one stream."""

    rows: list[int]
    batch: TrainBatch
    packed: PackedRows | None = None
    cu_seqlens_host: torch.Tensor | None = None  # packed: the sample boundaries, kept on the CPU by `to`

    def to(self, device: str) -> Micro:
        batch = {k: v.to(device, non_blocking=True) for k, v in self.batch.items()}
        packed = self.packed.to(device) if self.packed is not None else None
        return Micro(self.rows, batch, packed, self.cu_seqlens_host)


def plan_micro_batches(batch: TrainBatch, max_rows: int, max_tokens: int = 0, packed: bool = True,
                       multiple: int = 1) -> list[Micro]:
    """The batch's rows in micro-batches of at most `max_rows` rows and `max_tokens` tokens (0: no token cap):
    summed lengths when packed, rows x padded width otherwise. `multiple`: padded widths round up to it
    (sequence parallelism splits the sequence over TP ranks; a packed stream is padded when it runs)."""
    if not packed:
        return [Micro(list(range(a, b)), _cut(batch, a, b, w))
                for a, b, w in _consecutive(batch, max_rows, max_tokens, multiple)]
    out = []
    for rows, part in packed_micro_batches(batch, max_tokens, max_rows, min_length=1):
        packed_rows = PackedRows.from_padded(part["input_ids"], part["attention_mask"])
        out.append(Micro(rows, part, packed_rows, packed_rows.cu_seqlens.clone()))
    return out


def filler(micro: Micro | None, empty: TrainBatch, packed: bool, multiple: int = 1) -> Micro:
    """A micro-batch that trains and returns nothing (no rows) but runs the model like a real one: the first row
    of `micro`, all of it loss-masked, or, for a rank with no micro-batch at all, a row of `multiple` zero tokens
    with `empty`'s columns. Expert-parallel ranks exchange tokens in every MoE layer, so a rank whose shard makes
    fewer micro-batches than its peers' runs these to take part in theirs."""
    if micro is not None:
        batch = {k: v[:1].clone() for k, v in micro.batch.items()}
    else:
        batch = {k: torch.zeros((1, multiple, *v.shape[2:]) if v.dim() >= 2 else (1,), dtype=v.dtype)
                 for k, v in empty.items()}
        batch["attention_mask"][0, 0] = 1
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    if not packed:
        return Micro([], batch)
    packed = PackedRows.from_padded(batch["input_ids"], batch["attention_mask"])
    return Micro([], batch, packed, packed.cu_seqlens.clone())


def gather_rows(parts: list[tuple[list[int], torch.Tensor]], n: int, width: int, device: str | None = None
                ) -> torch.Tensor:
    """Per-micro-batch [rows, w] results back into one [n, width] tensor (zeros past each row's width)."""
    out = torch.zeros(n, width, device=device)
    for rows, values in parts:
        w = min(values.shape[1], width)
        out[torch.tensor(rows, device=out.device)[:, None], torch.arange(w, device=out.device)] = \
            values[:, :w].float().to(out.device)
    return out


def micro_batches(batch: TrainBatch, max_rows: int, max_tokens: int = 0, multiple: int = 1) -> list[TrainBatch]:
    """Padded mode: rows in order, grouped so that rows <= max_rows and rows x width <= max_tokens (0: no token
    cap); width is the group's longest row rounded up to `multiple`. A row longer than max_tokens on its own
    gets a group of its own."""
    return [_cut(batch, a, b, w) for a, b, w in _consecutive(batch, max_rows, max_tokens, multiple)]


def _consecutive(batch: TrainBatch, max_rows: int, max_tokens: int, multiple: int) -> list[tuple[int, int, int]]:
    lengths = batch["attention_mask"].sum(-1).tolist()
    groups: list[tuple[int, int, int]] = []  # (start, stop, width)
    start, width = 0, 0
    for i, n in enumerate(lengths):
        w = max(width, _round_up(max(int(n), 1), multiple))
        rows = i - start + 1
        if rows > 1 and (rows > max_rows or (max_tokens and rows * w > max_tokens)):
            groups.append((start, i, width))
            start, w = i, _round_up(max(int(n), 1), multiple)
        width = w
    if lengths:
        groups.append((start, len(lengths), width))
    return groups


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _cut(batch: TrainBatch, start: int, stop: int, width: int) -> TrainBatch:
    """Rows start:stop with `width` token columns (zero-padded past the batch's width: masked out anyway)."""
    full = batch["input_ids"].shape[1]
    out = {}
    for k, v in batch.items():
        v = v[start:stop]
        if v.dim() == 2 and v.shape[1] == full:
            v = v[:, :width] if width <= full else F.pad(v, (0, width - full))
        out[k] = v
    return out
