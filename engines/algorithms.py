"""RL algorithms as pure tensor functions, shared by every train and rollout backend.

Shapes: B sequences, T token positions, V vocabulary. `mask` is 1.0 on tokens that are trained on.
Nothing here holds state or does I/O, so each function is tested against numbers worked by hand.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, computed in float32 so every backend agrees to ~1e-6."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position, in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: (r - mean) / (std + eps) within each group of samples of one prompt; Dr.GRPO: r - mean.

    Rewards are laid out group by group. std is the unbiased sample std (correction=1), as in verl.
    A group whose rewards are all equal carries no signal and gets exactly 0.
    """
    n = rewards.numel()
    if group_size <= 0 or n % group_size:
        raise ValueError(f"group_advantages: {n} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    centered = r - r.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        std = r.std(dim=1, keepdim=True)
        centered = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
    return centered.view(-1)


def aggregation_weight(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What a batch counts for under `mode`: its tokens (token_mean) or its non-empty sequences.

    Data-parallel workers and micro-batches scale their loss by weight / total weight, so the sum of
    their gradients equals the gradient of one aggregate over the whole mini-batch.
    """
    _check_mode(mode)
    if mode == "token_mean":
        return mask.sum()
    return (mask.sum(-1) > 0).sum().to(mask.dtype)


def aggregate_loss(values: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: int | None = None) -> torch.Tensor:
    """Reduce per-token values [B, T] to a scalar; empty masks contribute nothing (no NaN)."""
    _check_mode(mode)
    mask = mask.to(values.dtype)
    if mode == "token_mean":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    per_seq_tokens = mask.sum(-1)
    non_empty = per_seq_tokens > 0
    seq_sum = (values * mask).sum(-1)
    if mode == "seq_mean_token_mean":
        per_seq = seq_sum / per_seq_tokens.clamp(min=1)
    else:
        if not norm_len:
            raise ValueError("aggregate_loss: mode 'seq_mean_token_sum_norm' needs norm_len (e.g. max_new_tokens)")
        per_seq = seq_sum / norm_len
    return (per_seq * non_empty).sum() / non_empty.sum().clamp(min=1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled-token logprobs.

    k1 = log p - log q (unbiased, high variance); k3 = q/p - log(q/p) - 1 (Schulman's low-variance
    estimator, always >= 0), with the log-ratio clamped to +-20 so exp() cannot overflow.
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
        return log_ratio.exp() - log_ratio - 1
    raise ValueError(f"kl_penalty: unknown estimator {estimator!r}; expected 'k1' or 'k3'")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: str = "token_mean",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip with an asymmetric range [1 - clip_low, 1 + clip_high] (clip-higher when clip_high > clip_low).

    Metrics: clip_frac (share of tokens where the clipped term was chosen), approx_kl (masked mean of
    0.5 * (logp - old)^2), ratio_mean.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate_loss(per_token, mask, loss_agg, norm_len)
    with torch.no_grad():
        m = mask.to(per_token.dtype)
        denom = m.sum().clamp(min=1)
        metrics = {
            "clip_frac": ((clipped < unclipped).to(m.dtype) * m).sum() / denom,
            "approx_kl": (0.5 * log_ratio.pow(2) * m).sum() / denom,
            "ratio_mean": (ratio * m).sum() / denom,
        }
    return loss, metrics


def rl_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_agg: str,
    norm_len: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss + kl_coef * KL to the reference - entropy_coef * entropy, all aggregated alike."""
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, loss_agg, norm_len)
    metrics["pg_loss"] = loss.detach()
    if ref_logprobs is not None and kl_coef > 0:
        kl = aggregate_loss(kl_penalty(logprobs, ref_logprobs, kl_estimator), mask, loss_agg, norm_len)
        loss = loss + kl_coef * kl
        metrics["kl"] = kl.detach()
    if entropy is not None:
        ent = aggregate_loss(entropy, mask, loss_agg, norm_len)
        if entropy_coef:
            loss = loss - entropy_coef * ent
        metrics["entropy"] = ent.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
