"""Policy-gradient losses: PPO-clip and its variants (GSPO, CISPO, GMPO, SAPO, Clip-Cov, KL-Cov).

Every loss starts from the same guarded inputs (_PolicyTokens.of: advantages as constants spread over the tokens,
the log-ratio clamped to +-LOG_RATIO_CLAMP, old logprobs that are not finite turned into ratio 1 with no gradient)
and ends the same way (_PolicyTokens.loss: importance weights, loss_agg, the ratio metrics), so each function below
is its formula. Shapes: logprobs, old_logprobs, mask [B, T]; advantages [B] or [B, T]; token_weights [B, T].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlflow.engines.core.algorithms.aggregation import aggregate_loss
from rlflow.engines.core.algorithms.common import (
    apply_token_weights,
    broadcast_per_token,
    clamped_log_ratio,
    masked_mean,
)

GSPO_SEQ_LOG_RATIO_MAX = 10.0  # GSPO's token log-ratio log s_t is clamped above at this, value and gradient (verl's)
POLICY_LOSSES = ("ppo", "gspo", "cispo", "gmpo", "sapo", "clip_cov", "kl_cov")

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class _PolicyTokens:
    """What every policy loss starts from, and how it aggregates and measures its per-token loss."""

    mask: torch.Tensor
    valid: torch.Tensor  # mask > 0
    advantages: torch.Tensor  # [B, T] constants, 0 off the mask
    log_ratio: torch.Tensor  # log(p / p_old) clamped; 0 with no gradient where p_old is unknown or off the mask
    known: torch.Tensor  # trained-on tokens whose old logprob is finite
    loss_agg: str
    norm_len: int | None
    token_weights: torch.Tensor | None

    @classmethod
    def of(cls, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
           loss_agg: str, norm_len: int | None, token_weights: torch.Tensor | None) -> _PolicyTokens:
        valid = mask > 0
        advantages = torch.where(valid, broadcast_per_token(advantages, logprobs).detach(), 0.0)
        log_ratio, known = clamped_log_ratio(logprobs, old_logprobs, valid)
        return cls(mask, valid, advantages, log_ratio, known, loss_agg, norm_len, token_weights)

    def loss(self, per_token: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor | None = None,
             **token_metrics: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """(the per-token loss times the importance weights, aggregated; its metrics, detached masked token means):
        clip_frac (share of `clipped` tokens), approx_kl_k1 (log p_old - log p, verl's ppo_kl), approx_kl_k2
        (0.5 * (log p - log p_old)^2), ratio_mean, nonfinite_old_frac, then each of `token_metrics`."""
        weighted = apply_token_weights(per_token, self.token_weights, self.valid)
        loss = aggregate_loss(weighted, self.mask, self.loss_agg, self.norm_len)
        with torch.no_grad():
            metrics = {
                "clip_frac": ratio.new_zeros(()) if clipped is None else masked_mean(clipped.float(), self.mask),
                "approx_kl_k1": masked_mean(-self.log_ratio, self.mask),
                "approx_kl_k2": masked_mean(0.5 * self.log_ratio.pow(2), self.mask),
                "ratio_mean": masked_mean(ratio, self.mask),
                "nonfinite_old_frac": masked_mean((~self.known).float(), self.mask),
            }
            metrics |= {name: masked_mean(v.float(), self.mask) for name, v in token_metrics.items()}
        return loss, {k: v.detach() for k, v in metrics.items()}


def _ppo_clip(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) per token; where the clipped term was
    strictly smaller, i.e. the tokens that get no gradient)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: str = "token_mean",
    norm_len: int | None = None,
    clip_ratio_c: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO-clip: -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) per token, then aggregated.

    clip_high > clip_low is DAPO's clip-higher: low-probability tokens with A > 0 may grow further before the
    gradient stops. clip_ratio_c (> 1) is dual-clip PPO: for A < 0 the loss is also capped at -clip_ratio_c * A,
    since a token whose ratio has grown far past 1 with a negative advantage would otherwise get an unbounded
    loss and gradient. token_weights [B, T] (importance weights, constants) multiply the per-token loss; they do
    not change the aggregation's denominators. advantages are [B] (one per sequence, broadcast over its tokens)
    or [B, T]. old_logprobs, advantages and weights are constants: gradients flow into `logprobs` only.

    The log-ratio is clamped to +-LOG_RATIO_CLAMP (as verl does), and a token whose old logprob is not finite (a
    rollout engine that returned none for it: -inf) gets ratio 1 and no gradient, instead of an infinite ratio
    and a NaN loss; `nonfinite_old_frac` counts them.

    Metrics (detached, masked token means): clip_frac (share of tokens where the clipped term was chosen because it
    was strictly smaller, i.e. those tokens get no gradient), approx_kl_k1 (log p_old - log p, verl's ppo_kl) and
    approx_kl_k2 (0.5 * (log p - log p_old)^2), two estimates of KL(old || new), ratio_mean, nonfinite_old_frac;
    with clip_ratio_c also dual_clip_frac (share capped by it).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"policy_loss: clip_ratio_c must be > 1 (typically 3), got {clip_ratio_c}")
    x = _PolicyTokens.of(logprobs, old_logprobs, advantages, mask, loss_agg, norm_len, token_weights)
    ratio = x.log_ratio.exp()
    per_token, clipped = _ppo_clip(ratio, x.advantages, clip_low, clip_high)
    if clip_ratio_c is None:
        return x.loss(per_token, ratio, clipped)
    cap = -clip_ratio_c * x.advantages
    dual = (x.advantages < 0) & (per_token > cap)
    return x.loss(torch.where(dual, cap, per_token), ratio, clipped, dual_clip_frac=dual)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    loss_agg: str = "seq_mean_token_mean",
    norm_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: PPO-clip on the sequence ratio s = exp(mean over response tokens of log(p / p_old)).

    The geometric mean keeps s near 1 whatever the length, so the clip range is tiny (paper: 3e-4 / 4e-4) and
    clips whole sequences: one noisy token ratio cannot move or stop a sequence's update on its own. Token-level
    form (GSPO-token): s_t = sg(s) * p(y_t) / sg(p(y_t)) has value s and d s_t / d log p(y_t) = s, so with
    seq_mean_token_mean (the paper's 1/|y| normalisation) the gradient equals sequence-level GSPO, and per-token
    advantages [B, T] are allowed. Per token: -min(s_t * A, clip(s_t, 1 - clip_low, 1 + clip_high) * A).
    Token log-ratios are clamped and non-finite old logprobs handled as in policy_loss. log s_t is clamped above
    at GSPO_SEQ_LOG_RATIO_MAX in value and gradient, as verl clamps it: a sequence whose mean log-ratio has drifted
    past 10 keeps the clamped loss value (-e^10 * A where A < 0) and gets no gradient, instead of one e^10 times
    the plain policy gradient (tests/test_algorithms.py pins both).
    Metrics as policy_loss; ratio_mean and clip_frac are over tokens, each token carrying its sequence's s.
    """
    x = _PolicyTokens.of(logprobs, old_logprobs, advantages, mask, loss_agg, norm_len, token_weights)
    n_tokens = x.known.sum(dim=-1, keepdim=True).clamp(min=1)  # the mean over tokens whose old logprob is known
    seq_log_ratio = (x.log_ratio.sum(dim=-1, keepdim=True) / n_tokens).detach()
    # value: log s; gradient: d log p(y_t). The subtraction is 0 in value but carries the token's gradient.
    token_log_ratio = (seq_log_ratio + (logprobs - logprobs.detach())).clamp(max=GSPO_SEQ_LOG_RATIO_MAX)
    ratio = torch.where(x.known, token_log_ratio, 0.0).exp()
    per_token, clipped = _ppo_clip(ratio, x.advantages, clip_low, clip_high)
    return x.loss(per_token, ratio, clipped)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.2,
    loss_agg: str = "token_mean",
    norm_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * log p per token, then aggregated.

    PPO's clip takes the whole gradient from a token whose ratio left the band, and in long reasoning those are
    often the rare tokens that matter (a "wait" that starts a reflection), which then never learn. CISPO clips
    the importance weight instead, under stop-gradient: every token keeps the policy gradient A * d log p, scaled
    by a bounded weight. The paper sets no lower bound (clip_low >= 1) and tunes clip_high only; it normalises by
    the batch's tokens (token_mean). Log-ratios are clamped as in policy_loss; a token whose old logprob is not
    finite gets weight 1 and no gradient.
    Metrics as policy_loss; clip_frac is the share of tokens whose weight was clipped (they still train).
    """
    x = _PolicyTokens.of(logprobs, old_logprobs, advantages, mask, loss_agg, norm_len, token_weights)
    ratio = x.log_ratio.exp()
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()
    trained = torch.where(x.known, logprobs, logprobs.detach())
    return x.loss(-weight * x.advantages * trained, ratio, weight != ratio)


def gmpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    loss_agg: str = "seq_mean_token_mean",
    norm_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (geometric-mean policy optimisation): each sequence's objective is A times the geometric mean of its
    tokens' clipped ratios, s = exp(mean over tokens of c_t), instead of GRPO's arithmetic mean of ratio * A.

    c_t is the token log-ratio clipped in log space on the side PPO's min would clip: for A >= 0 at most
    clip_high, for A < 0 at least -clip_low (paper: 0.4 both, the ratio band (e^-0.4, e^0.4)); a clipped token
    gets no gradient. One outlier ratio moves a geometric mean far less than an arithmetic one, so updates stay
    stable with a band wider than PPO's. Token form as in gspo_loss: s_t = exp(sg(mean c) + c_t - sg(c_t)) has
    value s and gradient s * d c_t, so with seq_mean_token_mean (the paper's mean over sequences) value and
    gradient equal the sequence objective -A * s; per-token advantages [B, T] clip each token by its own sign.
    The mean runs over tokens whose old logprob is known (the others: ratio 1, no gradient). The token log-ratio
    is clamped to +-LOG_RATIO_CLAMP before the band, as in every loss here (verl's geo_mean does not clamp).
    Metrics as policy_loss; clip_frac is the share of tokens whose log-ratio was clipped (no gradient), ratio_mean
    over tokens, each carrying its sequence's s.
    """
    x = _PolicyTokens.of(logprobs, old_logprobs, advantages, mask, loss_agg, norm_len, token_weights)
    upper = x.advantages >= 0  # the side of the band that can stop a token's gradient
    clipped = x.known & torch.where(upper, x.log_ratio > clip_high, x.log_ratio < -clip_low)
    clipped_log_ratio = torch.where(clipped, torch.where(upper, clip_high, -clip_low), x.log_ratio)
    n_tokens = x.known.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (clipped_log_ratio.sum(dim=-1, keepdim=True) / n_tokens).detach()
    token_log_ratio = seq_log_ratio + (clipped_log_ratio - clipped_log_ratio.detach())
    ratio = torch.where(x.known, token_log_ratio, 0.0).exp()
    return x.loss(-ratio * x.advantages, ratio, clipped & (x.advantages != 0))


def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    loss_agg: str = "seq_mean_token_mean",
    norm_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO (soft adaptive policy optimisation): -f(ratio) * A per token, with the soft gate
    f(r) = sigmoid(tau * (r - 1)) * 4 / tau, tau = tau_pos where A > 0 and tau_neg elsewhere (paper: 1.0, 1.05).

    PPO's hard clip drops a token's gradient the moment its ratio leaves the band. The gate's slope
    f'(r) = 4 sigmoid (1 - sigmoid) is 1 at r = 1 (the plain policy gradient on-policy) and decays smoothly as r
    moves away, faster for a larger tau: far-off-policy tokens are damped, near-on-policy ones keep their signal
    (GSPO would drop a whole sequence for a few outliers). tau_neg > tau_pos damps negative-advantage updates
    sooner: they raise the logits of many unsampled tokens and destabilise training more. The paper averages per
    sequence, then over sequences (seq_mean_token_mean). Log-ratios clamped and unknown old logprobs handled as in
    policy_loss.
    Metrics as policy_loss (clip_frac is 0: nothing is hard-clipped) plus gate_weight_mean, the mean slope f'(r):
    the share of the plain policy gradient the gate lets through.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo_loss: temperatures must be > 0, got tau_pos {tau_pos}, tau_neg {tau_neg}")
    x = _PolicyTokens.of(logprobs, old_logprobs, advantages, mask, loss_agg, norm_len, token_weights)
    ratio = x.log_ratio.exp()
    tau = torch.where(x.advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1))
    slope = 4 * gate.detach() * (1 - gate.detach())
    return x.loss(-(4 / tau) * gate * x.advantages, ratio, gate_weight_mean=slope)


def clip_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    loss_agg: str = "token_mean",
    norm_len: int | None = None,
    token_weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"): PPO-clip, and a few
    high-covariance tokens lose their gradient.

    The policy's entropy falls when confident tokens (high log p) get high advantages; the per-token covariance
    cov_t = (A_t - mean A) * (log p_t - mean log p), means over the batch's response tokens, drives that collapse.
    max(1, int(clip_cov_ratio * response tokens)) tokens, drawn at random among those with
    clip_cov_lb < cov_t < clip_cov_ub that PPO's clip has not already stopped, get loss 0 and no gradient
    (paper: 2e-4, bounds 1 and 5, with a PPO band of 1 either side). Covariance and draw are over the batch given:
    a backend's micro-batch, as in verl. The draw uses `generator` (default: torch's global RNG, which the train
    backends checkpoint). Log-ratios (clamped here, not in verl's clip_cov) and unknown old logprobs as in
    policy_loss; such tokens are never drawn.
    Metrics as policy_loss plus cov_frac, the share of tokens whose gradient the covariance rule detached.
    """
    x = _PolicyTokens.of(logprobs, old_logprobs, advantages, mask, loss_agg, norm_len, token_weights)
    ratio = x.log_ratio.exp()
    per_token, clipped = _ppo_clip(ratio, x.advantages, clip_low, clip_high)
    with torch.no_grad():
        cov = _token_covariance(logprobs, x.advantages, x.valid)
        candidates = x.known & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        detached = _random_pick(candidates, _cov_count(clip_cov_ratio, x.valid), generator)
    return x.loss(torch.where(detached, 0.0, per_token), ratio, clipped, cov_frac=detached)


def kl_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 1.0,
    loss_agg: str = "token_mean",
    norm_len: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (Cui et al. 2025): the unclipped policy gradient -ratio * A per token, plus
    kl_cov_coef * |log(p / p_old)| on the max(1, int(kl_cov_ratio * response tokens)) tokens with the largest
    covariance cov_t (see clip_cov_loss).

    Instead of stopping the tokens that would collapse the entropy, the penalty holds them near the old policy,
    while every other token takes the plain policy gradient: there is no ratio clip (clip_low / clip_high do not
    apply). The authors' recipes: kl_cov_ratio 2e-3 (7B) and 2e-4 (32B), coefficient 1 (verl's ppo_kl_coef, whose
    config default is 0.1). Top-k over the batch given (a backend's micro-batch, as in verl), among tokens whose
    old logprob is known. The log-ratio is clamped as in every loss here (verl's kl_cov does not clamp): past
    +-LOG_RATIO_CLAMP the penalty stays at kl_cov_coef * LOG_RATIO_CLAMP with no gradient.
    Metrics as policy_loss (clip_frac is 0) plus cov_frac, the share of tokens penalised.
    """
    x = _PolicyTokens.of(logprobs, old_logprobs, advantages, mask, loss_agg, norm_len, token_weights)
    ratio = x.log_ratio.exp()
    with torch.no_grad():
        cov = _token_covariance(logprobs, x.advantages, x.valid)
        penalised = _top_k(cov, x.known, _cov_count(kl_cov_ratio, x.valid))
    per_token = -ratio * x.advantages + torch.where(penalised, kl_cov_coef * x.log_ratio.abs(), 0.0)
    return x.loss(per_token, ratio, cov_frac=penalised)


def _token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(A_t - mean A) * (log p_t - mean log p) per token, means over the response tokens of the batch; 0 off them.
    `advantages` are already 0 off the mask."""
    logp = torch.where(valid, logprobs.detach(), 0.0)
    n = valid.sum().clamp(min=1)
    return torch.where(valid, (advantages - advantages.sum() / n) * (logp - logp.sum() / n), 0.0)


def _cov_count(ratio: float, valid: torch.Tensor) -> int:
    """How many tokens the covariance rules pick: ratio of the response tokens, at least 1 (verl's rule)."""
    return max(int(ratio * int(valid.sum())), 1)


def _random_pick(candidates: torch.Tensor, n: int, generator: torch.Generator | None) -> torch.Tensor:
    """A mask of n of the candidate positions drawn uniformly without replacement (all of them if fewer)."""
    idx = candidates.flatten().nonzero().squeeze(-1)
    if idx.numel() > n:
        idx = idx[torch.randperm(idx.numel(), generator=generator)[:n].to(idx.device)]
    picked = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    picked[idx] = True
    return picked.view_as(candidates)


def _top_k(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """A mask of the k candidate positions with the largest scores (all of them if fewer)."""
    flat = torch.where(candidates, scores, -torch.inf).flatten()
    idx = flat.topk(min(k, int(candidates.sum()))).indices
    picked = torch.zeros_like(flat, dtype=torch.bool)
    picked[idx] = True
    return picked.view_as(candidates)
