"""RL algorithms as pure tensor functions, shared by every train and rollout backend.

Shapes: B sequences, T token positions, V vocabulary. `mask` is 1 on the tokens that are trained on and 0 on
prompt and padding positions. Whatever sits under mask == 0 (even inf or NaN) never reaches a result or a gradient.
Nothing here holds state or does I/O, so each function is tested against numbers worked out by hand.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k3")


# ----------------------------------------------------------------------------- logits -> per-token quantities


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
    logp = torch.log_softmax(logits.float(), dim=-1)
    finite_logp = torch.where(logp.isfinite(), logp, 0.0)
    return -(logp.exp() * finite_logp).sum(-1)


# ----------------------------------------------------------------------------- advantages


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantage of each sample relative to the other samples of its prompt (no value model).

    Rewards [N] are laid out group by group: N = num_groups * group_size, consecutive samples share a prompt.
    GRPO (normalize_std=True): (r - group mean) / (group std + eps), with the unbiased sample std (correction=1,
    as torch.std and verl compute it). Dr.GRPO (normalize_std=False): r - group mean, since dividing by the std
    over-weights groups that are almost all right or all wrong.
    A group whose rewards are all equal carries no signal and gets exactly 0 (never NaN, never a rounding error).
    Returns float32.
    """
    n = rewards.numel()
    if group_size < 1 or n % group_size:
        raise ValueError(
            f"group_advantages: {n} rewards do not split into groups of {group_size}; "
            "N must be num_groups * group_size, laid out group by group"
        )
    r = rewards.float().reshape(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return adv.masked_fill(all_equal, 0.0).reshape(-1)


# ----------------------------------------------------------------------------- loss aggregation


def aggregate_loss(values: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: int | None = None) -> torch.Tensor:
    """Reduce per-token values [B, T] to a scalar. Empty masks contribute nothing (0, not NaN).

    token_mean:              sum(values * mask) / sum(mask); long responses weigh more (DAPO).
    seq_mean_token_mean:     masked mean per sequence, then mean over sequences with >= 1 token (original GRPO).
    seq_mean_token_sum_norm: masked sum per sequence / norm_len, then mean over sequences with >= 1 token
                             (Dr.GRPO: a constant norm_len, e.g. max_new_tokens, removes the length bias).
    """
    _check_mode(mode)
    weighted = _masked(values, mask)
    mask = mask.to(weighted.dtype)
    if mode == "token_mean":
        return weighted.sum() / mask.sum().clamp(min=1)
    tokens_per_seq = mask.sum(-1)
    non_empty = tokens_per_seq > 0
    seq_sum = weighted.sum(-1)
    if mode == "seq_mean_token_mean":
        per_seq = seq_sum / tokens_per_seq.clamp(min=1)
    else:
        if norm_len is None or norm_len <= 0:
            raise ValueError(
                f"aggregate_loss: mode 'seq_mean_token_sum_norm' needs norm_len > 0 (e.g. max_new_tokens), "
                f"got {norm_len}"
            )
        per_seq = seq_sum / norm_len
    return per_seq.sum() / non_empty.sum().clamp(min=1)  # empty rows have per_seq == 0


def aggregation_weight(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What a batch counts for under `mode`: its tokens (token_mean) or its non-empty sequences (seq_mean_*).

    Data-parallel workers and micro-batches scale their loss by weight / total weight, so the sum of their
    gradients equals the gradient of one aggregate over the whole mini-batch.
    """
    _check_mode(mode)
    if mode == "token_mean":
        return mask.sum()
    return (mask.sum(-1) > 0).sum().to(mask.dtype)


# ----------------------------------------------------------------------------- losses


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' logprobs.

    k1 = log p - log q: unbiased, high variance, can be negative per token.
    k3 = q/p - log(q/p) - 1 (Schulman's low-variance estimator): unbiased and >= 0; the log-ratio is clamped to
    [-20, 20] so exp() cannot overflow when the policy has drifted far from the reference.
    Gradients flow into `logprobs` only; the reference is a constant.
    """
    ref_logprobs = ref_logprobs.detach()
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
        return log_ratio.exp() - log_ratio - 1
    raise ValueError(f"kl_penalty: unknown estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


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
    """PPO-clip: -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) per token, then aggregated.

    clip_high > clip_low is DAPO's clip-higher: low-probability tokens with A > 0 may grow further before the
    gradient stops. advantages are [B] (one per sequence, broadcast over its tokens) or [B, T]. old_logprobs and
    advantages are constants: gradients flow into `logprobs` only.

    Metrics (detached, masked token means): clip_frac (share of tokens where the clipped term was chosen because it
    was strictly smaller, i.e. those tokens get no gradient), approx_kl (0.5 * (logp - old_logp)^2, the quadratic
    estimate of KL(old || new)), ratio_mean.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    valid = mask > 0
    # Zero the log-ratio off the mask first, so garbage there cannot overflow exp() and send NaN into backward.
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), 0.0)
    ratio = log_ratio.exp()
    advantages = torch.where(valid, advantages.detach(), 0.0)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate_loss(per_token, mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics = {
            "clip_frac": _masked_mean((clipped < unclipped).float(), mask),
            "approx_kl": _masked_mean(0.5 * log_ratio.pow(2), mask),
            "ratio_mean": _masked_mean(ratio, mask),
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
    """The training objective: policy loss + kl_coef * KL to the reference - entropy_coef * entropy.

    KL and entropy are aggregated like the policy loss (same loss_agg, norm_len), so all three are on one scale.
    The KL term is computed only with ref_logprobs and kl_coef > 0; the entropy is reported whenever it is given
    (pass it detached to only log it) and enters the loss when entropy_coef != 0.
    Metrics: those of policy_loss plus pg_loss, kl (when computed), entropy (when given), loss.
    """
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


# ----------------------------------------------------------------------------- helpers


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values * mask, with exact zeros off the mask (a plain product would turn inf or NaN padding into NaN)."""
    return torch.where(mask > 0, values * mask, 0.0)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked(values, mask).sum() / mask.sum().to(values.dtype).clamp(min=1)


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
