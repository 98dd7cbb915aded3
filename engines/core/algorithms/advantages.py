"""Sequence-level advantage estimators (GRPO and the other group baselines), and reward shaping before them.

They take rewards [N] and the samples' groups, and return one advantage per sample [N]; the loss broadcasts it over
the response. `groups` is either group ids [N] (any ints: groups may differ in size and their samples need not be
consecutive) or an int G, shorthand for consecutive groups of G (ids arange(N) // G). Every estimator returns
float32, and exactly 0 (never NaN, never a rounding error) where there is no signal: a group whose rewards are all
equal, and a group of one sample (nothing to compare it with). REINFORCE++-baseline's token form is the exception:
it spreads the centred rewards over the response tokens and whitens them there ([B, T]).
"""

from __future__ import annotations

import math

import torch

from rlflow.engines.core.algorithms.common import broadcast_per_token
from rlflow.engines.core.algorithms.returns import masked_whiten

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
    return masked_whiten(broadcast_per_token(centered, mask.float()), mask, eps)


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
