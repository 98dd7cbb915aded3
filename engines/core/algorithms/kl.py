"""KL to the reference policy: the per-token estimators, KL as a reward penalty, and PPO's adaptive coefficient."""

from __future__ import annotations

import torch

from rlflow.engines.core.algorithms.common import LOG_RATIO_CLAMP, masked

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' logprobs (Schulman's k1/k2/k3).

    k1 = log p - log q: unbiased, high variance, can be negative per token.
    k2 = (log p - log q)^2 / 2: biased but >= 0; as a loss its gradient is the unbiased KL gradient.
    k3 = q/p - log(q/p) - 1: unbiased and >= 0. As verl computes it, the log-ratio is clamped to [-20, 20] so
    exp() cannot overflow when the policy has drifted far from the reference, and the result to [-10, 10] so a
    few runaway tokens cannot dominate the loss. low_var_kl is verl's other name for the same estimator.
    Gradients flow into `logprobs` only; the reference is a constant.
    """
    ref_logprobs = ref_logprobs.detach()
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs).pow(2)
    if estimator in ("k3", "low_var_kl"):
        log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(f"kl_penalty: unknown estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def kl_reward_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kl_coef: float, estimator: str
) -> torch.Tensor:
    """KL in the reward: kl_coef * KL(policy || reference) per token [B, T], 0 off the mask, a constant (no grad).

    Subtract it from the token rewards (or its row sum from a sequence reward) before the advantages, so drifting
    from the reference costs return instead of adding a loss term. `logprobs` are the behaviour policy's: the
    tokens were sampled from it.
    """
    kl = kl_penalty(logprobs.detach().float(), ref_logprobs.float(), estimator)
    return masked(kl_coef * kl, mask).detach()


def adaptive_kl_coef(kl_coef: float, current_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """The next KL coefficient of PPO's adaptive KL controller (Ziegler et al. 2019, as verl's AdaptiveKLController).

    error = clip(current_kl / target - 1, -0.2, 0.2) and kl_coef * (1 + error * n_steps / horizon): the
    coefficient grows while the measured KL is above the target and shrinks below it, by at most 20% per
    `horizon` samples. n_steps is the samples the KL was measured on (the step's batch size).
    """
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive_kl_coef: target ({target}) and horizon ({horizon}) must be > 0")
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)
