"""Rollout/train mismatch: importance weights and rejection masks from the train engine's and the rollout
engine's logprobs of the same tokens.
"""

from __future__ import annotations

import torch

from rlflow.engines.core.algorithms.common import (
    broadcast_per_token,
    clamped_log_ratio,
    masked_mean,
    sequence_log_ratio,
)

IS_CORRECTIONS = ("none", "tis", "icepop")
IS_LEVELS = ("token", "sequence")
REJECTIONS = ("none", "token", "sequence", "geometric")


def importance_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    tis_cap: float = 2.0,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    level: str = "token",
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights [B, T] correcting for the rollout engine sampling from a slightly different policy.

    ratio = pi_train(y_t) / pi_rollout(y_t), both under the weights that generated the batch: the train engine's
    recomputed logprobs against the rollout engine's own. The weights are constants (no gradient) that multiply
    the per-token policy loss, 0 off the mask.
      none:   1 (the metrics still measure the mismatch).
      tis:    min(ratio, tis_cap), truncated importance sampling: corrects the bias, bounds the variance.
      icepop: ratio inside [icepop_low, icepop_high], 0 outside: tokens on which the engines disagree too much
              are dropped from the gradient altogether (IcePop's two-sided mask).
    level "token" takes each token's own ratio; "sequence" the sequence's, exp(sum of its tokens' log-ratios)
    (clamped to +-LOG_RATIO_CLAMP), truncated or masked as a whole and given to every token of the sequence:
    unbiased for the sequence's likelihood, at a higher variance (verl's rollout_is: sequence).
    batch_normalize divides the weights by their mean over the batch (over tokens at token level, over
    non-empty sequences at sequence level), so they average 1 and only re-weight (verl's
    rollout_is_batch_normalize); a batch whose weights are all 0 stays 0. Normalise over the whole step's batch,
    not a micro-batch, or the result depends on how the batch was split.
    Metrics (masked token means): is_weight_mean, is_ratio_mean (raw token ratio), mismatch_kl (k3 estimate of
    KL(rollout || train)), plus is_clip_frac (tis: share truncated) or is_mask_frac (icepop: share dropped), at
    the chosen level, counted over tokens.
    A token whose rollout logprob is not finite (an engine that returned none for it) gets ratio 1.
    """
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"importance_weights: unknown mode {mode!r}; expected one of {', '.join(IS_CORRECTIONS)}")
    if level not in IS_LEVELS:
        raise ValueError(f"importance_weights: unknown level {level!r}; expected one of {', '.join(IS_LEVELS)}")
    valid = mask > 0
    log_ratio, _ = clamped_log_ratio(train_logprobs.detach(), rollout_logprobs, valid)  # unknown: ratio 1
    ratio = log_ratio.exp()
    level_ratio = ratio
    if level == "sequence":
        level_ratio = broadcast_per_token(sequence_log_ratio(log_ratio, valid).exp(), ratio)
    metrics: dict[str, torch.Tensor] = {}
    if mode == "tis":
        weights = level_ratio.clamp(max=tis_cap)
        metrics["is_clip_frac"] = masked_mean((level_ratio > tis_cap).float(), mask)
    elif mode == "icepop":
        inside = (level_ratio >= icepop_low) & (level_ratio <= icepop_high)
        weights = torch.where(inside, level_ratio, 0.0)
        metrics["is_mask_frac"] = masked_mean((~inside).float(), mask)
    else:
        weights = torch.ones_like(ratio)
    weights = torch.where(valid, weights, 0.0)
    if batch_normalize and mode != "none":
        if level == "sequence":
            rows = valid.any(-1)
            first = valid.int().argmax(-1)  # every token of a row has its weight: take one
            seq_w = weights.gather(-1, first.unsqueeze(-1)).squeeze(-1)
            mean = seq_w[rows].sum() / rows.sum().clamp(min=1)
        else:
            mean = masked_mean(weights, mask)
        if mean > 0:
            weights = weights / mean
    metrics |= {
        "is_weight_mean": masked_mean(weights, mask),
        "is_ratio_mean": masked_mean(ratio, mask),
        "mismatch_kl": masked_mean(ratio - log_ratio - 1, mask),
    }
    return weights, metrics


def rejection_mask(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    low: float,
    high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Which response tokens to keep [B, T] (float 0/1, 0 off the mask) when tokens or whole sequences whose
    rollout/train ratio p_rollout / p_train leaves [low, high] are rejected: rejection sampling against the
    rollout/train mismatch.

    The ratio is the one verl's `*_k1` rejection thresholds bound: exp(k1), k1 = log p_rollout - log p_train per
    token, so verl's rollout_rs_threshold "low_high" is (low, high) here one to one. It is the inverse of the
    importance weight p_train / p_rollout: a token kept under [low, high] has its weight inside [1 / high, 1 / low].
    Unlike an IcePop weight of 0, a rejected token leaves the loss mask itself (multiply the loss mask by the
    result before the loss), so it is not in any denominator either, as verl's rollout_rs removes it from the
    response mask.
      none:      keep every token.
      token:     drop the tokens whose ratio is outside the bounds (verl's token_k1).
      sequence:  drop a whole sequence when exp(sum of its tokens' k1) is outside (verl's seq_sum_k1).
      geometric: drop a whole sequence when exp(mean of its tokens' k1), the geometric mean ratio, is outside
                 (verl's seq_mean_k1): length-normalised, so long sequences are not rejected for their length.
    A token whose rollout logprob is not finite counts as ratio 1. Metrics: reject_token_frac (share of response
    tokens dropped) and reject_seq_frac (share of non-empty sequences that lost at least one token).
    """
    if level not in REJECTIONS:
        raise ValueError(f"rejection_mask: unknown level {level!r}; expected one of {', '.join(REJECTIONS)}")
    valid = mask > 0
    train_log_ratio, _ = clamped_log_ratio(train_logprobs.detach(), rollout_logprobs, valid)
    k1 = -train_log_ratio  # log p_rollout - log p_train
    if level == "token":
        stat = k1.exp()
    elif level == "sequence":
        stat = broadcast_per_token(sequence_log_ratio(k1, valid).exp(), k1)
    elif level == "geometric":
        mean_k1 = torch.where(valid, k1, 0.0).sum(-1) / valid.sum(-1).clamp(min=1)
        stat = broadcast_per_token(mean_k1.exp(), k1)
    else:
        stat = torch.ones_like(k1)
    keep = valid & (stat >= low) & (stat <= high)
    rows = valid.any(-1)
    dropped_rows = (valid & ~keep).any(-1)
    metrics = {
        "reject_token_frac": masked_mean((valid & ~keep).float(), mask),
        "reject_seq_frac": dropped_rows[rows].float().sum() / rows.sum().clamp(min=1),
    }
    return keep.float(), metrics


def rollout_correction(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_correction: str = "none",
    tis_cap: float = 2.0,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    is_level: str = "token",
    batch_normalize: bool = False,
    rejection: str = "none",
    reject_low: float = 0.5,
    reject_high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """A step's whole rollout correction, in verl's order: (keep mask [B, T], importance weights [B, T] or None
    without is_correction, metrics of both).

    The weights come from the response mask as it was, before rejection (verl's
    compute_rollout_correction_and_rejection_mask): a sequence's weight is the likelihood ratio of everything that
    was sampled, rejected tokens included, and batch normalisation averages over the same tokens or sequences
    whatever the rejection dropped. Computing them on the kept tokens instead would move a sequence-level weight
    toward 1 exactly where rejection found the mismatch. The caller multiplies the loss mask by `keep`; the
    weights of rejected tokens are then never used.
    """
    keep, metrics = rejection_mask(train_logprobs, rollout_logprobs, mask, rejection, reject_low, reject_high)
    if is_correction == "none":
        return keep, None, metrics
    weights, is_metrics = importance_weights(train_logprobs, rollout_logprobs, mask, is_correction, tis_cap,
                                             icepop_low, icepop_high, level=is_level, batch_normalize=batch_normalize)
    return keep, weights, metrics | is_metrics


LOGPROB_DIFF_MAX, LOGPROB_DIFF_MEAN = "rollout_logprob_diff_max", "rollout_logprob_diff_mean"


def logprob_diff(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The train/rollout log-prob difference of a batch's trained tokens as a float64 vector [max |d|, sum |d|,
    tokens], d = train logprob - rollout logprob of the same token under the same weights.

    A vector rather than the two metrics, so that parts (micro-batches, data-parallel ranks) combine exactly:
    `merge_logprob_diff` takes the max of the first entries and sums the rest; `logprob_diff_metrics` turns the
    whole into the max and mean. A token whose rollout logprob is +-inf (an engine that gave none) is left out;
    NaN on either side is kept, so the max and mean come out NaN and the non-finite health check reports it.
    """
    known = (mask > 0) & ~torch.isinf(rollout_logprobs)
    diff = (train_logprobs.detach().double() - rollout_logprobs.detach().double()).abs()
    diff = torch.where(known, diff, 0.0)  # NaN on a kept token survives where(); off `known` it is gone
    peak = diff.max() if diff.numel() else diff.new_zeros(())
    return torch.stack([peak, diff.sum(), known.sum().double()])  # on the inputs' device: no sync here


def merge_logprob_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two parts' `logprob_diff` vectors as one: max of the maxima (NaN wins), sums of the sums and counts."""
    peak = torch.maximum(a[:1], b[:1])  # torch.maximum propagates NaN
    return torch.cat([peak, a[1:] + b[1:]])


def logprob_diff_metrics(stats: torch.Tensor) -> dict[str, float]:
    """{rollout_logprob_diff_max, rollout_logprob_diff_mean} of a (merged) `logprob_diff` vector; 0 without
    tokens."""
    peak, total, tokens = (float(x) for x in stats)
    return {LOGPROB_DIFF_MAX: peak, LOGPROB_DIFF_MEAN: total / tokens if tokens else 0.0}
