"""Micro-batches by token budget for packed training: groups of samples whose lengths sum to at most a budget.

Packed, a micro-batch costs what its tokens cost, not rows x its longest row, so samples are grouped by
their summed length. Longest first into the least-filled group (LPT) keeps the groups even, so a budget is
met with few micro-batches and no one of them is much longer than the rest. Losses are scaled by each
micro-batch's share of the mini-batch (engines/core/algorithms.aggregation_weight), so the grouping does not
change the update.
"""

from __future__ import annotations

import heapq

import torch

from rlflow.engines.core.batch import IMAGE_IDS, TrainBatch

# columns with one entry per row (after the row dim), not per token: cutting a micro-batch to its width keeps them
ROW_COLUMNS = (IMAGE_IDS,)


def token_budget_groups(lengths: list[int], max_tokens: int = 0, max_rows: int = 0) -> list[list[int]]:
    """Indices of `lengths` in groups of at most `max_tokens` summed tokens and at most `max_rows` samples
    (0: no cap). A sample longer than the budget gets a group of its own. Each group lists its indices in
    ascending order. Without a token cap the groups are consecutive runs of max_rows samples (what a
    row-count micro-batch always meant, so per-micro-batch metrics stay comparable with the Megatron
    backend's)."""
    n = len(lengths)
    if n == 0:
        return []
    if not max_tokens:  # a row cap alone: consecutive rows, as a padded backend groups them
        rows = max_rows or n
        return [list(range(a, min(a + rows, n))) for a in range(0, n, rows)]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    packed = _first_fit(order, lengths, max_tokens, max_rows or n)  # as few groups as the caps allow
    even = _lpt(order, lengths, len(packed), max_rows or n)  # ... and as many, with the tokens spread evenly
    if max_tokens and any(len(g) > 1 and sum(lengths[i] for i in g) > max_tokens for g in even):
        even = packed
    return [sorted(g) for g in even if g]


def packed_micro_batches(
    batch: TrainBatch, max_tokens: int = 0, max_rows: int = 0, min_length: int = 0
) -> list[tuple[list[int], TrainBatch]]:
    """The batch's rows grouped by `token_budget_groups` on their attention-mask lengths (raised to
    `min_length`: Megatron's packed stream gives an empty row one token), each group cut to its longest
    row's width: (row indices, rows). One grouping for every packed backend."""
    lengths = [max(int(n), min_length) for n in batch["attention_mask"].sum(-1).tolist()]
    out = []
    for rows in token_budget_groups(lengths, max_tokens, max_rows):
        index = torch.tensor(rows)
        width = max(lengths[i] for i in rows)
        out.append((rows, cut_rows(batch, index, width)))
    return out


def cut_rows(batch: TrainBatch, index: torch.Tensor | slice, width: int) -> TrainBatch:
    """The rows at `index`, their per-token columns cut to `width` tokens (ROW_COLUMNS kept whole)."""
    return {k: v[index][:, :width] if v.dim() >= 2 and k not in ROW_COLUMNS else v[index] for k, v in batch.items()}


def _first_fit(order: list[int], lengths: list[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """Each sample, longest first, into the first group it fits in (first-fit decreasing)."""
    groups: list[list[int]] = []
    tokens: list[int] = []
    for i in order:
        for g, group in enumerate(groups):
            if len(group) < max_rows and (not max_tokens or tokens[g] + lengths[i] <= max_tokens):
                group.append(i)
                tokens[g] += lengths[i]
                break
        else:
            groups.append([i])
            tokens.append(lengths[i])
    return groups


def _lpt(order: list[int], lengths: list[int], k: int, max_rows: int) -> list[list[int]]:
    """Each sample, longest first, into the group with the fewest tokens that has room for another row."""
    groups: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, g) for g in range(k)]  # (tokens, group) of the groups with room
    for i in order:
        tokens, g = heapq.heappop(heap)  # never empty: k >= n / max_rows
        groups[g].append(i)
        if len(groups[g]) < max_rows:
            heapq.heappush(heap, (tokens + lengths[i], g))
    return groups
