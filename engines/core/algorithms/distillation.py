"""On-policy distillation losses: reverse KL on the sampled tokens, forward KL or JSD over the teacher's top k."""

from __future__ import annotations

import math

import torch

from rlflow.engines.core.algorithms.aggregation import aggregate_loss
from rlflow.engines.core.algorithms.common import apply_token_weights, masked_mean
from rlflow.engines.core.algorithms.kl import KL_ESTIMATORS, kl_penalty
from rlflow.engines.core.algorithms.policy_losses import policy_loss

DISTILL_LOSSES = ("reverse_kl", "forward_kl", "jsd")
TOPK_DISTILL_LOSSES = ("forward_kl", "jsd")  # need the teacher's top-k log-probs, not only the sampled token's


def distill_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str = "k1",
    policy_gradient: bool = True,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: str = "token_mean",
    norm_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """On-policy distillation: the reverse KL(student || teacher) on the student's own sampled tokens.

    `teacher_logprobs` [B, T] are the teacher's log-probabilities of the tokens the student sampled (one forward
    pass of the frozen teacher, no gradient), so only the sampled token's probability is needed on either side.
    policy_gradient (verl's use_policy_gradient, Thinking Machines' on-policy distillation): the per-token
    estimate kl_penalty(old_logprobs, teacher_logprobs, estimator) at the policy that sampled the tokens, negated,
    is a per-token advantage of the PPO-clip loss against old_logprobs; with k1 (log p - log q) its gradient at
    the sampling policy is E_p[(log p - log q) grad log p], the gradient of the per-token reverse KL. Otherwise
    (GKD-style, backpropagated directly) the estimator of the current logprobs is the loss: k2's gradient is the
    same reverse-KL gradient, k3's is in expectation the gradient of the forward KL(teacher || student), and k1's
    is 0 in expectation (it only lowers the sampled tokens' logprobs): use k2 or policy_gradient.
    `token_weights` (importance weights of rollout correction) multiply the per-token loss, as in policy_loss.
    Metrics: distill_loss (the aggregated loss), distill_kl (k1 of the current logprobs, aggregated like the loss:
    the reverse-KL estimate on these samples), distill_clip_frac (policy_gradient only).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"distill_loss: unknown estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")
    teacher = teacher_logprobs.detach()
    valid = mask > 0
    teacher = torch.where(valid, teacher, 0.0)  # what sits off the mask (-inf, NaN) never reaches a gradient
    metrics: dict[str, torch.Tensor] = {}
    if policy_gradient:
        reward = -kl_penalty(torch.where(valid, old_logprobs, 0.0).detach(), teacher, estimator)
        reward = torch.where(torch.isfinite(reward), reward, 0.0)  # an old logprob the rollout did not give (-inf)
        loss, pg = policy_loss(logprobs, old_logprobs, reward, mask, clip_low, clip_high, loss_agg, norm_len,
                               token_weights=token_weights)
        metrics["distill_clip_frac"] = pg["clip_frac"]
    else:
        per_token = kl_penalty(torch.where(valid, logprobs, 0.0), teacher, estimator)
        loss = aggregate_loss(apply_token_weights(per_token, token_weights, valid), mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics["distill_kl"] = aggregate_loss(torch.where(valid, logprobs, 0.0) - teacher, mask, loss_agg, norm_len)
    metrics["distill_loss"] = loss.detach()
    return loss, {k: v.detach() for k, v in metrics.items()}


def topk_distill_loss(
    student_topk_logprobs: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss: str = "forward_kl",
    beta: float = 0.5,
    loss_agg: str = "token_mean",
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Distillation over the teacher's top-k tokens at each position (verl's forward_kl_topk): both [B, T, K]
    log-probabilities of the same K token ids, the teacher's k likeliest (teacher_topk_logprobs, constants) and
    the student's at those ids (with gradient), each under its own full softmax (not renormalised on the k).

    forward_kl: sum_k q_k (log q_k - log p_k), KL(teacher || student) restricted to the teacher's top k (the
    whole forward KL when k is the vocabulary); its gradient is -sum_k q_k grad log p_k, mode-covering.
    jsd: the generalised Jensen-Shannon divergence of GKD (arXiv:2306.13649) on the same support,
    beta KL(q || m) + (1 - beta) KL(p || m) with m = beta q + (1 - beta) p, beta in (0, 1).
    Aggregated over the mask like the policy loss. Metrics: distill_loss, distill_kl (the top-k forward KL,
    whichever the loss), distill_teacher_mass (sum_k q_k: how much of the teacher's distribution the k cover).
    """
    if loss not in TOPK_DISTILL_LOSSES:
        raise ValueError(f"topk_distill_loss: unknown loss {loss!r}; expected one of {', '.join(TOPK_DISTILL_LOSSES)}")
    if loss == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"topk_distill_loss: jsd needs 0 < beta < 1, got {beta}")
    valid = (mask > 0)[..., None]
    log_q = torch.where(valid, teacher_topk_logprobs.detach().float(), 0.0)
    log_p = torch.where(valid, student_topk_logprobs.float(), 0.0)
    q = log_q.exp()
    forward = (q * (log_q - log_p)).sum(-1)
    if loss == "forward_kl":
        per_token = forward
    else:
        p = log_p.exp()
        log_m = torch.logsumexp(torch.stack([log_q + math.log(beta), log_p + math.log(1 - beta)]), dim=0)
        per_token = beta * (q * (log_q - log_m)).sum(-1) + (1 - beta) * (p * (log_p - log_m)).sum(-1)
    value = aggregate_loss(per_token, mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics = {"distill_loss": value.detach(), "distill_kl": aggregate_loss(forward, mask, loss_agg, norm_len),
                   "distill_teacher_mass": masked_mean(q.sum(-1), mask)}
    return value, metrics
