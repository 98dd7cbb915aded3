"""RL algorithms as pure tensor functions, shared by every train and rollout backend.

Shapes: B sequences, T token positions, V vocabulary. `mask` is 1 on the tokens that are trained on and 0 on
prompt and padding positions. Whatever sits under mask == 0 (even inf or NaN) never reaches a result or a gradient.
Nothing here holds state or does I/O, so each function is tested against numbers worked out by hand.
"""

from __future__ import annotations

import math

import torch

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum", "seq_mean_token_sum")
SUM_AGG_MODES = ("token_sum",)  # no denominator: micro-batch losses add up as they are
# metrics that are loss_agg aggregates of a loss term: over micro-batches they add up like the loss, not like a mean
AGGREGATED_METRICS = frozenset({"loss", "pg_loss", "kl", "entropy", "value_loss", "distill_loss", "distill_kl"})
TOPK_DISTILL_LOSSES = ("forward_kl", "jsd")  # need the teacher's top-k log-probs, not only the sampled token's
LOG_RATIO_CLAMP = 20.0  # |log(p / p_old)| beyond this is clamped (verl's bound): exp() stays finite
GSPO_SEQ_LOG_RATIO_MAX = 10.0  # GSPO's sequence log-ratio is clamped above at this (verl's bound)
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
POLICY_LOSSES = ("ppo", "gspo", "cispo", "gmpo", "sapo", "clip_cov", "kl_cov")
IS_CORRECTIONS = ("none", "tis", "icepop")
IS_LEVELS = ("token", "sequence")
REJECTIONS = ("none", "token", "sequence", "geometric")
DISTILL_LOSSES = ("reverse_kl", "forward_kl", "jsd")


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
    return entropy_from_logprobs(torch.log_softmax(logits.float(), dim=-1))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """The same from log-probabilities already computed (a -inf entry adds 0)."""
    return -(logp.exp() * torch.where(logp.isfinite(), logp, 0.0)).sum(-1)


# ----------------------------------------------------------------------------- advantages
#
# Sequence-level estimators take rewards [N] and the samples' groups, and return one advantage per sample [N]; the
# loss broadcasts it over the response. `groups` is either group ids [N] (any ints: groups may differ in size and
# their samples need not be consecutive) or an int G, shorthand for consecutive groups of G (ids arange(N) // G).
# Token-level ones (REINFORCE++, GAE) take per-token rewards [B, T] and a mask and return [B, T].
# Every estimator returns float32, and exactly 0 (never NaN, never a rounding error) where there is no signal:
# a group whose rewards are all equal, and a group of one sample (nothing to compare it with).

Groups = int | torch.Tensor


def group_advantages(rewards: torch.Tensor, groups: Groups, normalize_std: bool = True, eps: float = 1e-6
                     ) -> torch.Tensor:
    """Advantage of each sample relative to the other samples of its prompt (no value model).

    GRPO (normalize_std=True): (r - group mean) / (group std + eps), with the unbiased sample std (correction=1,
    as torch.std and verl compute it). Dr.GRPO (normalize_std=False): r - group mean, since dividing by the std
    over-weights groups that are almost all right or all wrong.
    A group whose rewards are all equal carries no signal and gets exactly 0.
    """
    g = _group_stats(rewards, groups, "group_advantages")
    adv = g.r - g.mean[g.idx]
    if normalize_std:
        adv = adv / (g.std[g.idx] + eps)
    return g.zero_flat(adv)


def rloo_advantages(rewards: torch.Tensor, groups: Groups) -> torch.Tensor:
    """RLOO: r_i minus the mean reward of the *other* samples of its prompt, = n / (n - 1) * (r_i - group mean)
    for a group of n.

    The baseline does not depend on the sample it is subtracted from, so the policy gradient stays unbiased
    (GRPO's own-group mean includes r_i and shrinks every advantage by (n - 1) / n). A group of one has no other
    sample to compare with and gets 0, like an all-equal group.
    """
    g = _group_stats(rewards, groups, "rloo_advantages")
    n = g.count[g.idx]
    loo_mean = (g.sum[g.idx] - g.r) / (n - 1).clamp(min=1)
    return g.zero_flat(g.r - loo_mean)


def opo_advantages(rewards: torch.Tensor, groups: Groups, lengths: torch.Tensor) -> torch.Tensor:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal reward baseline"): r_i - b with the length-weighted group
    mean b = sum_j(len_j * r_j) / sum_j(len_j) over the prompt's samples.

    With the policy held exactly on-policy, the gradient variance is smallest for a baseline weighted by each
    sample's squared gradient norm, which grows with its length: OPO takes the length as that weight. `lengths`
    [N] are the samples' trained-on response tokens. No std division. A group whose responses are all empty
    falls back to the plain mean.
    """
    g = _group_stats(rewards, groups, "opo_advantages")
    lengths = lengths.float().reshape(-1)
    if lengths.shape != g.r.shape:
        raise ValueError(f"opo_advantages: lengths has shape {tuple(lengths.shape)}; expected ({g.r.numel()},)")
    len_sum = torch.zeros_like(g.sum).index_add_(0, g.idx, lengths)
    weighted = torch.zeros_like(g.sum).index_add_(0, g.idx, lengths * g.r)
    baseline = torch.where(len_sum > 0, weighted / len_sum.clamp(min=1e-12), g.mean)
    return g.zero_flat(g.r - baseline[g.idx])


def grpo_passk_advantages(rewards: torch.Tensor, groups: Groups, normalize_std: bool = True, eps: float = 1e-6
                          ) -> torch.Tensor:
    """GRPO for pass@k (verl's grpo_passk, after arXiv 2503.19595): in each group only the best sample gets an
    advantage, r_max - r_second_max (divided by the group's unbiased reward std + eps with normalize_std); every
    other sample gets 0.

    pass@n of a group counts only its best response, so only that response is reinforced, by its margin over
    the runner-up: the policy is pushed to make at least one of its n samples good instead of all of them
    (more exploration than GRPO). A tie for the best (all-equal groups included) gives 0 to all. The first
    best in batch order is the one rewarded.
    """
    g = _group_stats(rewards, groups, "grpo_passk_advantages")
    order = torch.argsort(g.r, descending=True, stable=True)
    order = order[torch.argsort(g.idx[order], stable=True)]  # group by group, best first within each
    first = torch.ones_like(order, dtype=torch.bool)
    first[1:] = g.idx[order][1:] != g.idx[order][:-1]
    best = order[first]  # one per group, in group order
    second = torch.full_like(g.sum, float("nan"))
    runner = torch.zeros_like(first)
    runner[1:] = first[:-1] & ~first[1:]  # the sample right after a group's best, when the group has one
    second[g.idx[order][runner]] = g.r[order][runner]
    margin = torch.nan_to_num(g.r[best] - second[g.idx[best]], nan=0.0)
    if normalize_std:
        margin = margin / (g.std[g.idx[best]] + eps)
    adv = torch.zeros_like(g.r)
    adv[best] = margin
    return g.zero_flat(adv)


def passk_advantages(rewards: torch.Tensor, groups: Groups, k: int, threshold: float = 1.0) -> torch.Tensor:
    """Pass@k training with analytic advantages (Chen et al. 2025, "Pass@k Training for Adaptively Balancing
    Exploration and Exploitation of Large Reasoning Models", arXiv:2508.10751): the group's reward is pass@k, the
    chance that k of its n samples drawn without replacement hold a correct one, and each sample gets its
    expected advantage under that reward.

    A sample is correct when its reward >= threshold; with n_neg wrong samples in a group of n:
    mean = 1 - C(n_neg, k) / C(n, k), std = sqrt(mean (1 - mean)),
    A_correct = (1 - mean) / std, A_wrong = (1 - mean - C(n_neg - 1, k - 1) / C(n - 1, k - 1)) / std.
    k = 1 is GRPO on 0/1 rewards (with the population std). A group whose pass@k is 0 or 1 (all wrong, or
    fewer than k wrong) gets 0. Every group must hold at least k samples.
    """
    g = _group_stats(rewards, groups, "passk_advantages")
    if k < 1:
        raise ValueError(f"passk_advantages: k must be >= 1, got {k}")
    wrong = g.r < threshold
    n_wrong = torch.zeros_like(g.count).index_add_(0, g.idx, wrong.float())
    a_pos = torch.zeros_like(g.count)
    a_neg = torch.zeros_like(g.count)
    for i, (n, neg) in enumerate(zip(g.count.int().tolist(), n_wrong.int().tolist(), strict=True)):
        if n < k:
            raise ValueError(f"passk_advantages: a group of {n} samples is smaller than k = {k}")
        mean = 1.0 - math.comb(neg, k) / math.comb(n, k)
        if mean in (0.0, 1.0):
            continue
        std = math.sqrt(mean * (1.0 - mean))
        a_pos[i] = (1.0 - mean) / std
        a_neg[i] = (1.0 - mean - (math.comb(neg - 1, k - 1) / math.comb(n - 1, k - 1) if neg else 0.0)) / std
    return torch.where(wrong, a_neg[g.idx], a_pos[g.idx])


def remax_advantages(rewards: torch.Tensor, groups: Groups, baseline: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2023, arXiv:2310.10505): r - r_greedy, the reward of the group's greedy response as the
    baseline of the group's sampled responses; the greedy sample itself (baseline [N] true) gets 0.

    The greedy response is what the policy would answer without exploration, so a sample beats the baseline
    when sampling found something better than the policy's own mode. Needs no value model, and one sample per
    prompt already has a baseline. Every group must hold exactly one baseline sample.
    """
    g = _group_stats(rewards, groups, "remax_advantages")
    base = torch.as_tensor(baseline, device=g.r.device).bool().reshape(-1)
    if base.shape != g.r.shape:
        raise ValueError(f"remax_advantages: baseline has shape {tuple(base.shape)}; expected ({g.r.numel()},)")
    per_group = torch.zeros_like(g.count).index_add_(0, g.idx[base], torch.ones_like(g.r[base]))
    if (per_group != 1).any():
        raise ValueError(f"remax_advantages: every group needs exactly one baseline (greedy) sample; "
                         f"found {per_group.int().tolist()} per group")
    b = torch.zeros_like(g.count)
    b[g.idx[base]] = g.r[base]
    return torch.where(base, 0.0, g.r - b[g.idx])


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, groups: Groups, mask: torch.Tensor, eps: float = 1e-6
                                     ) -> torch.Tensor:
    """REINFORCE++-baseline as verl and OpenRLHF compute it: r - group mean, broadcast over the response tokens,
    then whitened (token-weighted mean and std) over every response token of the batch [B, T].

    The group mean removes each prompt's difficulty; one batch-wide scale (instead of GRPO's per-group std) keeps
    it stable without over-weighting groups that are nearly all right or all wrong. Whitening over tokens
    weights each sample by its length, and subtracts the token mean, so with ragged lengths a sample's sign can
    differ from its centred reward's. `reinforce_pp_baseline_seq_advantages` is the per-sample variant.
    """
    g = _group_stats(rewards, groups, "reinforce_pp_baseline_advantages")
    centered = g.zero_flat(g.r - g.mean[g.idx])
    return masked_whiten(_per_token(centered, mask.float()), mask, eps)


def reinforce_pp_baseline_seq_advantages(rewards: torch.Tensor, groups: Groups, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline over samples [N]: r - group mean, divided by the std of those centred values over
    the batch's samples (each sample once, unbiased; no mean subtracted). All-equal groups are exactly 0 and an
    all-zero batch stays 0. Unlike the token-whitened form, a sample's length does not change its advantage."""
    g = _group_stats(rewards, groups, "reinforce_pp_baseline_seq_advantages")
    centered = g.zero_flat(g.r - g.mean[g.idx])
    if centered.numel() < 2 or not centered.any():
        return centered
    return centered / (centered.std() + eps)


def equal_reward_groups(rewards: torch.Tensor, groups: Groups) -> torch.Tensor:
    """bool [number of groups]: which groups' rewards are all equal (no group-relative signal), groups in the
    order of their sorted ids."""
    return _group_stats(rewards, groups, "equal_reward_groups").flat


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [B, T] from one reward per sequence [B]: the reward sits on the last token under the mask.

    This is what turns an outcome reward into the token rewards that discounted returns and GAE expect. A row with
    an empty mask has nowhere to put its reward and is all 0.
    """
    valid = mask > 0
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    last = mask.shape[-1] - 1 - valid.flip(-1).int().argmax(dim=-1)  # argmax gives the first hit of the flip
    rows = valid.any(dim=-1).nonzero().squeeze(-1)
    out[rows, last[rows]] = rewards.float().to(out.device)[rows]
    return out


def kl_reward_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kl_coef: float, estimator: str
) -> torch.Tensor:
    """KL in the reward: kl_coef * KL(policy || reference) per token [B, T], 0 off the mask, a constant (no grad).

    Subtract it from the token rewards (or its row sum from a sequence reward) before the advantages, so drifting
    from the reference costs return instead of adding a loss term. `logprobs` are the behaviour policy's: the
    tokens were sampled from it.
    """
    kl = kl_penalty(logprobs.detach().float(), ref_logprobs.float(), estimator)
    return _masked(kl_coef * kl, mask).detach()


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


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum over later response tokens s >= t of gamma^(steps from t to s) * r_s, per token [B, T].

    Positions under mask == 0 are not steps: they get 0, add no reward and no discount, and the return passes
    through them, so a tool output masked out in the middle of a multi-turn response does not cut the credit of
    the tokens before it.
    """
    valid = mask > 0
    r = torch.where(valid, token_rewards.float(), 0.0)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(valid[:, t], running, 0.0)
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(values - mean) / (std + eps) over every token under the mask of the batch; 0 off the mask.

    Unbiased std, as torch.std. If all masked values are equal (or there are fewer than two) the result is
    exactly 0: the batch carries no signal, and a rounding error must not turn into a full-size advantage.
    """
    valid = mask > 0
    x = values.float()
    n = valid.sum()
    picked = x[valid]
    if n < 2 or bool((picked == picked[0]).all()):
        return torch.zeros_like(x)
    mean = picked.mean()
    std = picked.std()
    return torch.where(valid, (x - mean) / (std + eps), 0.0)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++: discounted returns per token, whitened over all response tokens of the batch [B, T].

    No critic and no group: the batch mean is the baseline and the batch std the scale, which is what makes it
    work with one sample per prompt. With KL in the reward each token's return also carries the KL penalties of
    the tokens after it (see kl_reward_penalty).
    """
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask, eps)


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation for a critic: (advantages, returns), each [B, T], 0 off the mask.

    delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next, where "next" is the next token
    under the mask (masked positions are skipped, as in discounted_returns) and V after the last token is 0.
    returns = A + V are the value targets. lam = 1 gives Monte-Carlo returns minus V; lam = 0 the one-step TD error.
    Whiten the advantages (masked_whiten) in the caller if the recipe wants it. Values are constants here.
    """
    valid = mask > 0
    r = torch.where(valid, token_rewards.float(), 0.0)
    v = torch.where(valid, values.detach().float(), 0.0)
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(valid[:, t], a_t, 0.0)
        next_value = torch.where(valid[:, t], v[:, t], next_value)
        next_adv = torch.where(valid[:, t], a_t, next_adv)
    return adv, torch.where(valid, adv + v, 0.0)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the tokens under the mask: the share of the returns' variance
    the critic's values explain. 1 is a perfect critic, 0 one no better than the mean return, below 0 worse.
    0 when the returns do not vary (nothing to explain) or fewer than two tokens are masked in."""
    valid = mask > 0
    r, v = returns.float()[valid], values.float()[valid]
    if r.numel() < 2:
        return torch.tensor(0.0)
    var = r.var(unbiased=False)
    if var == 0:
        return torch.tensor(0.0)
    return 1 - (r - v).var(unbiased=False) / var


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward [N] (values in [-penalty, 0]).

    0 up to max_len - buffer tokens, then falling linearly to -penalty at max_len (and staying there beyond), so
    responses that run into the length limit are discouraged gradually instead of being cut off with no signal.
    buffer 0 or penalty 0 disables it.
    """
    if buffer <= 0 or penalty == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if buffer > max_len:
        raise ValueError(f"overlong_penalty: buffer {buffer} is longer than max_len {max_len}")
    exceed = (lengths.float() - (max_len - buffer)).clamp(min=0.0)
    return -(exceed / buffer).clamp(max=1.0) * penalty


# ----------------------------------------------------------------------------- loss aggregation


def aggregate_loss(values: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: int | None = None) -> torch.Tensor:
    """Reduce per-token values [B, T] to a scalar. Empty masks contribute nothing (0, not NaN).

    token_mean:              sum(values * mask) / sum(mask); long responses weigh more (DAPO).
    token_sum:               sum(values * mask), no denominator: the loss grows with the batch's tokens (newer
                             verl's token-sum; for per-token weights that already carry their normalisation).
    seq_mean_token_mean:     masked mean per sequence, then mean over sequences with >= 1 token (original GRPO).
    seq_mean_token_sum:      masked sum per sequence, then mean over sequences with >= 1 token (verl's
                             seq-mean-token-sum): a long response counts its length times more than a short one.
    seq_mean_token_sum_norm: masked sum per sequence / norm_len, then mean over sequences with >= 1 token
                             (Dr.GRPO: a constant norm_len, e.g. max_new_tokens, removes the length bias).
    """
    _check_mode(mode)
    weighted = _masked(values, mask)
    mask = mask.to(weighted.dtype)
    if mode == "token_mean":
        return weighted.sum() / mask.sum().clamp(min=1)
    if mode == "token_sum":
        return weighted.sum()
    tokens_per_seq = mask.sum(-1)
    non_empty = tokens_per_seq > 0
    seq_sum = weighted.sum(-1)
    if mode == "seq_mean_token_mean":
        per_seq = seq_sum / tokens_per_seq.clamp(min=1)
    elif mode == "seq_mean_token_sum":
        per_seq = seq_sum
    else:
        if norm_len is None or norm_len <= 0:
            raise ValueError(
                f"aggregate_loss: mode 'seq_mean_token_sum_norm' needs norm_len > 0 (e.g. max_new_tokens), "
                f"got {norm_len}"
            )
        per_seq = seq_sum / norm_len
    return per_seq.sum() / non_empty.sum().clamp(min=1)  # empty rows have per_seq == 0


def aggregation_weight(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What a batch counts for under `mode`: its tokens (token_mean, token_sum) or its non-empty sequences
    (seq_mean_*): the denominator of the normalised modes, additive over any split of the batch.

    Data-parallel workers and micro-batches scale their loss with micro_batch_scales, so the sum of their
    gradients equals the gradient of one aggregate over the whole mini-batch.
    """
    _check_mode(mode)
    if mode in ("token_mean", "token_sum"):
        return mask.sum()
    return (mask.sum(-1) > 0).sum().to(mask.dtype)


def micro_batch_scales(micro_mask: torch.Tensor, total_weight: torch.Tensor, mode: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss scale, share) of one micro-batch of a mini-batch whose aggregation_weight, summed over every
    data-parallel rank, is total_weight (float64).

    share = the micro-batch's weight / total_weight. Its aggregate_loss times the loss scale, summed over the
    micro-batches and ranks (FSDP and Megatron add the ranks' gradients), is the aggregate of the whole
    mini-batch: the loss scale is the share for the normalised modes (each micro-batch divided by its own count
    instead of the mini-batch's) and 1 for token_sum, whose sums already add up. Metrics combine with
    scale_metrics.
    """
    share = aggregation_weight(micro_mask, mode).double() / total_weight.double().clamp(min=1)
    return (torch.ones_like(share) if mode in SUM_AGG_MODES else share), share


def scale_metrics(metrics: dict[str, torch.Tensor], loss_scale: torch.Tensor, share: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """One micro-batch's metrics, weighted so that summing them over micro-batches and ranks gives the
    mini-batch's: loss terms (AGGREGATED_METRICS) add up like the loss (loss scale), every other metric is a
    token mean averaged with the micro-batch's share. float64, detached."""
    return {k: v.detach().double() * (loss_scale if k in AGGREGATED_METRICS else share) for k, v in metrics.items()}


# ----------------------------------------------------------------------------- KL, importance weights


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
    log_ratio, _ = _log_ratio(train_logprobs.detach(), rollout_logprobs, valid)  # unknown: ratio 1
    ratio = log_ratio.exp()
    level_ratio = ratio
    if level == "sequence":
        level_ratio = _per_token(_seq_log_ratio(log_ratio, valid).exp(), ratio)
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
    train/rollout ratio leaves [low, high] are rejected: rejection sampling against the rollout/train mismatch.

    Unlike an IcePop weight of 0, a rejected token leaves the loss mask itself (multiply the loss mask by the
    result before the loss), so it is not in any denominator either, as verl's rollout_rs removes it from the
    response mask.
      none:      keep every token.
      token:     drop the tokens whose ratio p_train / p_rollout is outside the bounds.
      sequence:  drop a whole sequence when its ratio exp(sum of log-ratios) is outside (verl's seq_sum_k1).
      geometric: drop a whole sequence when its per-token geometric mean ratio exp(mean log-ratio) is outside
                 (verl's seq_mean_k1): length-normalised, so long sequences are not rejected for their length.
    A token whose rollout logprob is not finite counts as ratio 1. Metrics: reject_token_frac (share of response
    tokens dropped) and reject_seq_frac (share of non-empty sequences that lost at least one token).
    """
    if level not in REJECTIONS:
        raise ValueError(f"rejection_mask: unknown level {level!r}; expected one of {', '.join(REJECTIONS)}")
    valid = mask > 0
    log_ratio, _ = _log_ratio(train_logprobs.detach(), rollout_logprobs, valid)
    if level == "token":
        stat = log_ratio.exp()
    elif level == "sequence":
        stat = _per_token(_seq_log_ratio(log_ratio, valid).exp(), log_ratio)
    elif level == "geometric":
        mean_log_ratio = torch.where(valid, log_ratio, 0.0).sum(-1) / valid.sum(-1).clamp(min=1)
        stat = _per_token(mean_log_ratio.exp(), log_ratio)
    else:
        stat = torch.ones_like(log_ratio)
    keep = valid & (stat >= low) & (stat <= high)
    rows = valid.any(-1)
    dropped_rows = (valid & ~keep).any(-1)
    metrics = {
        "reject_token_frac": masked_mean((valid & ~keep).float(), mask),
        "reject_seq_frac": dropped_rows[rows].float().sum() / rows.sum().clamp(min=1),
    }
    return keep.float(), metrics


def _seq_log_ratio(log_ratio: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each sequence's log-ratio [B]: the sum of its tokens' (already 0 off the mask), clamped so exp() stays
    finite."""
    return torch.where(valid, log_ratio, 0.0).sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


# ----------------------------------------------------------------------------- losses


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
    valid, advantages, log_ratio, known = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    metrics: dict[str, torch.Tensor] = {}
    if clip_ratio_c is not None:
        cap = -clip_ratio_c * advantages
        dual = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
        metrics["dual_clip_frac"] = masked_mean(dual.float(), mask)
    loss = aggregate_loss(_weighted(per_token, token_weights, valid), mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics |= _ratio_metrics(log_ratio, ratio, clipped < unclipped, known, mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: PPO-clip on the sequence ratio s = exp(mean over response tokens of log(p / p_old)).

    The geometric mean keeps s near 1 whatever the length, so the clip range is tiny (paper: 3e-4 / 4e-4) and
    clips whole sequences: one noisy token ratio cannot move or stop a sequence's update on its own. Token-level
    form (GSPO-token): s_t = sg(s) * p(y_t) / sg(p(y_t)) has value s and d s_t / d log p(y_t) = s, so with
    seq_mean_token_mean (the paper's 1/|y| normalisation) the gradient equals sequence-level GSPO, and per-token
    advantages [B, T] are allowed. Per token: -min(s_t * A, clip(s_t, 1 - clip_low, 1 + clip_high) * A).
    Token log-ratios are clamped and non-finite old logprobs handled as in policy_loss; the sequence log-ratio is
    clamped above at GSPO_SEQ_LOG_RATIO_MAX (verl's bound).
    Metrics as policy_loss; ratio_mean and clip_frac are over tokens, each token carrying its sequence's s.
    """
    valid, advantages, log_ratio, known = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    n_tokens = known.sum(dim=-1, keepdim=True).clamp(min=1)  # the mean over tokens whose old logprob is known
    seq_log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / n_tokens).detach().clamp(max=GSPO_SEQ_LOG_RATIO_MAX)
    # value: s; gradient: s * d log p(y_t). The subtraction is 0 in value but carries the token's gradient.
    token_log_ratio = torch.where(known, seq_log_ratio + (logprobs - logprobs.detach()), 0.0)
    ratio = token_log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate_loss(_weighted(per_token, token_weights, valid), mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, clipped < unclipped, known, mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * log p per token, then aggregated.

    PPO's clip takes the whole gradient from a token whose ratio left the band, and in long reasoning those are
    often the rare tokens that matter (a "wait" that starts a reflection), which then never learn. CISPO clips
    the importance weight instead, under stop-gradient: every token keeps the policy gradient A * d log p, scaled
    by a bounded weight. The paper sets no lower bound (clip_low >= 1) and tunes clip_high only; it normalises by
    the batch's tokens (token_mean). Log-ratios are clamped as in policy_loss; a token whose old logprob is not
    finite gets weight 1 and no gradient.
    Metrics as policy_loss; clip_frac is the share of tokens whose weight was clipped (they still train).
    """
    valid, advantages, log_ratio, known = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()
    trained = torch.where(known, logprobs, logprobs.detach())
    per_token = -weight * advantages * trained
    loss = aggregate_loss(_weighted(per_token, token_weights, valid), mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, weight != ratio, known, mask)
    return loss, metrics


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (geometric-mean policy optimisation): each sequence's objective is A times the geometric mean of its
    tokens' clipped ratios, s = exp(mean over tokens of c_t), instead of GRPO's arithmetic mean of ratio * A.

    c_t is the token log-ratio clipped in log space on the side PPO's min would clip: for A >= 0 at most
    clip_high, for A < 0 at least -clip_low (paper: 0.4 both, the ratio band (e^-0.4, e^0.4)); a clipped token
    gets no gradient. One outlier ratio moves a geometric mean far less than an arithmetic one, so updates stay
    stable with a band wider than PPO's. Token form as in gspo_loss: s_t = exp(sg(mean c) + c_t - sg(c_t)) has
    value s and gradient s * d c_t, so with seq_mean_token_mean (the paper's mean over sequences) value and
    gradient equal the sequence objective -A * s; per-token advantages [B, T] clip each token by its own sign.
    The mean runs over tokens whose old logprob is known (the others: ratio 1, no gradient).
    Metrics as policy_loss; clip_frac is the share of tokens whose log-ratio was clipped (no gradient), ratio_mean
    over tokens, each carrying its sequence's s.
    """
    valid, advantages, log_ratio, known = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    upper = advantages >= 0  # the side of the band that can stop a token's gradient
    clipped = known & torch.where(upper, log_ratio > clip_high, log_ratio < -clip_low)
    clipped_log_ratio = torch.where(clipped, torch.where(upper, clip_high, -clip_low), log_ratio)
    n_tokens = known.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (clipped_log_ratio.sum(dim=-1, keepdim=True) / n_tokens).detach()
    token_log_ratio = seq_log_ratio + (clipped_log_ratio - clipped_log_ratio.detach())
    ratio = torch.where(known, token_log_ratio, 0.0).exp()
    per_token = -ratio * advantages
    loss = aggregate_loss(_weighted(per_token, token_weights, valid), mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, clipped & (advantages != 0), known, mask)
    return loss, metrics


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
    valid, advantages, log_ratio, known = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = log_ratio.exp()
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1))
    per_token = -(4 / tau) * gate * advantages
    loss = aggregate_loss(_weighted(per_token, token_weights, valid), mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, torch.zeros_like(valid), known, mask)
        metrics["gate_weight_mean"] = masked_mean(4 * gate * (1 - gate), mask)
    return loss, metrics


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"): PPO-clip, and a few
    high-covariance tokens lose their gradient.

    The policy's entropy falls when confident tokens (high log p) get high advantages; the per-token covariance
    cov_t = (A_t - mean A) * (log p_t - mean log p), means over the batch's response tokens, drives that collapse.
    max(1, int(clip_cov_ratio * response tokens)) tokens, drawn at random among those with
    clip_cov_lb < cov_t < clip_cov_ub that PPO's clip has not already stopped, get loss 0 and no gradient
    (paper: 2e-4, bounds 1 and 5, with a PPO band of 1 either side). Covariance and draw are over the batch given:
    a backend's micro-batch, as in verl. The draw uses `generator` (default: torch's global RNG, which the train
    backends checkpoint). Log-ratios and unknown old logprobs as in policy_loss; such tokens are never drawn.
    Metrics as policy_loss plus cov_frac, the share of tokens whose gradient the covariance rule detached.
    """
    valid, advantages, log_ratio, known = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    with torch.no_grad():
        cov = _token_covariance(logprobs, advantages, valid)
        candidates = known & ~(clipped < unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        detached = _random_pick(candidates, _cov_count(clip_cov_ratio, valid), generator)
    per_token = torch.where(detached, 0.0, -torch.minimum(unclipped, clipped))
    loss = aggregate_loss(_weighted(per_token, token_weights, valid), mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, clipped < unclipped, known, mask)
        metrics["cov_frac"] = masked_mean(detached.float(), mask)
    return loss, metrics


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025): the unclipped policy gradient -ratio * A per token, plus
    kl_cov_coef * |log(p / p_old)| on the max(1, int(kl_cov_ratio * response tokens)) tokens with the largest
    covariance cov_t (see clip_cov_loss).

    Instead of stopping the tokens that would collapse the entropy, the penalty holds them near the old policy,
    while every other token takes the plain policy gradient: there is no ratio clip (clip_low / clip_high do not
    apply). The authors' recipes: kl_cov_ratio 2e-3 (7B) and 2e-4 (32B), coefficient 1 (verl's ppo_kl_coef).
    Top-k over the batch given (a backend's micro-batch, as in verl), among tokens whose old logprob is known.
    Metrics as policy_loss (clip_frac is 0) plus cov_frac, the share of tokens penalised.
    """
    valid, advantages, log_ratio, known = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = log_ratio.exp()
    with torch.no_grad():
        cov = _token_covariance(logprobs, advantages, valid)
        penalised = _top_k(cov, known, _cov_count(kl_cov_ratio, valid))
    per_token = -ratio * advantages + torch.where(penalised, kl_cov_coef * log_ratio.abs(), 0.0)
    loss = aggregate_loss(_weighted(per_token, token_weights, valid), mask, loss_agg, norm_len)
    with torch.no_grad():
        metrics = _ratio_metrics(log_ratio, ratio, torch.zeros_like(valid), known, mask)
        metrics["cov_frac"] = masked_mean(penalised.float(), mask)
    return loss, metrics


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
        loss = aggregate_loss(_weighted(per_token, token_weights, valid), mask, loss_agg, norm_len)
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


# ----------------------------------------------------------------------------- helpers


def _policy_inputs(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every policy loss starts from: (valid, advantages per token as constants with 0 off the mask,
    log-ratio and known as _log_ratio gives them)."""
    valid = mask > 0
    advantages = torch.where(valid, _per_token(advantages, logprobs).detach(), 0.0)
    log_ratio, known = _log_ratio(logprobs, old_logprobs, valid)
    return valid, advantages, log_ratio, known


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


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, valid: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log(p / p_old) clamped to +-LOG_RATIO_CLAMP where the token is trained on and p_old is known, else 0 with
    no gradient; where it was known). Garbage off the mask and an old logprob of -inf cannot overflow exp() and
    send NaN into the loss or the backward pass."""
    known = valid & torch.isfinite(old_logprobs)
    ratio = torch.where(known, logprobs - old_logprobs.detach(), 0.0)
    return ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), known


def _ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, known: torch.Tensor,
                   mask: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "clip_frac": masked_mean(clipped.float(), mask),
        "approx_kl_k1": masked_mean(-log_ratio, mask),
        "approx_kl_k2": masked_mean(0.5 * log_ratio.pow(2), mask),
        "ratio_mean": masked_mean(ratio, mask),
        "nonfinite_old_frac": masked_mean((~known).float(), mask),
    }


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values over the mask; 0 for an empty mask; garbage off the mask never shows."""
    return _masked(values, mask).sum() / mask.sum().to(values.dtype).clamp(min=1)


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values * mask, with exact zeros off the mask (a plain product would turn inf or NaN padding into NaN)."""
    return torch.where(mask > 0, values * mask, 0.0)


def _weighted(per_token: torch.Tensor, weights: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor:
    if weights is None:
        return per_token
    return per_token * torch.where(valid, weights.detach(), 0.0)


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


class _GroupStats:
    """Per-group sums, counts, means, unbiased stds [G] of rewards [N], and each sample's group index idx [N]
    (0..G-1, groups ordered by id). A group of one has std 0 and counts as all-equal (`flat`)."""

    def __init__(self, r: torch.Tensor, idx: torch.Tensor, num: int):
        self.r, self.idx = r, idx
        self.count = torch.zeros(num, dtype=r.dtype, device=r.device).index_add_(0, idx, torch.ones_like(r))
        self.sum = torch.zeros_like(self.count).index_add_(0, idx, r)
        self.mean = self.sum / self.count.clamp(min=1)
        sq = torch.zeros_like(self.count).index_add_(0, idx, (r - self.mean[idx]).pow(2))
        self.std = (sq / (self.count - 1).clamp(min=1)).sqrt()
        lo = torch.full_like(self.count, torch.inf).scatter_reduce(0, idx, r, "amin")
        hi = torch.full_like(self.count, -torch.inf).scatter_reduce(0, idx, r, "amax")
        self.flat = lo == hi

    def zero_flat(self, adv: torch.Tensor) -> torch.Tensor:
        """Exactly 0 for samples of all-equal groups (r - mean can be a rounding error, not 0)."""
        return adv.masked_fill(self.flat[self.idx], 0.0)


def _group_stats(rewards: torch.Tensor, groups: Groups, name: str) -> _GroupStats:
    r = rewards.float().reshape(-1)
    n = r.numel()
    if isinstance(groups, int):
        if groups < 1 or n % groups:
            raise ValueError(
                f"{name}: {n} rewards do not split into groups of {groups}; "
                "N must be num_groups * group_size, laid out group by group (or pass group ids)"
            )
        idx = torch.arange(n, device=r.device) // groups
        return _GroupStats(r, idx, n // groups)
    ids = torch.as_tensor(groups, device=r.device)
    if ids.shape != (n,) or ids.is_floating_point():
        raise ValueError(f"{name}: group ids must be integers of shape ({n},), one per reward; "
                         f"got {ids.dtype} of shape {tuple(ids.shape)}")
    uniq, idx = torch.unique(ids, return_inverse=True)
    return _GroupStats(r, idx, uniq.numel())


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
