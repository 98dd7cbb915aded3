"""Masked reductions and the clamped log-ratio that every estimator, loss and correction builds on.

Whatever sits under mask == 0 (even inf or NaN) never reaches a result or a gradient.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # |log(p / p_old)| beyond this is clamped: exp() stays finite (verl's bound in its PPO loss)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values over the mask; 0 for an empty mask; garbage off the mask never shows."""
    return masked(values, mask).sum() / mask.sum().to(values.dtype).clamp(min=1)


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values * mask, with exact zeros off the mask (a plain product would turn inf or NaN padding into NaN)."""
    return torch.where(mask > 0, values * mask, 0.0)


def apply_token_weights(per_token: torch.Tensor, weights: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor:
    """per_token times constant weights [B, T] (importance weights), 0 off `valid`; unchanged without weights."""
    if weights is None:
        return per_token
    return per_token * torch.where(valid, weights.detach(), 0.0)


def broadcast_per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """One value per sequence [B] spread over its tokens [B, T] (a [B, T] input is returned as it is)."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def clamped_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, valid: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log(p / p_old) clamped to +-LOG_RATIO_CLAMP where the token is trained on and p_old is known, else 0 with
    no gradient; where it was known). Garbage off the mask and an old logprob of -inf cannot overflow exp() and
    send NaN into the loss or the backward pass."""
    known = valid & torch.isfinite(old_logprobs)
    ratio = torch.where(known, logprobs - old_logprobs.detach(), 0.0)
    return ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), known


def sequence_log_ratio(log_ratio: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each sequence's log-ratio [B]: the sum of its tokens' (already 0 off the mask), clamped so exp() stays
    finite."""
    return torch.where(valid, log_ratio, 0.0).sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
