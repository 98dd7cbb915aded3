"""Logits -> per-token quantities: the sampled token's log-probability and the entropy, in float32."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position [B, T], in float32 whatever the logits' dtype.

    The train and the rollout engine both call this, so their logprobs agree to ~1e-6 and the PPO ratio of an
    on-policy step is exactly 1 up to that noise.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position [B, T], in float32.

    A -inf logit (a masked-out vocabulary entry) has p = 0 and adds 0, not 0 * -inf = NaN, in value and gradient.
    """
    return entropy_from_logprobs(torch.log_softmax(logits.float(), dim=-1))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """The same from log-probabilities already computed (a -inf entry adds 0)."""
    return -(logp.exp() * torch.where(logp.isfinite(), logp, 0.0)).sum(-1)
