"""Micro-batches by token budget: consecutive rows, each group cut to its own longest row.

A train batch is right-padded to its longest sequence; a micro-batch of short rows does not need those columns.
Cutting them keeps the work per micro-batch near the budget whatever the length mix. Losses are scaled by each
micro-batch's share of the mini-batch, so the grouping does not change the update.
"""

from __future__ import annotations

import torch

from rlflow.engines.core.batch import TrainBatch


def micro_batches(batch: TrainBatch, max_rows: int, max_tokens: int = 0, multiple: int = 1) -> list[TrainBatch]:
    """Rows in order, grouped so that rows <= max_rows and rows x width <= max_tokens (0: no token cap).

    width is the group's longest row rounded up to `multiple` (sequence parallelism splits the sequence over
    TP ranks). A row longer than max_tokens on its own gets a group of its own.
    """
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
    return [_cut(batch, a, b, w) for a, b, w in groups]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _cut(batch: TrainBatch, start: int, stop: int, width: int) -> TrainBatch:
    """Rows start:stop with `width` token columns (zero-padded past the batch's width: masked out anyway)."""
    full = batch["input_ids"].shape[1]
    out = {}
    for k, v in batch.items():
        v = v[start:stop]
        if v.dim() == 2 and v.shape[1] == full:
            v = v[:, :width] if width <= full else torch.nn.functional.pad(v, (0, width - full))
        out[k] = v
    return out


def restore_width(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-micro-batch [rows, w] results back into one [N, width] tensor (zeros past each group's width)."""
    out = [torch.nn.functional.pad(p, (0, width - p.shape[1])) if p.shape[1] < width else p[:, :width]
           for p in parts]
    return torch.cat(out)
