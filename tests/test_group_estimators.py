"""Group estimators over group ids (unequal sizes, any order), OPO, GRPO pass@k and the adaptive KL controller,
against numbers worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import pytest
import torch

from rlflow.engines.core import algorithms as A

# Three groups, interleaved and of sizes 3, 3 and 1:
#   id 7: samples 0, 2, 4, rewards 1, 2, 1 -> mean 4/3, deviations -1/3, 2/3, -1/3
#   id 3: samples 1, 3, 6, rewards 0, 0, 1 -> mean 1/3, deviations -1/3, -1/3, 2/3
#   id 5: sample 5 alone -> no signal, 0
# unbiased std of either 3-group: sqrt((1/9 + 4/9 + 1/9) / 2) = sqrt(1/3) = 0.577350
R = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 4.0, 1.0])
IDS = torch.tensor([7, 3, 7, 3, 7, 5, 3])
S3 = 3**-0.5
DEV = torch.tensor([-1 / 3, -1 / 3, 2 / 3, -1 / 3, -1 / 3, 0.0, 2 / 3])


def test_grpo_and_dr_grpo_over_group_ids_by_hand():
    assert torch.allclose(A.group_advantages(R, IDS, eps=0.0), DEV / S3, atol=1e-6)
    assert torch.allclose(A.group_advantages(R, IDS, normalize_std=False), DEV, atol=1e-6)
    assert A.group_advantages(R, IDS)[5] == 0.0  # the group of one


def test_rloo_over_group_ids_by_hand():
    # n / (n - 1) * (r - mean) = 1.5 * deviation in the 3-groups; 0 for the group of one
    assert torch.allclose(A.rloo_advantages(R, IDS), 1.5 * DEV, atol=1e-6)


def test_reinforce_pp_baseline_over_group_ids_by_hand():
    # centred values DEV sum to 0; unbiased std over the 7 samples: sqrt((4/9 + 2 * 4/9) / 6) = sqrt(2/9) = 0.471405
    adv = A.reinforce_pp_baseline_seq_advantages(R, IDS, eps=0.0)
    assert torch.allclose(adv, DEV / (2 / 9) ** 0.5, atol=1e-6)
    mask = torch.ones(7, 2)
    tok = A.reinforce_pp_baseline_advantages(R, IDS, mask, eps=0.0)  # equal lengths: the token std is the same
    assert torch.allclose(tok, (DEV / (12 / 9 * 2 / 13) ** 0.5).unsqueeze(-1).expand(7, 2), atol=1e-6)


@pytest.mark.parametrize(
    "fn",
    [
        lambda r, g, n: A.group_advantages(r, g),
        lambda r, g, n: A.group_advantages(r, g, normalize_std=False),
        lambda r, g, n: A.rloo_advantages(r, g),
        lambda r, g, n: A.reinforce_pp_baseline_seq_advantages(r, g),
        lambda r, g, n: A.grpo_passk_advantages(r, g),
        A.opo_advantages,
    ],
    ids=["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline_seq", "grpo_passk", "opo"],
)
def test_group_ids_in_any_order_equal_the_consecutive_layout(fn):
    """Shuffling the samples (with their ids) shuffles the advantages the same way: consecutive groups of 4 given
    as an int and the same groups given as permuted ids agree sample by sample."""
    r = torch.tensor([0.0, 1.0, 1.0, 0.5, 2.0, 2.0, 2.0, 2.0, 0.0, 3.0, 1.0, 0.0])
    lengths = torch.arange(1.0, 13.0)
    consecutive = fn(r, 4, lengths)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    ids = (torch.arange(12) // 4 * 10 + 5)[perm]  # ids 5, 15, 25, not 0..G-1
    assert torch.allclose(fn(r[perm], ids, lengths[perm]), consecutive[perm], atol=1e-6)
    assert consecutive.abs().sum() > 0


def test_group_ids_must_match_the_rewards():
    with pytest.raises(ValueError, match=r"group ids must be integers of shape \(7,\)"):
        A.group_advantages(R, IDS[:6])
    with pytest.raises(ValueError, match="group ids must be integers"):
        A.rloo_advantages(R, IDS.float())


# ----------------------------------------------------------------------------- OPO


def test_opo_length_weighted_baseline_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    ids = torch.tensor([0, 0, 0, 1, 1])
    lengths = torch.tensor([2.0, 4.0, 1.0, 3.0, 1.0])
    # group 0: b = (2*1 + 4*0 + 1*1) / 7 = 3/7 -> 4/7, -3/7, 4/7 (the plain mean 2/3 would give 1/3, -2/3, 1/3)
    # group 1: b = (3*0 + 1*1) / 4 = 1/4 -> -1/4, 3/4
    expected = torch.tensor([4 / 7, -3 / 7, 4 / 7, -0.25, 0.75])
    assert torch.allclose(A.opo_advantages(r, ids, lengths), expected, atol=1e-6)


def test_opo_without_signal_and_empty_responses():
    assert torch.equal(
        A.opo_advantages(torch.tensor([1.0, 1.0, 0.3]), torch.tensor([0, 0, 1]), torch.tensor([2.0, 5.0, 3.0])),
        torch.zeros(3),
    )
    # every response empty: the plain mean
    assert torch.allclose(A.opo_advantages(torch.tensor([1.0, 0.0]), 2, torch.zeros(2)), torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError, match=r"lengths has shape \(3,\); expected \(2,\)"):
        A.opo_advantages(torch.tensor([1.0, 0.0]), 2, torch.ones(3))


# ----------------------------------------------------------------------------- GRPO pass@k


def test_grpo_passk_rewards_only_the_best_by_its_margin():
    r = torch.tensor([0.2, 0.0, 1.0, 0.3, 0.5, 0.1, 0.0])
    ids = torch.tensor([0, 1, 0, 1, 0, 1, 0])
    # group 0 (samples 0, 2, 4, 6): best 1.0 (sample 2), runner-up 0.5 -> margin 0.5
    #   unbiased std of 0.2, 1.0, 0.5, 0.0: mean 0.425, squares .050625 + .330625 + .005625 + .180625 = .5675,
    #   / 3 = .189167 -> 0.434933; 0.5 / 0.434933 = 1.149603
    # group 1 (samples 1, 3, 5): best 0.3 (sample 3), runner-up 0.1 -> margin 0.2
    #   std of 0, 0.3, 0.1: mean .133333, squares .017778 + .027778 + .001111 = .046667, / 2 -> 0.152753; 1.309307
    adv = A.grpo_passk_advantages(r, ids, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, 0.5, 0.2, 0.0, 0.0, 0.0]), atol=1e-6)
    adv = A.grpo_passk_advantages(r, ids, eps=0.0)
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, 1.149603, 1.309307, 0.0, 0.0, 0.0]), atol=1e-5)


def test_grpo_passk_ties_and_single_samples_are_zero():
    # a tie for the best: margin 0; an all-equal group; a group of one
    r = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.7])
    assert torch.equal(A.grpo_passk_advantages(r, torch.tensor([0, 0, 0, 1, 1, 2])), torch.zeros(6))


# ----------------------------------------------------------------------------- ReMax


def test_remax_subtracts_the_greedy_reward_of_each_group():
    r = torch.tensor([1.0, 0.5, 0.0, 0.25, 1.0, 0.75, 0.5])
    ids = torch.tensor([0, 1, 0, 1, 0, 1, 1])
    base = torch.tensor([False, False, True, False, False, False, True])
    # group 0: greedy reward 0.0 (sample 2) -> 1.0, 0, 1.0; group 1: greedy 0.5 (sample 6) -> 0, -0.25, 0.25, 0
    expected = torch.tensor([1.0, 0.0, 0.0, -0.25, 1.0, 0.25, 0.0])
    assert torch.equal(A.remax_advantages(r, ids, base), expected)
    # a group of one sample plus its greedy baseline is enough
    assert torch.equal(A.remax_advantages(torch.tensor([1.0, 0.5]), 2, torch.tensor([False, True])),
                       torch.tensor([0.5, 0.0]))


def test_remax_needs_one_baseline_per_group():
    with pytest.raises(ValueError, match=r"exactly one baseline \(greedy\) sample; found \[1, 0\]"):
        A.remax_advantages(torch.zeros(4), 2, torch.tensor([True, False, False, False]))
    with pytest.raises(ValueError, match=r"baseline has shape \(3,\)"):
        A.remax_advantages(torch.zeros(4), 2, torch.tensor([True, False, True]))


# ----------------------------------------------------------------------------- adaptive KL


@pytest.mark.parametrize(
    "kl, expected",
    [
        (0.15, 0.1 * (1 + 0.2 * 100 / 1000)),  # error 0.5 clipped to 0.2: +2%
        (0.02, 0.1 * (1 - 0.2 * 100 / 1000)),  # error -0.8 clipped to -0.2: -2%
        (0.095, 0.1 * (1 - 0.05 * 100 / 1000)),  # error -0.05: -0.5%
        (0.1, 0.1),  # on target: unchanged
    ],
)
def test_adaptive_kl_coef_by_hand(kl, expected):
    assert A.adaptive_kl_coef(0.1, kl, target=0.1, horizon=1000, n_steps=100) == pytest.approx(expected)


def test_adaptive_kl_coef_rejects_bad_settings():
    with pytest.raises(ValueError, match="target"):
        A.adaptive_kl_coef(0.1, 0.1, target=0.0, horizon=10, n_steps=1)


# ----------------------------------------------------------------------------- pass@k (analytic)


def test_passk_advantages_by_hand():
    # group 0: 4 samples, 2 wrong, k = 2: pass@2 = 1 - C(2,2)/C(4,2) = 5/6, std = sqrt(5/6 * 1/6) = 0.372678
    #   A_correct = (1/6) / std = 0.447214; A_wrong = (1/6 - C(1,1)/C(3,1)) / std = (1/6 - 1/3) / std = -0.447214
    # group 1: 4 samples, 3 wrong: pass@2 = 1 - C(3,2)/C(4,2) = 1/2, std = 1/2
    #   A_correct = 1; A_wrong = (1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3 (zero-sum: 1 - 3 * 1/3)
    r = torch.tensor([1.0, 0.0, 1.0, 0.2, 0.0, 1.0, 0.0, 0.9])
    ids = torch.tensor([0, 1, 0, 0, 1, 1, 1, 0])
    expected = torch.tensor([0.447214, -1 / 3, 0.447214, -0.447214, -1 / 3, 1.0, -1 / 3, -0.447214])
    assert torch.allclose(A.passk_advantages(r, ids, k=2), expected, atol=1e-5)
    # threshold 0.5 counts the 0.9 as correct in group 0 (1 wrong: pass@2 = 1, no signal)
    assert torch.equal(A.passk_advantages(r, ids, k=2, threshold=0.5)[ids == 0], torch.zeros(4))


def test_passk_with_k_1_is_grpo_with_the_population_std():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    p = torch.tensor([0.5, 0.75]).repeat_interleave(4)
    expected = torch.where(r >= 1, (1 - p), -p) / (p * (1 - p)).sqrt()
    assert torch.allclose(A.passk_advantages(r, 4, k=1), expected, atol=1e-6)


def test_passk_without_signal_and_bad_k():
    # all wrong (pass@k 0), all right, and fewer wrong than k (pass@k 1): no signal
    r = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    assert torch.equal(A.passk_advantages(r, 3, k=2), torch.zeros(9))
    with pytest.raises(ValueError, match="a group of 2 samples is smaller than k = 3"):
        A.passk_advantages(torch.zeros(4), 2, k=3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        A.passk_advantages(torch.zeros(4), 2, k=0)
