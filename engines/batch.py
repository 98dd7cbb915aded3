"""The train batch: rollout samples packed into right-padded tensors.

Logprob tensors are aligned with tokens: column t holds log p(x_t | x_<t) (column 0 is 0), so a loss
mask over response tokens selects exactly the logprobs the policy is trained on.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    width = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True))
    if advantages.shape not in ((n,), (n, width)):
        raise ValueError(f"pack_samples: advantages of shape {tuple(advantages.shape)}; expected ({n},) or "
                         f"({n}, {width})")
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    old_logprobs = torch.zeros((n, width), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        lp, lr = len(p), len(r)
        input_ids[i, : lp + lr] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention_mask[i, : lp + lr] = 1
        mask = torch.ones(lr) if response_masks is None else torch.tensor(response_masks[i], dtype=torch.float32)
        loss_mask[i, lp : lp + lr] = mask
        old_logprobs[i, lp : lp + lr] = torch.tensor(response_logprobs[i], dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "advantages": advantages.float(),
    }


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
