"""Losses against fixed targets: the critic's value loss (returns) and SFT's negative log-likelihood."""

from __future__ import annotations

import torch

from rlflow.engines.core.algorithms.aggregation import aggregate_loss
from rlflow.engines.core.algorithms.common import masked_mean


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = None,
    loss_agg: str = "token_mean",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss: 0.5 * (V - R)^2 per token, aggregated like the policy loss.

    With clip_range (PPO's value clipping), V_clip = V_old + clip(V - V_old, -clip_range, clip_range) and the loss
    is 0.5 * max((V - R)^2, (V_clip - R)^2): the critic may not move more than clip_range from the values the
    advantages were computed with in a direction that lowers its loss. old_values and returns are constants.
    Metrics: vf_clip_frac (share of tokens where the clipped term was strictly larger), value_mean.
    """
    valid = mask > 0
    v = torch.where(valid, values, 0.0)
    returns = torch.where(valid, returns.detach(), 0.0)
    per_token = 0.5 * (v - returns).pow(2)
    clip_hits = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_range is not None:
        old = torch.where(valid, old_values.detach(), 0.0)
        v_clip = old + (v - old).clamp(-clip_range, clip_range)
        clipped = 0.5 * (v_clip - returns).pow(2)
        clip_hits = clipped > per_token
        per_token = torch.maximum(per_token, clipped)
    loss = aggregate_loss(per_token, mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics = {"vf_clip_frac": masked_mean(clip_hits.float(), mask), "value_mean": masked_mean(v, mask)}
    return loss, metrics


def sft_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "token_mean",
    norm_len: int | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised fine-tuning: the negative log-likelihood of the target tokens under the mask, aggregated.

    `mask` is 1 on the response tokens (the answer the model should learn to give) and 0 on the prompt and the
    padding, so the prompt is context, never a target. token_mean (the usual SFT loss) weighs every response
    token the same; seq_mean_token_mean weighs every example the same whatever its length. A row with an empty
    response adds nothing, an all-empty batch gives 0 (not NaN), and -inf or NaN logprobs off the mask never
    reach the loss or its gradient.
    Metrics: loss (the NLL), entropy (when given; detach it to only log it).
    """
    loss = aggregate_loss(-logprobs, mask, loss_agg, norm_len)
    metrics = {"loss": loss.detach()}
    if entropy is not None:
        metrics["entropy"] = aggregate_loss(entropy.detach(), mask, loss_agg, norm_len)
    return loss, metrics
