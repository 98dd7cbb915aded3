"""The RL training objective: one policy loss, importance weights, distillation, KL and entropy, combined."""

from __future__ import annotations

import torch

from rlflow.engines.core.algorithms.aggregation import aggregate_loss
from rlflow.engines.core.algorithms.common import masked_mean
from rlflow.engines.core.algorithms.distillation import TOPK_DISTILL_LOSSES, distill_loss, topk_distill_loss
from rlflow.engines.core.algorithms.kl import kl_penalty
from rlflow.engines.core.algorithms.policy_losses import (
    POLICY_LOSSES,
    cispo_loss,
    clip_cov_loss,
    gmpo_loss,
    gspo_loss,
    kl_cov_loss,
    policy_loss,
    sapo_loss,
)
from rlflow.engines.core.algorithms.rollout_correction import importance_weights


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
    policy: str = "ppo",
    clip_ratio_c: float | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    is_correction: str = "none",
    tis_cap: float = 2.0,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    is_level: str = "token",
    is_weights: torch.Tensor | None = None,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 1.0,
    teacher_logprobs: torch.Tensor | None = None,
    distill_coef: float = 0.0,
    distill_estimator: str = "k1",
    distill_policy_gradient: bool = True,
    distill_alone: bool = False,
    distill_loss_name: str = "reverse_kl",
    distill_beta: float = 0.5,
    student_topk_logprobs: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training objective: policy loss + kl_coef * KL to the reference - entropy_coef * entropy
    (+ distill_coef * distill_loss).

    policy (POLICY_LOSSES): "ppo" (policy_loss, with dual clip when clip_ratio_c is set), "gspo" (gspo_loss),
    "cispo" (cispo_loss), "gmpo" (gmpo_loss: clip_low / clip_high bound the log-ratio), "sapo" (sapo_loss, with
    sapo_tau_pos / sapo_tau_neg), "clip_cov" (clip_cov_loss) or "kl_cov" (kl_cov_loss, with kl_cov_coef).
    KL and entropy are aggregated like the policy loss (same loss_agg, norm_len), so all three are on one scale.
    The KL term is computed only with ref_logprobs and kl_coef > 0; the entropy is reported whenever it is given
    (pass it detached to only log it) and enters the loss when entropy_coef != 0.

    Rollout/train mismatch (decoupled PPO, three policies): `old_logprobs` are the proximal policy PPO clips
    against, and `rollout_logprobs` the behaviour policy that sampled the tokens. Without correction a backend
    passes the rollout engine's logprobs as old_logprobs and no rollout_logprobs. With is_correction "tis" or
    "icepop" it passes its own recomputed logprobs of the pre-update weights as old_logprobs and the rollout
    engine's as rollout_logprobs; importance_weights(old, rollout) at is_level then multiply the policy loss only
    (the KL and entropy terms are not about the sampled actions' returns). Given rollout_logprobs with "none",
    the mismatch is measured and not corrected. `is_weights` [B, T], weights already computed over the whole
    step's batch (the session does, for batch normalisation), replace the ones computed here; the measurements
    are still taken from rollout_logprobs.
    On-policy distillation (DistillConfig.loss_kwargs): with teacher_logprobs and distill_coef > 0,
    distill_coef * distill_loss (estimator distill_estimator, distill_policy_gradient; clipped, aggregated and
    importance-weighted like the policy loss) is added; distill_alone drops the policy loss (the task reward's
    gradient) and keeps the distillation, KL and entropy terms. pg_loss is reported either way. With
    distill_loss_name forward_kl or jsd (distill_beta) the term is topk_distill_loss of student_topk_logprobs
    against teacher_topk_logprobs ([B, T, K], the teacher's top-k ids) instead.
    Metrics: those of the policy loss, of importance_weights (when rollout_logprobs are given), pg_loss,
    kl (when computed), entropy (when given), those of distill_loss (when distilling), loss.
    """
    weights, is_metrics = None, {}
    if rollout_logprobs is not None:
        weights, is_metrics = importance_weights(old_logprobs, rollout_logprobs, mask, is_correction,
                                                 tis_cap, icepop_low, icepop_high, level=is_level)
        if is_weights is not None:
            weights = torch.where(mask > 0, is_weights.detach().to(weights.dtype), 0.0)
            is_metrics["is_weight_mean"] = masked_mean(weights, mask)
        if is_correction == "none":
            weights = None
    elif is_correction != "none":
        raise ValueError(f"rl_loss: is_correction {is_correction!r} needs rollout_logprobs")
    if clip_ratio_c is not None and policy != "ppo":
        raise ValueError("rl_loss: clip_ratio_c (dual clip) applies to policy 'ppo' only")
    inputs = (logprobs, old_logprobs, advantages, mask)
    agg = {"loss_agg": loss_agg, "norm_len": norm_len, "token_weights": weights}
    clip = {"clip_low": clip_low, "clip_high": clip_high}
    if policy == "ppo":
        loss, metrics = policy_loss(*inputs, **clip, clip_ratio_c=clip_ratio_c, **agg)
    elif policy in ("gspo", "cispo", "gmpo"):
        loss, metrics = {"gspo": gspo_loss, "cispo": cispo_loss, "gmpo": gmpo_loss}[policy](*inputs, **clip, **agg)
    elif policy == "sapo":
        loss, metrics = sapo_loss(*inputs, tau_pos=sapo_tau_pos, tau_neg=sapo_tau_neg, **agg)
    elif policy == "clip_cov":
        loss, metrics = clip_cov_loss(*inputs, **clip, clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb,
                                      clip_cov_ub=clip_cov_ub, **agg)
    elif policy == "kl_cov":
        loss, metrics = kl_cov_loss(*inputs, kl_cov_ratio=kl_cov_ratio, kl_cov_coef=kl_cov_coef, **agg)
    else:
        raise ValueError(f"rl_loss: unknown policy {policy!r}; expected one of {', '.join(POLICY_LOSSES)}")
    metrics |= is_metrics
    metrics["pg_loss"] = loss.detach()
    if distill_coef > 0 and distill_loss_name in TOPK_DISTILL_LOSSES:
        if student_topk_logprobs is None or teacher_topk_logprobs is None:
            raise ValueError(f"rl_loss: distillation by {distill_loss_name} needs student_topk_logprobs and "
                             "teacher_topk_logprobs (the teacher's top-k pass of the batch)")
        distill, distill_metrics = topk_distill_loss(student_topk_logprobs, teacher_topk_logprobs, mask,
                                                     loss=distill_loss_name, beta=distill_beta, loss_agg=loss_agg,
                                                     norm_len=norm_len)
        loss = distill_coef * distill if distill_alone else loss + distill_coef * distill
        metrics |= distill_metrics
    elif distill_coef > 0:
        if teacher_logprobs is None:
            raise ValueError("rl_loss: distill_coef > 0 needs teacher_logprobs (the teacher's pass of the batch)")
        distill, distill_metrics = distill_loss(
            logprobs, old_logprobs, teacher_logprobs, mask, estimator=distill_estimator,
            policy_gradient=distill_policy_gradient, **clip, **agg)
        loss = distill_coef * distill if distill_alone else loss + distill_coef * distill
        metrics |= distill_metrics
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
