"""Per-token losses [B, T] -> one scalar (loss_agg modes), and the weights that keep the scalar exact
over micro-batches and data-parallel ranks.
"""

from __future__ import annotations

import torch

from rlflow.engines.core.algorithms.common import masked

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum", "seq_mean_token_sum")
SUM_AGG_MODES = ("token_sum",)  # no denominator: micro-batch losses add up as they are
AGGREGATED_METRICS = frozenset({"loss", "pg_loss", "kl", "entropy", "value_loss", "distill_loss", "distill_kl"})


def aggregate_loss(values: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: int | None = None) -> torch.Tensor:
    """Reduce per-token values [B, T] to a scalar. Empty masks contribute nothing (0, not NaN).

    token_mean:              sum(values * mask) / sum(mask); long responses weigh more (DAPO).
    token_sum:               sum(values * mask), no denominator: the loss grows with the batch's tokens (newer
                             verl's token-sum; for per-token weights that already carry their normalisation).
    seq_mean_token_mean:     masked mean per sequence, then mean over sequences with >= 1 token (original GRPO).
    seq_mean_token_sum:      masked sum per sequence, then mean over sequences with >= 1 token (verl's
                             seq-mean-token-sum): a long response counts its length times more than a short one.
    seq_mean_token_sum_norm: masked sum per sequence / norm_len, then mean over sequences with >= 1 token
                             (Dr.GRPO: a constant norm_len, e.g. max_new_tokens, removes the length bias).
    """
    _check_mode(mode)
    weighted = masked(values, mask)
    mask = mask.to(weighted.dtype)
    if mode == "token_mean":
        return weighted.sum() / mask.sum().clamp(min=1)
    if mode == "token_sum":
        return weighted.sum()
    tokens_per_seq = mask.sum(-1)
    non_empty = tokens_per_seq > 0
    seq_sum = weighted.sum(-1)
    if mode == "seq_mean_token_mean":
        per_seq = seq_sum / tokens_per_seq.clamp(min=1)
    elif mode == "seq_mean_token_sum":
        per_seq = seq_sum
    else:
        if norm_len is None or norm_len <= 0:
            raise ValueError(
                f"aggregate_loss: mode 'seq_mean_token_sum_norm' needs norm_len > 0 (e.g. max_new_tokens), "
                f"got {norm_len}"
            )
        per_seq = seq_sum / norm_len
    return per_seq.sum() / non_empty.sum().clamp(min=1)  # empty rows have per_seq == 0


def aggregation_weight(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What a batch counts for under `mode`: its tokens (token_mean, token_sum) or its non-empty sequences
    (seq_mean_*): the denominator of the normalised modes, additive over any split of the batch.

    Data-parallel workers and micro-batches scale their loss with micro_batch_scales, so the sum of their
    gradients equals the gradient of one aggregate over the whole mini-batch.
    """
    _check_mode(mode)
    if mode in ("token_mean", "token_sum"):
        return mask.sum()
    return (mask.sum(-1) > 0).sum().to(mask.dtype)


def micro_batch_scales(micro_mask: torch.Tensor, total_weight: torch.Tensor, mode: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss scale, share) of one micro-batch of a mini-batch whose aggregation_weight, summed over every
    data-parallel rank, is total_weight (float64).

    share = the micro-batch's weight / total_weight. Its aggregate_loss times the loss scale, summed over the
    micro-batches and ranks (FSDP and Megatron add the ranks' gradients), is the aggregate of the whole
    mini-batch: the loss scale is the share for the normalised modes (each micro-batch divided by its own count
    instead of the mini-batch's) and 1 for token_sum, whose sums already add up. Metrics combine with
    scale_metrics.
    """
    share = aggregation_weight(micro_mask, mode).double() / total_weight.double().clamp(min=1)
    return (torch.ones_like(share) if mode in SUM_AGG_MODES else share), share


def scale_metrics(metrics: dict[str, torch.Tensor], loss_scale: torch.Tensor, share: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """One micro-batch's metrics, weighted so that summing them over micro-batches and ranks gives the
    mini-batch's: loss terms (AGGREGATED_METRICS) add up like the loss (loss scale), every other metric is a
    token mean averaged with the micro-batch's share. float64, detached."""
    return {k: v.detach().double() * (loss_scale if k in AGGREGATED_METRICS else share) for k, v in metrics.items()}


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
