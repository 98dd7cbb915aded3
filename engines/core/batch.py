"""The train batch: rollout samples packed into right-padded tensors.

Logprob tensors are aligned with tokens: column t holds log p(x_t | x_<t) (column 0 is 0), so a loss
mask over response tokens selects exactly the logprobs the policy is trained on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

TrainBatch = dict[str, torch.Tensor]


def pack_samples(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    response_logprobs: Sequence[Sequence[float]],
    advantages: torch.Tensor,
    pad_id: int,
    response_masks: Sequence[Sequence[int]] | None = None,
) -> TrainBatch:
    """Pack N samples into input_ids/attention_mask/loss_mask/old_logprobs [N, L] and advantages.

    advantages are [N] (one per sample) or [N, L] (per token, aligned with input_ids like the logprobs: what
    token-level estimators produce from a batch packed the same way).
    """
    n = len(prompt_ids)
    p_len = np.fromiter(map(len, prompt_ids), dtype=np.int64, count=n)
    r_len = np.fromiter(map(len, response_ids), dtype=np.int64, count=n)
    _check_lengths(response_logprobs, r_len, "response_logprobs")
    if response_masks is not None:
        _check_lengths(response_masks, r_len, "response_masks")
    total = p_len + r_len
    width = int(total.max())
    if advantages.shape not in ((n,), (n, width)):
        raise ValueError(f"pack_samples: advantages of shape {tuple(advantages.shape)}; expected ({n},) or "
                         f"({n}, {width})")
    # one scatter per tensor instead of a few small tensor writes per sample: (row, column) of every token,
    # prompt then response, row after row; the response positions in that order match the flat responses
    rows = np.repeat(np.arange(n), total)
    cols = np.arange(int(total.sum())) - np.repeat(np.cumsum(total) - total, total)
    in_response = cols >= np.repeat(p_len, total)
    tokens = _flat((x for p, r in zip(prompt_ids, response_ids, strict=True) for x in (p, r)), np.int64)
    resp_rows, resp_cols = torch.from_numpy(rows[in_response]), torch.from_numpy(cols[in_response])
    rows, cols = torch.from_numpy(rows), torch.from_numpy(cols)

    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    input_ids[rows, cols] = torch.from_numpy(tokens)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    attention_mask[rows, cols] = 1
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    loss_mask[resp_rows, resp_cols] = 1.0 if response_masks is None else torch.from_numpy(
        _flat(response_masks, np.float32))
    old_logprobs = torch.zeros((n, width), dtype=torch.float32)
    old_logprobs[resp_rows, resp_cols] = torch.from_numpy(_flat(response_logprobs, np.float32))
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "advantages": advantages.float(),
    }


def _flat(seqs: Iterable[Sequence], dtype) -> np.ndarray:
    parts = [np.asarray(x, dtype=dtype) for x in seqs]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _check_lengths(seqs: Sequence[Sequence], expected: np.ndarray, name: str) -> None:
    if len(seqs) != len(expected):
        raise ValueError(f"pack_samples: {name} has {len(seqs)} rows for {len(expected)} samples")
    for i, (x, n) in enumerate(zip(seqs, expected.tolist(), strict=True)):
        if len(x) != n:
            raise ValueError(f"pack_samples: {name}[{i}] has {len(x)} values for {n} response tokens")


def select(batch: TrainBatch, idx: slice | torch.Tensor) -> TrainBatch:
    return {k: v[idx] for k, v in batch.items()}


def batch_size(batch: TrainBatch) -> int:
    return int(batch["input_ids"].shape[0])


def shard_for_workers(batch: TrainBatch, num_workers: int, mini_batches: int) -> list[TrainBatch]:
    """Split a global batch so that worker w's shard holds its slice of every mini-batch, in order.

    With this layout, W workers that each split their shard into `mini_batches` chunks take the same
    optimizer steps on the same samples as one worker on the whole batch.
    """
    n = batch_size(batch)
    mb = n // mini_batches
    per = mb // num_workers
    shards = []
    for w in range(num_workers):
        idx = torch.cat([torch.arange(m * mb + w * per, m * mb + (w + 1) * per) for m in range(mini_batches)])
        shards.append(select(batch, idx))
    return shards
