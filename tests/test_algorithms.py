"""Algorithms against numbers worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from rlflow.engines.core import algorithms as A

INF, NAN = float("inf"), float("nan")
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- token_logprobs, entropy


def test_token_logprobs_by_hand():
    # position 0: logits [0, ln 3] -> probs [1/4, 3/4], target 1 -> ln 0.75
    # position 1: logits [ln 2, ln 2] -> uniform, target 0 -> ln 0.5
    logits = torch.tensor([[[0.0, math.log(3.0)], [LN2, LN2]]])
    lp = A.token_logprobs(logits, torch.tensor([[1, 0]]))
    assert lp.shape == (1, 2)
    assert torch.allclose(lp, torch.tensor([[math.log(0.75), math.log(0.5)]]), atol=1e-6)


def test_token_logprobs_is_float32_for_bf16_logits():
    # logits [0, 1, 2] are exact in bf16; target 2 -> 2 - ln(1 + e + e^2) = -0.407606
    logits = torch.tensor([[[0.0, 1.0, 2.0]]], dtype=torch.bfloat16)
    lp = A.token_logprobs(logits, torch.tensor([[2]]))
    assert lp.dtype == torch.float32
    assert lp.item() == pytest.approx(2 - math.log(1 + math.e + math.e**2), abs=1e-6)


def test_token_logprobs_match_float64_to_1e6():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=g)).to(torch.bfloat16)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert (A.token_logprobs(logits, targets).double() - ref).abs().max().item() < 1e-6


def test_entropy_by_hand():
    # [0, ln 3] -> p = [1/4, 3/4]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335; uniform over 4 -> ln 4
    logits = torch.tensor([[[0.0, math.log(3.0), -INF, -INF], [5.0, 5.0, 5.0, 5.0]]], dtype=torch.bfloat16)
    ent = A.entropy_from_logits(logits)
    assert ent.dtype == torch.float32 and ent.shape == (1, 2)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert torch.allclose(ent, torch.tensor([[h, math.log(4.0)]]), atol=1e-3)  # ln 3 is rounded in bf16


def test_entropy_with_masked_vocab_has_finite_gradient():
    # [0, 0, -inf]: p = [1/2, 1/2, 0] -> H = ln 2. dH/dz_i = -p_i (ln p_i + H) = -1/2 (-ln 2 + ln 2) = 0, and 0
    # for the masked entry: the whole gradient is exactly 0, not NaN.
    logits = torch.tensor([[[0.0, 0.0, -INF]]], requires_grad=True)
    ent = A.entropy_from_logits(logits)
    assert ent.item() == pytest.approx(LN2, abs=1e-6)
    ent.sum().backward()
    assert torch.allclose(logits.grad, torch.zeros(1, 1, 3), atol=1e-7)


# ----------------------------------------------------------------------------- group_advantages


def test_grpo_advantages_by_hand():
    # group 1: [1, 0, 0, 1]: mean 0.5, deviations +-0.5, unbiased var (4 * 0.25) / 3 = 1/3, std 0.577350
    #          -> +-0.5 / 0.577350 = +-0.866025
    # group 2: [1, 1, 1, 1]: all equal -> exactly 0
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    s = 0.5 / math.sqrt(1 / 3)
    adv = A.group_advantages(r, 4, normalize_std=True, eps=0.0)
    assert torch.allclose(adv, torch.tensor([s, -s, -s, s, 0, 0, 0, 0]), atol=1e-6)
    assert torch.equal(adv[4:], torch.zeros(4))
    # default eps 1e-6: 0.5 / (0.577350 + 1e-6) = 0.866024
    adv = A.group_advantages(r, 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (math.sqrt(1 / 3) + 1e-6), atol=1e-7)


def test_grpo_std_is_unbiased():
    # [0, 2]: mean 1; correction=1 -> std sqrt((1 + 1) / 1) = sqrt 2 -> -+1/sqrt 2 = -+0.707107
    # (the biased std, 1, would give -+1)
    adv = A.group_advantages(torch.tensor([0.0, 2.0]), 2, eps=0.0)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0]) / math.sqrt(2.0), atol=1e-6)


def test_dr_grpo_advantages_are_centered_only():
    # group 1: [1, 0, 0, 1] mean 0.5 -> [0.5, -0.5, -0.5, 0.5]; group 2: [3, 1, 1, 1] mean 1.5 -> [1.5, -0.5, ...]
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 1.0, 1.0])
    adv = A.group_advantages(r, 4, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 1.5, -0.5, -0.5, -0.5]), atol=1e-7)


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_all_equal_groups_are_exactly_zero(normalize_std, eps):
    # 0.1 is not exact in binary: 0.1 - mean(0.1, 0.1, 0.1) may be off by a rounding error; it must still be 0
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.0, 0.0, 0.0])
    adv = A.group_advantages(r, 3, normalize_std=normalize_std, eps=eps)
    assert torch.equal(adv, torch.zeros(9))


def test_group_of_one_is_zero():
    assert torch.equal(A.group_advantages(torch.tensor([1.0, 0.0, 0.5]), 1), torch.zeros(3))


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="4 rewards do not split into groups of 3"):
        A.group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="groups of 0"):
        A.group_advantages(torch.zeros(4), 0)


# ----------------------------------------------------------------------------- rloo, reinforce++ (baseline)


def test_rloo_advantages_by_hand():
    # group 1 [1, 0, 0, 1]: r = 1 vs the others' mean (0 + 0 + 1) / 3 = 1/3 -> +2/3; r = 0 vs 2/3 -> -2/3
    # group 2 [3, 1, 1, 1]: r = 3 vs 1 -> +2; r = 1 vs (3 + 1 + 1) / 3 = 5/3 -> -2/3
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 1.0, 1.0])
    t = 2 / 3
    expected = torch.tensor([t, -t, -t, t, 2.0, -t, -t, -t])
    assert torch.allclose(A.rloo_advantages(r, 4), expected, atol=1e-6)
    # = G / (G - 1) * Dr.GRPO's r - mean: 4/3 * 0.5 = 2/3, 4/3 * 1.5 = 2
    assert torch.allclose(A.rloo_advantages(r, 4), A.group_advantages(r, 4, normalize_std=False) * 4 / 3, atol=1e-6)


def test_rloo_no_signal_is_exactly_zero():
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])  # all-equal groups: 0, not a rounding error
    assert torch.equal(A.rloo_advantages(r, 3), torch.zeros(6))
    assert torch.equal(A.rloo_advantages(torch.tensor([1.0, 0.0]), 1), torch.zeros(2))  # no other sample
    # group of 2: each sample's baseline is the other one: [1, 0] -> [1, -1]
    assert torch.equal(A.rloo_advantages(torch.tensor([1.0, 0.0]), 2), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="rloo_advantages: 5 rewards do not split into groups of 2"):
        A.rloo_advantages(torch.zeros(5), 2)


def test_reinforce_pp_baseline_seq_by_hand():
    # centred per group: [0.5, -0.5, -0.5, 0.5 | 1.5, -0.5, -0.5, -0.5]; their mean is 0,
    # sum of squares 4 * 0.25 + 2.25 + 3 * 0.25 = 4, unbiased batch var 4 / 7 -> std 0.755929
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 1.0, 1.0])
    centred = torch.tensor([0.5, -0.5, -0.5, 0.5, 1.5, -0.5, -0.5, -0.5])
    adv = A.reinforce_pp_baseline_seq_advantages(r, 4, eps=0.0)
    assert torch.allclose(adv, centred / math.sqrt(4 / 7), atol=1e-6)  # 0.661438, 1.984313, ...
    # GRPO would divide group 2 by its own std (0.866025 / 1 for 1.5): one batch std keeps the groups' scale
    assert not torch.allclose(adv, A.group_advantages(r, 4, eps=0.0))


def test_reinforce_pp_baseline_seq_counts_all_equal_groups_in_the_batch_std():
    # [1, 0 | 1, 1]: centred [0.5, -0.5, 0, 0]; batch std over 4 samples: sqrt(0.5 / 3) = 0.408248
    # -> 0.5 / 0.408248 = 1.224745; the all-equal group stays exactly 0
    adv = A.reinforce_pp_baseline_seq_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]) * 0.5 / math.sqrt(0.5 / 3), atol=1e-6)
    assert torch.equal(adv[2:], torch.zeros(2))


def test_reinforce_pp_baseline_whitens_over_response_tokens_as_verl():
    """verl / OpenRLHF: the centred reward on every response token, then one token-weighted mean and std.
    Ragged lengths move the mean, so a short sample's positive centred reward can turn negative."""
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])  # groups of 2: centred [0.5, -0.5, 0, 0]
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])  # lengths 1, 4, 2, 3
    # tokens: 0.5 once, -0.5 four times, 0 five times: mean -1.5 / 10 = -0.15; squares around it:
    # (0.65^2 + 4 * 0.35^2 + 5 * 0.15^2) = 0.4225 + 0.49 + 0.1125 = 1.025, unbiased var 1.025 / 9
    std = math.sqrt(1.025 / 9)
    adv = A.reinforce_pp_baseline_advantages(r, 2, mask, eps=0.0)
    expect = torch.tensor([[0.65, 0, 0, 0], [-0.35] * 4, [0.15, 0.15, 0, 0], [0.15, 0.15, 0.15, 0]]) / std
    assert torch.allclose(adv, expect * mask, atol=1e-6)
    assert adv[2, 0] > 0  # the all-equal group's tokens sit above the token mean: positive, not 0
    seq = A.reinforce_pp_baseline_seq_advantages(r, 2)
    assert seq[2] == 0 and (adv[2, :2] != 0).all()  # the difference the issue names


@pytest.mark.parametrize("group_size", [1, 3])
def test_reinforce_pp_baseline_without_signal_is_zero(group_size):
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])  # every group all-equal (or groups of one): 0, not 0 / 0
    assert torch.equal(A.reinforce_pp_baseline_seq_advantages(r, group_size), torch.zeros(6))
    assert torch.equal(A.reinforce_pp_baseline_seq_advantages(torch.tensor([0.3]), 1), torch.zeros(1))
    mask = torch.ones(6, 3)
    assert torch.equal(A.reinforce_pp_baseline_advantages(r, group_size, mask), torch.zeros(6, 3))


# ----------------------------------------------------------------------------- token rewards, returns, whitening

# Row 0: 3 tokens after a prompt token; row 1: tokens at 1 and 3 with a masked tool output at 2; row 2: empty.
TOK_MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])


def test_outcome_token_rewards_sit_on_the_last_masked_token():
    out = A.outcome_token_rewards(torch.tensor([1.0, 0.5, 7.0]), TOK_MASK)
    # row 0 ends at 3; row 1's last masked token is 3 (not the gap at 2); the empty row has nowhere to put 7
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    # right padding: [1, 1, 0] ends at 1
    out = A.outcome_token_rewards(torch.tensor([2.0]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert torch.equal(out, torch.tensor([[0.0, 2.0, 0.0]]))


def test_discounted_returns_by_hand():
    # rewards on the last token, garbage under the mask
    rewards = torch.tensor([[NAN, 0.0, 0.0, 1.0], [INF, 0.5, 99.0, 1.0], [NAN, NAN, INF, 1.0]])
    # gamma 1: every token gets the sum of the rewards from it on: row 0 [1, 1, 1]; row 1: 0.5 + 1 = 1.5, 1
    ret = A.discounted_returns(rewards, TOK_MASK, 1.0)
    assert torch.equal(ret, torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.5, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    # gamma 0.5: row 0 [0.25, 0.5, 1]; row 1: the masked position is not a step -> 0.5 + 0.5 * 1 = 1.0 (not 0.75)
    ret = A.discounted_returns(rewards, TOK_MASK, 0.5)
    assert torch.equal(ret, torch.tensor([[0.0, 0.25, 0.5, 1.0], [0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))


def test_masked_whiten_by_hand():
    # masked values [1, 1, 1, 0]: mean 0.75, deviations [.25, .25, .25, -.75], unbiased var 0.75 / 3 = 0.25 -> std 0.5
    values = torch.tensor([[NAN, 1.0, 1.0, 1.0], [INF, 0.0, 5.0, NAN]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    out = A.masked_whiten(values, mask, eps=0.0)
    assert torch.equal(out, torch.tensor([[0.0, 0.5, 0.5, 0.5], [0.0, -1.5, 0.0, 0.0]]))


@pytest.mark.parametrize(
    "values, mask",
    [
        (torch.tensor([[0.1, 0.1, 9.0], [0.1, NAN, 0.1]]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])),  # equal
        (torch.tensor([[3.0, NAN]]), torch.tensor([[1.0, 0.0]])),  # one token: no spread to divide by
        (torch.tensor([[3.0, NAN]]), torch.zeros(1, 2)),  # nothing under the mask
    ],
)
def test_masked_whiten_without_signal_is_zero(values, mask):
    assert torch.equal(A.masked_whiten(values, mask), torch.zeros_like(values))


def test_reinforce_pp_advantages_by_hand():
    # outcome rewards [1, 0, 5(empty row)] on the last token; gamma 1 -> returns [1, 1, 1 | 0, -, 0] on the tokens
    # tokens [1, 1, 1, 0, 0]: mean 0.6, deviations [.4, .4, .4, -.6, -.6], unbiased var 1.2 / 4 = 0.3
    token_rewards = A.outcome_token_rewards(torch.tensor([1.0, 0.0, 5.0]), TOK_MASK)
    adv = A.reinforce_pp_advantages(token_rewards, TOK_MASK, gamma=1.0, eps=0.0)
    s = math.sqrt(0.3)
    expected = torch.tensor([[0.0, 0.4 / s, 0.4 / s, 0.4 / s], [0.0, -0.6 / s, 0.0, -0.6 / s], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-6)
    # gamma 0.5: row 0 returns [0.25, 0.5, 1], row 1 [0, 0]: tokens [.25, .5, 1, 0, 0], mean 0.35,
    # deviations [-.1, .15, .65, -.35, -.35], sum of squares .01 + .0225 + .4225 + .1225 + .1225 = 0.7, var 0.175
    adv = A.reinforce_pp_advantages(token_rewards, TOK_MASK, gamma=0.5, eps=0.0)
    s = math.sqrt(0.175)
    expected = torch.tensor([[0.0, -0.1, 0.15, 0.65], [0.0, -0.35, 0.0, -0.35], [0.0, 0.0, 0.0, 0.0]]) / s
    assert torch.allclose(adv, expected, atol=1e-6)


def test_reinforce_pp_all_equal_rewards_give_zero():
    token_rewards = A.outcome_token_rewards(torch.tensor([1.0, 1.0, 1.0]), TOK_MASK)
    assert torch.equal(A.reinforce_pp_advantages(token_rewards, TOK_MASK), torch.zeros(3, 4))
    assert torch.equal(A.reinforce_pp_advantages(token_rewards, torch.zeros(3, 4)), torch.zeros(3, 4))


def test_kl_reward_penalty_by_hand():
    logp = torch.tensor([[NAN, math.log(0.5), math.log(0.25)]], requires_grad=True)
    ref = torch.tensor([[INF, math.log(0.25), math.log(0.5)]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    # k1 * 0.1: 0.1 ln 2 and -0.1 ln 2; the prompt position is 0 whatever sits there
    pen = A.kl_reward_penalty(logp, ref, mask, 0.1, "k1")
    assert torch.allclose(pen, torch.tensor([[0.0, 0.1 * LN2, -0.1 * LN2]]), atol=1e-7) and not pen.requires_grad
    # k3 * 0.1: q/p = 0.5 -> 0.5 + ln 2 - 1; q/p = 2 -> 2 - ln 2 - 1
    pen = A.kl_reward_penalty(logp, ref, mask, 0.1, "k3")
    assert torch.allclose(pen, torch.tensor([[0.0, 0.1 * (LN2 - 0.5), 0.1 * (1 - LN2)]]), atol=1e-7)
    # in the reward: reward 1 at the last token, minus each token's penalty; the sequence total is 1 - sum
    token_rewards = A.outcome_token_rewards(torch.tensor([1.0]), mask) - pen
    assert torch.allclose(token_rewards, torch.tensor([[0.0, -0.1 * (LN2 - 0.5), 1 - 0.1 * (1 - LN2)]]), atol=1e-7)


# ----------------------------------------------------------------------------- gae, value loss


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    # gamma = lam = 1: deltas (from the end) 1 - 0.7 = 0.3, 0.7 - 0.6 = 0.1, 0.6 - 0.5 = 0.1
    # -> A = [0.5, 0.4, 0.3], returns A + V = [1, 1, 1] (the Monte-Carlo return)
    adv, ret = A.gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.4, 0.3]]), atol=1e-6)
    assert torch.allclose(ret, torch.ones(1, 3), atol=1e-6)
    # gamma = lam = 0.5: t2: delta 0.3, A 0.3; t1: delta 0.5 * 0.7 - 0.6 = -0.25, A = -0.25 + 0.25 * 0.3 = -0.175
    # t0: delta 0.5 * 0.6 - 0.5 = -0.2, A = -0.2 + 0.25 * -0.175 = -0.24375
    adv, ret = A.gae_advantages(r, v, m, gamma=0.5, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[-0.24375, -0.175, 0.3]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.25625, 0.425, 1.0]]), atol=1e-6)
    # lam 0: A is the one-step TD error: [-0.2, -0.25, 0.3]
    adv, _ = A.gae_advantages(r, v, m, gamma=0.5, lam=0.0)
    assert torch.allclose(adv, torch.tensor([[-0.2, -0.25, 0.3]]), atol=1e-6)


def test_gae_skips_masked_positions_and_empty_rows():
    # row 0: a masked tool output at 1 with garbage reward and value; gamma = lam = 1:
    # t2: delta 1 - 0.7 = 0.3; t0 looks past t1 to t2: delta 0.7 - 0.5 = 0.2, A 0.2 + 0.3 = 0.5
    r = torch.tensor([[0.0, NAN, 1.0], [INF, NAN, 3.0]])
    v = torch.tensor([[0.5, NAN, 0.7], [NAN, INF, 1.0]], requires_grad=True)
    m = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    adv, ret = A.gae_advantages(r, v, m)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.0, 0.3], [0.0, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), atol=1e-6)
    assert not adv.requires_grad and not ret.requires_grad


@pytest.mark.parametrize(
    "v, old, ret, loss, grad, clipped",
    [
        # 0.5 (V - R)^2; clip range 0.2 around V_old. d loss / dV = V - R when the unclipped term is chosen
        (1.0, 0.5, 0.6, 0.08, 0.4, 0.0),  # unclipped .5 * .4^2 = .08 > clipped (V_clip .7) .5 * .1^2 = .005
        (0.9, 0.5, 1.0, 0.045, 0.0, 1.0),  # unclipped .005 < clipped (V_clip .7) .5 * .3^2 = .045: no gradient
        (0.6, 0.5, 1.0, 0.08, -0.4, 0.0),  # inside the range: V_clip = V, both .5 * .4^2 = .08
    ],
)
def test_value_loss_clipping_branches(v, old, ret, loss, grad, clipped):
    values = torch.tensor([[v]], requires_grad=True)
    got, m = A.value_loss(values, torch.tensor([[old]]), torch.tensor([[ret]]), torch.ones(1, 1), clip_range=0.2)
    got.backward()
    assert got.item() == pytest.approx(loss, abs=1e-6)
    assert values.grad.item() == pytest.approx(grad, abs=1e-6)
    assert m["vf_clip_frac"].item() == clipped


def test_value_loss_without_clip_and_with_padding():
    values = torch.tensor([[0.9, NAN], [INF, -INF]], requires_grad=True)
    old = torch.tensor([[0.5, INF], [NAN, 0.0]])
    returns = torch.tensor([[1.0, NAN], [NAN, INF]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    # no clip: 0.5 * 0.1^2 = 0.005 (clipping at 0.2 would give 0.045); the empty row and padding add nothing
    loss, m = A.value_loss(values, old, returns, mask)
    assert loss.item() == pytest.approx(0.005, abs=1e-7) and m["vf_clip_frac"].item() == 0.0
    assert m["value_mean"].item() == pytest.approx(0.9)
    loss.backward()
    assert torch.allclose(values.grad, torch.tensor([[-0.1, 0.0], [0.0, 0.0]]), atol=1e-6)
    for agg in A.LOSS_AGG_MODES:
        loss, m = A.value_loss(values, old, returns, torch.zeros(2, 2), 0.2, agg, norm_len=2)
        assert loss.item() == 0.0 and all(torch.isfinite(x) for x in m.values())


# ----------------------------------------------------------------------------- overlong shaping


def test_overlong_penalty_by_hand():
    # max 8, buffer 3: free up to 5 tokens, then -1/3 per token to -1 at 8, -1 beyond
    lengths = torch.tensor([0, 5, 6, 7, 8, 9])
    pen = A.overlong_penalty(lengths, max_len=8, buffer=3, penalty=1.0)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -1 / 3, -2 / 3, -1.0, -1.0]), atol=1e-7)
    assert torch.allclose(A.overlong_penalty(lengths, 8, 3, 0.5), pen * 0.5)
    assert torch.equal(A.overlong_penalty(lengths, 8, 0, 1.0), torch.zeros(6))  # disabled
    assert torch.equal(A.overlong_penalty(lengths, 8, 3, 0.0), torch.zeros(6))  # disabled
    with pytest.raises(ValueError, match="buffer 9 is longer than max_len 8"):
        A.overlong_penalty(lengths, 8, 9, 1.0)


# ----------------------------------------------------------------------------- aggregate_loss

# Row 0: 2 tokens, row 1: 1 token, row 2: empty response. Garbage (inf, NaN, 99) under mask 0 must never show.
VALUES = torch.tensor([[1.0, 2.0, INF], [3.0, NAN, 99.0], [NAN, -INF, 99.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_aggregation_modes_by_hand():
    # token_mean: (1 + 2 + 3) / 3 tokens = 2
    assert A.aggregate_loss(VALUES, MASK, "token_mean").item() == pytest.approx(2.0)
    # seq_mean_token_mean: row means 1.5 and 3; the empty row is ignored -> (1.5 + 3) / 2 = 2.25 (not 4.5 / 3)
    assert A.aggregate_loss(VALUES, MASK, "seq_mean_token_mean").item() == pytest.approx(2.25)
    # Dr.GRPO, norm_len 4: row sums 3 and 3 -> (3/4 + 3/4) / 2 = 0.75
    assert A.aggregate_loss(VALUES, MASK, "seq_mean_token_sum_norm", norm_len=4).item() == pytest.approx(0.75)
    # a bool mask means the same
    assert A.aggregate_loss(VALUES, MASK.bool(), "seq_mean_token_mean").item() == pytest.approx(2.25)
    # token_sum: 1 + 2 + 3 = 6, no denominator
    assert A.aggregate_loss(VALUES, MASK, "token_sum").item() == pytest.approx(6.0)
    # seq_mean_token_sum (verl's seq-mean-token-sum): row sums 3 and 3, mean over the 2 non-empty rows = 3
    assert A.aggregate_loss(VALUES, MASK, "seq_mean_token_sum").item() == pytest.approx(3.0)


def test_aggregation_modes_differ_on_lengths():
    # a long row of 1s (4 tokens) and a short row [1] (1 token), norm_len 4
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert A.aggregate_loss(values, mask, "token_mean").item() == pytest.approx(1.0)  # 5 / 5
    assert A.aggregate_loss(values, mask, "seq_mean_token_mean").item() == pytest.approx(1.0)  # (1 + 1) / 2
    # Dr.GRPO: (4/4 + 1/4) / 2 = 0.625
    assert A.aggregate_loss(values, mask, "seq_mean_token_sum_norm", norm_len=4).item() == pytest.approx(0.625)
    assert A.aggregate_loss(values, mask, "token_sum").item() == pytest.approx(5.0)  # 4 + 1
    # row sums 4 and 1: (4 + 1) / 2 = 2.5, the long row counts 4 times the short one
    assert A.aggregate_loss(values, mask, "seq_mean_token_sum").item() == pytest.approx(2.5)


def test_aggregation_gradient_skips_padding():
    values = VALUES.clone().requires_grad_(True)
    A.aggregate_loss(values, MASK, "token_mean").backward()
    # d/dv = mask / 3 tokens; padding (inf / NaN) gets exactly 0
    assert torch.equal(values.grad, MASK / 3)
    values.grad = None
    A.aggregate_loss(values, MASK, "seq_mean_token_mean").backward()
    # row 0: 1 / (2 seqs * 2 tokens) = 0.25 per token; row 1: 1 / (2 * 1) = 0.5
    assert torch.equal(values.grad, torch.tensor([[0.25, 0.25, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    values.grad = None
    A.aggregate_loss(values, MASK, "token_sum").backward()
    assert torch.equal(values.grad, MASK)  # every token 1, padding 0
    values.grad = None
    A.aggregate_loss(values, MASK, "seq_mean_token_sum").backward()
    # every token 1 / 2 non-empty sequences, whatever its row's length
    assert torch.equal(values.grad, MASK / 2)


@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
def test_aggregation_of_all_empty_is_zero_not_nan(mode):
    assert A.aggregate_loss(VALUES, torch.zeros(3, 3), mode, norm_len=3).item() == 0.0


def test_aggregation_errors():
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'.*token_mean, seq_mean_token_mean"):
        A.aggregate_loss(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match="needs norm_len"):
        A.aggregate_loss(VALUES, MASK, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="needs norm_len"):
        A.aggregate_loss(VALUES, MASK, "seq_mean_token_sum_norm", norm_len=0)


def test_aggregation_weight():
    # tokens for token_mean, non-empty sequences otherwise
    assert A.aggregation_weight(MASK, "token_mean").item() == 3
    assert A.aggregation_weight(MASK, "seq_mean_token_mean").item() == 2
    assert A.aggregation_weight(MASK, "seq_mean_token_sum_norm").item() == 2
    assert A.aggregation_weight(MASK, "token_sum").item() == 3
    assert A.aggregation_weight(MASK, "seq_mean_token_sum").item() == 2
    with pytest.raises(ValueError, match="'bogus'"):
        A.aggregation_weight(MASK, "bogus")


@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
def test_micro_batches_and_ranks_add_up_to_the_whole_batch(mode):
    """What the train backends do: every micro-batch's aggregate times its loss scale, summed over micro-batches
    and data-parallel ranks, equals the aggregate of the whole mini-batch, in value and gradient; the "loss"
    metric adds up the same way and, for the token modes, a token-mean metric averages exactly."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(7, 5, generator=g).requires_grad_(True)
    lengths = torch.tensor([5, 1, 0, 3, 4, 2, 5])  # ragged, one empty row
    mask = (torch.arange(5) < lengths[:, None]).float()
    whole = A.aggregate_loss(values, mask, mode, norm_len=5)
    (whole_grad,) = torch.autograd.grad(whole, values)
    ranks = [[[0, 1], [2, 3]], [[4], [5, 6]]]  # 2 ranks, uneven micro-batches
    total = sum(A.aggregation_weight(mask[sum(rank, [])], mode).double() for rank in ranks)  # the all-reduce
    parts, metrics = [], []
    for rank in ranks:
        for rows in rank:
            part = A.aggregate_loss(values[rows], mask[rows], mode, norm_len=5)
            loss_scale, share = A.micro_batch_scales(mask[rows], total, mode)
            parts.append(part * loss_scale.float())
            metrics.append(A.scale_metrics({"loss": part, "m": A.masked_mean(values[rows], mask[rows])},
                                           loss_scale, share))
    split = torch.stack(parts).sum()
    (split_grad,) = torch.autograd.grad(split, values)
    assert split.item() == pytest.approx(whole.item(), abs=1e-6)
    assert torch.allclose(split_grad, whole_grad, atol=1e-7)
    assert sum(m["loss"] for m in metrics).item() == pytest.approx(whole.item(), abs=1e-6)
    if mode in ("token_mean", "token_sum"):
        assert sum(m["m"] for m in metrics).item() == pytest.approx(A.masked_mean(values, mask).item(), abs=1e-6)


def test_micro_batch_scales_by_hand():
    # MASK: 3 tokens in 2 non-empty rows; a mini-batch of 12 tokens / 8 sequences over all ranks
    scale, share = A.micro_batch_scales(MASK, torch.tensor(12.0, dtype=torch.float64), "token_mean")
    assert scale.item() == share.item() == 0.25  # 3 / 12
    scale, share = A.micro_batch_scales(MASK, torch.tensor(8.0, dtype=torch.float64), "seq_mean_token_sum")
    assert scale.item() == share.item() == 0.25  # 2 / 8
    scale, share = A.micro_batch_scales(MASK, torch.tensor(12.0, dtype=torch.float64), "token_sum")
    assert scale.item() == 1.0 and share.item() == 0.25  # a sum adds up as it is; metrics still average
    m = A.scale_metrics({"loss": torch.tensor(6.0), "kl": torch.tensor(2.0), "clip_frac": torch.tensor(0.5)},
                        scale, share)
    assert m == {"loss": 6.0, "kl": 2.0, "clip_frac": 0.125} and all(v.dtype == torch.float64 for v in m.values())


# ----------------------------------------------------------------------------- kl_penalty


def test_kl_estimators_by_hand():
    p, q = torch.tensor([math.log(0.5), math.log(0.25)]), torch.tensor([math.log(0.25), math.log(0.5)])
    # k1 = ln p - ln q: ln 0.5 - ln 0.25 = ln 2; ln 0.25 - ln 0.5 = -ln 2
    assert torch.allclose(A.kl_penalty(p, q, "k1"), torch.tensor([LN2, -LN2]), atol=1e-6)
    # k3 = q/p - ln(q/p) - 1: q/p = 0.5 -> 0.5 + ln 2 - 1 = 0.193147; q/p = 2 -> 2 - ln 2 - 1 = 0.306853
    assert torch.allclose(A.kl_penalty(p, q, "k3"), torch.tensor([0.5 + LN2 - 1, 2 - LN2 - 1]), atol=1e-6)
    assert A.kl_penalty(q, q, "k3").eq(0).all()
    with pytest.raises(ValueError, match="unknown estimator 'k9'.*k1, k2, k3, low_var_kl"):
        A.kl_penalty(p, q, "k9")


def test_k3_clamps_as_verl_does():
    # ref - logp = -100 -> log-ratio clamped to -20: e^-20 + 20 - 1 = 19.000000002 -> result clamped to 10
    # ref - logp = +100 -> clamped to 20: e^20 - 20 - 1 = 485165174.41 -> 10 (verl's k3 is its low_var_kl)
    kl = A.kl_penalty(torch.tensor([0.0, -100.0, 0.0]), torch.tensor([-100.0, 0.0, -3.0]), "k3")
    assert torch.equal(kl[:2], torch.tensor([10.0, 10.0]))
    assert kl[2].item() == pytest.approx(math.exp(-3) + 3 - 1, abs=1e-6)  # inside the bounds: plain k3
    assert torch.equal(kl, A.kl_penalty(torch.tensor([0.0, -100.0, 0.0]), torch.tensor([-100.0, 0.0, -3.0]),
                                         "low_var_kl"))


def test_kl_gradient_reaches_logprobs_only():
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)], requires_grad=True)
    # d k3 / d logp = 1 - e^(ref - logp) = 1 - 0.5 = 0.5
    A.kl_penalty(logp, ref, "k3").sum().backward()
    assert logp.grad.item() == pytest.approx(0.5) and ref.grad is None


def test_k2_and_low_var_kl_by_hand():
    p, q = torch.tensor([math.log(0.5), math.log(0.25)]), torch.tensor([math.log(0.25), math.log(0.5)])
    # k2 = (ln p - ln q)^2 / 2 = (+-ln 2)^2 / 2 = 0.240227 for both
    assert torch.allclose(A.kl_penalty(p, q, "k2"), torch.full((2,), 0.5 * LN2**2), atol=1e-6)
    # low_var_kl = k3 where k3 is within [-10, 10]: 0.193147, 0.306853
    assert torch.allclose(A.kl_penalty(p, q, "low_var_kl"), torch.tensor([0.5 + LN2 - 1, 2 - LN2 - 1]), atol=1e-6)
    # a far-drifted policy's k3 would be 19 and e^20 - 21; both are capped at 10
    far = A.kl_penalty(torch.tensor([0.0, -100.0]), torch.tensor([-100.0, 0.0]), "low_var_kl")
    assert torch.equal(far, torch.tensor([10.0, 10.0]))


def test_k2_and_low_var_kl_gradients():
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    # d k2 / d logp = ln p - ln q = ln 0.5 - ln 0.25 = ln 2
    A.kl_penalty(logp, torch.tensor([math.log(0.25)]), "k2").sum().backward()
    assert logp.grad.item() == pytest.approx(LN2, abs=1e-6)
    # a capped low_var_kl token gives no gradient (k3's would be 1 - e^20)
    far = torch.tensor([-100.0], requires_grad=True)
    A.kl_penalty(far, torch.tensor([0.0]), "low_var_kl").sum().backward()
    assert far.grad.item() == 0.0


# ----------------------------------------------------------------------------- importance_weights

# train / rollout probabilities 0.5/0.5, 0.5/0.2, 0.9/0.3, 0.1/0.5 -> ratios 1, 2.5, 3, 0.2; then padding
IS_TRAIN = torch.tensor([[math.log(0.5), math.log(0.5), math.log(0.9), math.log(0.1), NAN]])
IS_ROLLOUT = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.3), math.log(0.5), INF]])
IS_MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
# k3 of KL(rollout || train): mean of r - 1 - ln r = (0 + 1.5 - ln 2.5 + 2 - ln 3 - 0.8 - ln 0.2) / 4
#   = (2.7 + ln(2/3)) / 4 = 0.573634
MISMATCH_KL = (2.7 + math.log(2 / 3)) / 4


def test_tis_weights_by_hand():
    w, m = A.importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "tis", tis_cap=2.0)
    # min(ratio, 2): [1, 2, 2, 0.2]; padding 0
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 2.0, 0.2, 0.0]]), atol=1e-6)
    assert m["is_clip_frac"].item() == pytest.approx(0.5)  # 2.5 and 3 truncated, of 4 tokens
    assert m["is_weight_mean"].item() == pytest.approx(5.2 / 4, abs=1e-6)
    assert m["is_ratio_mean"].item() == pytest.approx(6.7 / 4, abs=1e-6)
    assert m["mismatch_kl"].item() == pytest.approx(MISMATCH_KL, abs=1e-6)
    assert "is_mask_frac" not in m


def test_icepop_weights_by_hand():
    w, m = A.importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "icepop", icepop_low=0.5, icepop_high=5.0)
    # inside [0.5, 5]: the ratio itself; 0.2 is outside -> 0
    assert torch.allclose(w, torch.tensor([[1.0, 2.5, 3.0, 0.0, 0.0]]), atol=1e-6)
    assert m["is_mask_frac"].item() == pytest.approx(0.25)
    assert m["is_weight_mean"].item() == pytest.approx(6.5 / 4, abs=1e-6)
    assert m["mismatch_kl"].item() == pytest.approx(MISMATCH_KL, abs=1e-6)
    # a tighter band [0.5, 2.8] also drops the 3
    w, m = A.importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "icepop", icepop_low=0.5, icepop_high=2.8)
    assert torch.allclose(w, torch.tensor([[1.0, 2.5, 0.0, 0.0, 0.0]]), atol=1e-6)
    assert m["is_mask_frac"].item() == pytest.approx(0.5)


def test_importance_weights_none_measures_only():
    w, m = A.importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "none")
    assert torch.equal(w, IS_MASK)
    assert m.keys() == {"is_weight_mean", "is_ratio_mean", "mismatch_kl"}
    assert m["mismatch_kl"].item() == pytest.approx(MISMATCH_KL, abs=1e-6)
    with pytest.raises(ValueError, match="unknown mode 'mis'.*none, tis, icepop"):
        A.importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "mis")


@pytest.mark.parametrize("mode", A.IS_CORRECTIONS)
def test_importance_weights_are_constants_and_empty_masks_are_zero(mode):
    train = IS_TRAIN.clone().requires_grad_(True)
    w, m = A.importance_weights(train, IS_ROLLOUT, IS_MASK, mode)
    assert not w.requires_grad and all(not v.requires_grad for v in m.values())
    # same ratio -> weight 1 under every mode, no mismatch
    w, m = A.importance_weights(IS_ROLLOUT, IS_ROLLOUT, IS_MASK, mode)
    assert torch.equal(w, IS_MASK) and m["mismatch_kl"].item() == 0.0
    w, m = A.importance_weights(IS_TRAIN, IS_ROLLOUT, torch.zeros(1, 5), mode)
    assert torch.equal(w, torch.zeros(1, 5)) and all(v.item() == 0.0 for v in m.values())


# ----------------------------------------------------------------------------- policy_loss


def _ratio_case(ratio: float, adv: float, clip_low: float = 0.2, clip_high: float = 0.28):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, m = A.policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), clip_low, clip_high)
    loss.backward()
    return loss.item(), logp.grad.item(), m["clip_frac"].item()


@pytest.mark.parametrize(
    "ratio, adv, loss, grad, clipped",
    [
        # clip range [0.8, 1.28]. loss = -min(ratio * A, clip(ratio) * A); d loss / d logp = -ratio * A if unclipped
        (1.5, 1.0, -1.28, 0.0, 1.0),  # A > 0 above 1.28: min(1.5, 1.28) = 1.28 clipped, no gradient
        (1.25, 1.0, -1.25, -1.25, 0.0),  # A > 0 inside clip-higher (would clip at 1.2 if symmetric)
        (0.5, 1.0, -0.5, -0.5, 0.0),  # A > 0 below 0.8: min(0.5, 0.8) = 0.5, unclipped, gradient flows
        (0.75, -1.0, 0.8, 0.0, 1.0),  # A < 0 below 0.8: min(-0.75, -0.8) = -0.8 clipped, no gradient
        (0.85, -1.0, 0.85, 0.85, 0.0),  # A < 0 inside: min(-0.85, -0.85) -> unclipped, grad 0.85
        (1.5, -1.0, 1.5, 1.5, 0.0),  # A < 0 above 1.28: min(-1.5, -1.28) = -1.5 unclipped, gradient flows
        (1.5, 0.0, 0.0, 0.0, 0.0),  # A = 0: nothing to learn
    ],
)
def test_ppo_clip_asymmetric_branches(ratio, adv, loss, grad, clipped):
    got_loss, got_grad, got_clip = _ratio_case(ratio, adv)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_grad == pytest.approx(grad, abs=1e-6)
    assert got_clip == clipped


def test_ppo_symmetric_clip_clips_at_1_2():
    # same ratio 1.25, A = 1, but clip_high 0.2: min(1.25, 1.2) = 1.2 -> loss -1.2, clipped
    assert _ratio_case(1.25, 1.0, 0.2, 0.2) == (pytest.approx(-1.2), 0.0, 1.0)


def test_policy_loss_ignores_padding_and_reports_metrics():
    logp = torch.tensor([[0.0, 0.1, 7.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, -90.0, INF]])  # e^(7 + 90) would overflow if padding were not zeroed first
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    loss, m = A.policy_loss(logp, old, torch.tensor([2.0]), mask)
    # ratios 1 and e^0.1 = 1.105171 (inside 1.2): loss = -(2 * 1 + 2 * 1.105171) / 2 = -2.105171
    assert loss.item() == pytest.approx(-(2 + 2 * math.exp(0.1)) / 2, abs=1e-6)
    assert m["approx_kl_k2"].item() == pytest.approx(0.5 * 0.1**2 / 2, abs=1e-7)  # 0.5 * (0 + 0.01) / 2 tokens
    assert m["approx_kl_k1"].item() == pytest.approx(-0.1 / 2, abs=1e-7)  # (0 - 0.1) / 2 tokens: log p_old - log p
    assert m["ratio_mean"].item() == pytest.approx((1 + math.exp(0.1)) / 2, abs=1e-6)
    assert m["clip_frac"].item() == 0.0
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    loss.backward()
    # d/dlogp = -A * ratio / 2 tokens: -1 and -e^0.1; padding exactly 0
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -math.exp(0.1), 0.0, 0.0]]), atol=1e-6)


def test_policy_loss_token_advantages_and_clip_frac():
    # ratios [1.5, 1.0, 1.0(pad)], A [1, 1, garbage]: first token clipped at 1.2 -> loss -(1.2 + 1) / 2 = -1.1
    logp = torch.tensor([[math.log(1.5), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = A.policy_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, NAN]]), mask)
    assert loss.item() == pytest.approx(-1.1, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(0.5)  # 1 of 2 tokens
    # [B] advantages broadcast over tokens gives the same
    loss_b, _ = A.policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask)
    assert loss_b.item() == pytest.approx(-1.1, abs=1e-6)


def test_policy_loss_dr_grpo_normalisation():
    # ratio 1 everywhere, A = [+1, -1]; row 0 has 3 tokens, row 1 has 1 -> per-token loss -A
    # token_mean: (-3 + 1) / 4 = -0.5; seq_mean_token_mean: (-1 + 1) / 2 = 0
    # seq_mean_token_sum_norm, norm_len 4: (-3/4 + 1/4) / 2 = -0.25
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    assert A.policy_loss(logp, torch.zeros(2, 3), adv, mask)[0].item() == pytest.approx(-0.5)
    assert A.policy_loss(logp, torch.zeros(2, 3), adv, mask, loss_agg="seq_mean_token_mean")[0].item() == 0.0
    loss, _ = A.policy_loss(logp, torch.zeros(2, 3), adv, mask, loss_agg="seq_mean_token_sum_norm", norm_len=4)
    assert loss.item() == pytest.approx(-0.25)
    loss.backward()
    # every token weighs 1 / (norm_len 4 * 2 sequences) = 0.125, whatever its row's length: -A * 0.125
    assert torch.equal(logp.grad, torch.tensor([[-0.125, -0.125, -0.125], [0.125, 0.0, 0.0]]))


@pytest.mark.parametrize(
    "ratio, adv, loss, grad, dual",
    [
        # clip [0.8, 1.28], dual clip c = 3: for A < 0 the loss is capped at -3 * A
        (4.0, -1.0, 3.0, 0.0, 1.0),  # plain PPO: -min(-4, -1.28) = 4 -> capped at 3, no gradient
        (3.5, -2.0, 6.0, 0.0, 1.0),  # plain 7 -> capped at 6
        (2.0, -1.0, 2.0, 2.0, 0.0),  # plain 2 < 3: unchanged, d/dlogp = -ratio * A = 2
        (0.5, -1.0, 0.8, 0.0, 0.0),  # A < 0 below 0.8: PPO's own clip (0.8), not the dual one
        (4.0, 1.0, -1.28, 0.0, 0.0),  # A > 0: dual clip does not apply
    ],
)
def test_dual_clip_by_hand(ratio, adv, loss, grad, dual):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    got, m = A.policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), 0.2, 0.28,
                           clip_ratio_c=3.0)
    got.backward()
    assert got.item() == pytest.approx(loss, abs=1e-5)
    assert logp.grad.item() == pytest.approx(grad, abs=1e-5)
    assert m["dual_clip_frac"].item() == dual


def test_dual_clip_off_by_default_and_validated():
    logp = torch.tensor([[math.log(4.0)]])
    loss, m = A.policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(4.0) and "dual_clip_frac" not in m
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        A.policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), clip_ratio_c=1.0)


def test_policy_loss_token_weights():
    # ratio 1, A = 1, weights [2, 0.5, garbage]: per-token -2 and -0.5 -> token_mean -1.25 (denominator 2 tokens)
    logp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = A.policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask,
                            token_weights=torch.tensor([[2.0, 0.5, NAN]]))
    assert loss.item() == pytest.approx(-1.25)
    loss.backward()
    assert torch.equal(logp.grad, torch.tensor([[-1.0, -0.25, 0.0]]))  # -A * ratio * w / 2


# ----------------------------------------------------------------------------- gspo

# row 0: token log-ratios [0.2, -0.1] -> s = e^0.05 = 1.051271, A = +1
# row 1: one token, log-ratio 0.3 -> s = e^0.3 = 1.349859, A = -1; row 2: empty, garbage everywhere
GSPO_LOGP = torch.tensor([[0.2, -0.1], [0.3, NAN], [INF, NAN]])
GSPO_OLD = torch.tensor([[0.0, 0.0], [0.0, INF], [-INF, 5.0]])
GSPO_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
GSPO_ADV = torch.tensor([1.0, -1.0, NAN])
S0, S1 = math.exp(0.05), math.exp(0.3)


def test_gspo_by_hand_unclipped():
    logp = GSPO_LOGP.clone().requires_grad_(True)
    loss, m = A.gspo_loss(logp, GSPO_OLD, GSPO_ADV, GSPO_MASK, 0.5, 0.5, "seq_mean_token_mean")
    # per token -s * A: row 0 mean -1.051271, row 1 +1.349859 -> (-1.051271 + 1.349859) / 2 = 0.149294
    assert loss.item() == pytest.approx((-S0 + S1) / 2, abs=1e-6)
    assert m["clip_frac"].item() == 0.0
    assert m["ratio_mean"].item() == pytest.approx((2 * S0 + S1) / 3, abs=1e-6)  # each token carries its s
    loss.backward()
    # every token of a row gets the same gradient -s * A / (2 rows * |y|): -1.051271 / 4 = -0.262818; 1.349859 / 2
    expected = torch.tensor([[-S0 / 4, -S0 / 4], [S1 / 2, 0.0], [0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_gspo_clips_whole_sequences():
    logp = GSPO_LOGP.clone().requires_grad_(True)
    loss, m = A.gspo_loss(logp, GSPO_OLD, GSPO_ADV, GSPO_MASK)  # paper range [1 - 3e-4, 1 + 4e-4]
    # row 0: A > 0 and s above 1.0004 -> clipped at 1.0004, both tokens get no gradient (PPO would clip only the
    # first, ratio e^0.2, and keep training the second, e^-0.1). row 1: A < 0 above the range -> unclipped.
    assert loss.item() == pytest.approx((-1.0004 + S1) / 2, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)  # 2 of 3 tokens
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0], [S1 / 2, 0.0], [0.0, 0.0]]), atol=1e-6)


def test_gspo_token_form_matches_sequence_gspo():
    # Sequence-level GSPO written directly: mean over non-empty rows of -min(s A, clip(s) A),
    # s = exp(masked mean of the log-ratio) with its gradient. Value and gradient must match the token form.
    g = torch.Generator().manual_seed(0)
    logp = (0.05 * torch.randn(4, 6, generator=g)).requires_grad_(True)
    old = 0.05 * torch.randn(4, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]]).float()
    adv = torch.tensor([1.0, -0.5, 2.0, 3.0])
    n = mask.sum(-1)
    s = torch.exp(((logp - old) * mask).sum(-1) / n.clamp(min=1))
    per_seq = -torch.minimum(s * adv, s.clamp(1 - 0.02, 1 + 0.03) * adv)
    ref = (per_seq * (n > 0)).sum() / (n > 0).sum()
    (ref_grad,) = torch.autograd.grad(ref, logp)
    loss, _ = A.gspo_loss(logp, old, adv, mask, 0.02, 0.03, "seq_mean_token_mean")
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(grad, ref_grad, atol=1e-6)
    assert (ref_grad != 0).any() and (ref_grad == 0).any()  # some rows clipped, some not: both branches checked


def test_gspo_weights_and_empty_batch():
    logp = torch.zeros(1, 2, requires_grad=True)
    # s = 1, A = 1, weights [2, 0.5]: tokens -2 and -0.5, row mean -1.25
    loss, _ = A.gspo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2),
                          token_weights=torch.tensor([[2.0, 0.5]]))
    assert loss.item() == pytest.approx(-1.25)
    for agg in A.LOSS_AGG_MODES:
        loss, m = A.gspo_loss(GSPO_LOGP, GSPO_OLD, GSPO_ADV, torch.zeros(3, 2), loss_agg=agg, norm_len=2)
        assert loss.item() == 0.0 and all(v.item() == 0.0 for v in m.values())


def test_gspo_clamp_stops_the_gradient_as_verls_does():
    """verl clamps GSPO's token log-ratio log s_t = sg(log s) + log p - sg(log p) at 10, value and gradient, so a
    sequence whose mean log-ratio drifted past 10 gets no gradient; so does rlflow (docs/algorithms.md, "Where
    rlflow and verl differ"). Below the clamp the gradient is s * (-A) / |y| per token."""
    adv = torch.tensor([-0.73])
    # mean log-ratio 12 (tokens 11 and 13): s capped at e^10; A < 0 takes the unclipped -s * A
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, m = A.gspo_loss(logp, torch.tensor([[-11.0, -13.0]]), adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.73 * math.exp(10), rel=1e-6)  # 16079.6: the value is unchanged
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))  # the ungated form gave 0.73 e^10 / 2 = 8039.8 per token
    assert m["ratio_mean"].item() == pytest.approx(math.exp(10), rel=1e-6)
    # mean log-ratio 1 (tokens 0.5 and 1.5): s = e, gradient 0.73 e / 2 = 0.992173 on each token
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = A.gspo_loss(logp, torch.tensor([[-0.5, -1.5]]), adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.73 * math.e, abs=1e-5)
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), 0.73 * math.e / 2), atol=1e-6)


# ----------------------------------------------------------------------------- cispo

# row 0: logp [-1, -2], ratios [1.5, 0.5], A = +1; row 1: logp -0.5, ratio 1, A = -2; row 2 empty, garbage everywhere
CISPO_LOGP = torch.tensor([[-1.0, -2.0], [-0.5, NAN], [NAN, INF]])
CISPO_OLD = torch.tensor([[-1.0 - math.log(1.5), -2.0 + LN2], [-0.5, -INF], [INF, NAN]])
CISPO_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
CISPO_ADV = torch.tensor([1.0, -2.0, NAN])


def test_cispo_by_hand_every_token_keeps_a_gradient():
    logp = CISPO_LOGP.clone().requires_grad_(True)
    loss, m = A.cispo_loss(logp, CISPO_OLD, CISPO_ADV, CISPO_MASK, clip_low=0.2, clip_high=0.2)
    # weights sg(clip(ratio, 0.8, 1.2)) = [1.2, 0.8], [1]; per token -w * A * log p:
    # 1.2 * 1 = 1.2, 0.8 * 2 = 1.6, -1 * -2 * -0.5 = -1 -> token_mean (1.2 + 1.6 - 1) / 3 = 0.6
    assert loss.item() == pytest.approx(0.6, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)  # both row-0 weights clipped ...
    loss.backward()
    # ... and both still train: d/dlogp = -w * A / 3 = -0.4, -0.266667; row 1: 2 / 3
    assert torch.allclose(logp.grad, torch.tensor([[-0.4, -0.8 / 3], [2 / 3, 0.0], [0.0, 0.0]]), atol=1e-6)
    # PPO on the same batch stops the first token (A > 0, ratio 1.5 above 1.2): its gradient is 0
    ppo_logp = CISPO_LOGP.clone().requires_grad_(True)
    A.policy_loss(ppo_logp, CISPO_OLD, CISPO_ADV, CISPO_MASK)[0].backward()
    assert ppo_logp.grad[0, 0] == 0.0


def test_cispo_without_a_lower_bound():
    # the paper's setting, clip_low >= 1: the 0.5 ratio keeps its weight 0.5 -> 0.5 * 2 = 1.0 for that token,
    # (1.2 + 1.0 - 1) / 3 = 0.4, and only the 1.5 ratio counts as clipped
    logp = CISPO_LOGP.clone().requires_grad_(True)
    loss, m = A.cispo_loss(logp, CISPO_OLD, CISPO_ADV, CISPO_MASK, clip_low=1.0, clip_high=0.2)
    assert loss.item() == pytest.approx(0.4, abs=1e-6) and m["clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert logp.grad[0, 1].item() == pytest.approx(-0.5 / 3, abs=1e-6)


# ----------------------------------------------------------------------------- gmpo

# log-ratios (old = 0), band 0.4 on both sides in log space:
# row 0, A = +1: [0.6, -0.2] -> c = [0.4 (clipped above), -0.2], mean 0.1, s = e^0.1
# row 1, A = -1: [-0.6, 0.2] -> c = [-0.4 (clipped below), 0.2], mean -0.1, s = e^-0.1
# row 2, A = -1: [0.5] -> A < 0 is never clipped above: c = 0.5, s = e^0.5; row 3 empty, garbage
GMPO_LOGP = torch.tensor([[0.6, -0.2], [-0.6, 0.2], [0.5, NAN], [INF, NAN]])
GMPO_OLD = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, INF], [NAN, -INF]])
GMPO_MASK = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
GMPO_ADV = torch.tensor([1.0, -1.0, -1.0, NAN])
G0, G1, G2 = math.exp(0.1), math.exp(-0.1), math.exp(0.5)


def test_gmpo_by_hand():
    logp = GMPO_LOGP.clone().requires_grad_(True)
    loss, m = A.gmpo_loss(logp, GMPO_OLD, GMPO_ADV, GMPO_MASK, 0.4, 0.4, "seq_mean_token_mean")
    # per sequence -A * s: -1.105171, +0.904837, +1.648721 -> mean over 3 rows 0.482796
    assert loss.item() == pytest.approx((-G0 + G1 + G2) / 3, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(2 / 5)  # 2 of 5 tokens clipped
    assert m["ratio_mean"].item() == pytest.approx((2 * G0 + 2 * G1 + G2) / 5, abs=1e-6)
    loss.backward()
    # clipped tokens: 0; the others -A * s / (3 rows * |y|): -e^0.1 / 6, e^-0.1 / 6, e^0.5 / 3
    expected = torch.tensor([[0.0, -G0 / 6], [0.0, G1 / 6], [G2 / 3, 0.0], [0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_gmpo_token_form_matches_the_sequence_objective():
    # GMPO as its authors write it, one sequence at a time: flip the log-ratio's sign by A's, clamp, take the max,
    # flip back; -A * exp(mean); mean over non-empty rows. Value and gradient must match the token form.
    g = torch.Generator().manual_seed(1)
    logp = (0.4 * torch.randn(5, 6, generator=g)).requires_grad_(True)
    old = 0.4 * torch.randn(5, 6, generator=g)
    mask = torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [0] * 6]).float()
    adv = torch.tensor([1.0, -0.5, 2.0, -3.0, 1.0])
    sgn = torch.where(adv >= 0, -1.0, 1.0)[:, None]
    flipped = sgn * (logp - old)
    c = sgn * torch.maximum(flipped, flipped.clamp(-0.3, 0.3))
    n = mask.sum(-1)
    per_seq = -adv * torch.exp((c * mask).sum(-1) / n.clamp(min=1))
    ref = (per_seq * (n > 0)).sum() / (n > 0).sum()
    (ref_grad,) = torch.autograd.grad(ref, logp)
    loss, _ = A.gmpo_loss(logp, old, adv, mask, 0.3, 0.3, "seq_mean_token_mean")
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(grad, ref_grad, atol=1e-6)
    clipped = (mask > 0) & (ref_grad == 0)
    assert clipped.any() and ((mask > 0) & (ref_grad != 0)).any()  # both branches checked


# ----------------------------------------------------------------------------- sapo

# tau_pos 1, tau_neg 2. row 0, A = +1: ratios [1, 2]; row 1, A = -1: ratio 2; row 2 empty, garbage
SAPO_LOGP = torch.tensor([[0.0, LN2], [LN2, NAN], [NAN, INF]])
SAPO_OLD = torch.tensor([[0.0, 0.0], [0.0, -INF], [INF, NAN]])
SAPO_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
SAPO_ADV = torch.tensor([1.0, -1.0, NAN])
SIG1, SIG2 = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-2))  # 0.731059, 0.880797


def test_sapo_by_hand():
    logp = SAPO_LOGP.clone().requires_grad_(True)
    loss, m = A.sapo_loss(logp, SAPO_OLD, SAPO_ADV, SAPO_MASK, tau_pos=1.0, tau_neg=2.0)
    # gate f(r) = sigmoid(tau (r - 1)) * 4 / tau: f(1) = 2, f(2) = 4 sigmoid(1) = 2.924234 (tau 1),
    # 2 sigmoid(2) = 1.761594 (tau 2). Per token -f * A: row 0 [-2, -2.924234], row 1 +1.761594
    # seq_mean_token_mean: (-2.462117 + 1.761594) / 2 = -0.350261
    assert loss.item() == pytest.approx(((-2 - 4 * SIG1) / 2 + 2 * SIG2) / 2, abs=1e-6)
    loss.backward()
    # d/dlogp = -A * f'(r) * r, f'(r) = 4 sigmoid (1 - sigmoid) whatever tau: 1 at r = 1 (the plain gradient),
    # 0.786448 * 2 at r = 2 (tau 1), 0.419974 * 2 (tau 2: damped faster); / (2 rows * |y|)
    w1, w2 = 4 * SIG1 * (1 - SIG1), 4 * SIG2 * (1 - SIG2)
    expected = torch.tensor([[-1 / 4, -w1 * 2 / 4], [w2 * 2 / 2, 0.0], [0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    assert m["gate_weight_mean"].item() == pytest.approx((1 + w1 + w2) / 3, abs=1e-6)
    assert m["clip_frac"].item() == 0.0  # nothing is hard-clipped: PPO would stop the ratio-2 token of row 0


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    # at ratio 1 the gate's slope is 1 for either temperature: the same gradient as PPO's, -A / tokens
    g = torch.Generator().manual_seed(2)
    logp = torch.randn(3, 4, generator=g).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]).float()
    adv = torch.tensor([1.5, -0.7, 3.0])
    (sapo_grad,) = torch.autograd.grad(A.sapo_loss(logp, logp.detach(), adv, mask, 1.0, 1.05, "token_mean")[0], logp)
    (ppo_grad,) = torch.autograd.grad(A.policy_loss(logp, logp.detach(), adv, mask)[0], logp)
    assert torch.allclose(sapo_grad, ppo_grad, atol=1e-7) and (ppo_grad != 0).any()
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        A.sapo_loss(logp, logp, adv, mask, tau_pos=0.0)


# ----------------------------------------------------------------------------- clip_cov, kl_cov

# row 0, A = +2: logp [-0.5, -3, -1], ratios [1.5, 1, 1]; row 1, A = -1: logp [-3, -0.5], ratios [e^0.1, 1];
# row 2 empty, garbage. Over the 5 response tokens: mean A = (6 - 2) / 5 = 0.8, mean log p = -8 / 5 = -1.6, so
# cov = (A - 0.8)(log p + 1.6): row 0: 1.2 * [1.1, -1.4, 0.6] = [1.32, -1.68, 0.72]; row 1: -1.8 * [-1.4, 1.1]
# = [2.52, -1.98]
COV_LOGP = torch.tensor([[-0.5, -3.0, -1.0], [-3.0, -0.5, NAN], [NAN, INF, 0.0]])
COV_OLD = torch.tensor([[-0.5 - math.log(1.5), -3.0, -1.0], [-3.1, -0.5, 7.0], [INF, NAN, -INF]])
COV_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
COV_ADV = torch.tensor([2.0, -1.0, NAN])
E01 = math.exp(0.1)


def test_clip_cov_by_hand():
    logp = COV_LOGP.clone().requires_grad_(True)
    loss, m = A.clip_cov_loss(logp, COV_OLD, COV_ADV, COV_MASK)  # PPO band 0.2, ratio 2e-4, cov in (1, 5)
    # in (1, 5): (0, 0) 1.32 and (1, 0) 2.52; (0, 0) is already clipped by PPO (A > 0, ratio 1.5), so the one
    # token to detach (max(1, int(2e-4 * 5))) is (1, 0). PPO per token: -2.4 (clipped), -2, -2 | 0 (detached), 1
    # -> token_mean -5.4 / 5 = -1.08
    assert loss.item() == pytest.approx(-1.08, abs=1e-6)
    assert m["cov_frac"].item() == pytest.approx(1 / 5) and m["clip_frac"].item() == pytest.approx(1 / 5)
    loss.backward()
    # d/dlogp = -A * ratio / 5 where neither clipped nor detached
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.4, -0.4], [0.0, 0.2, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6)


def test_clip_cov_draws_its_tokens_among_the_candidates():
    # bounds (-10, 10): every token but the PPO-clipped (0, 0) is a candidate; ratio 0.5 -> int(2.5) = 2 drawn
    for seed in range(5):
        logp = COV_LOGP.clone().requires_grad_(True)
        gen = torch.Generator().manual_seed(seed)
        loss, m = A.clip_cov_loss(logp, COV_OLD, COV_ADV, COV_MASK, clip_cov_ratio=0.5, clip_cov_lb=-10.0,
                                  clip_cov_ub=10.0, generator=gen)
        loss.backward()
        stopped = (logp.grad == 0) & (COV_MASK > 0)
        assert m["cov_frac"].item() == pytest.approx(2 / 5) and stopped.sum() == 3 and stopped[0, 0]
    # a ratio that asks for more tokens than there are candidates detaches all 4
    _, m = A.clip_cov_loss(COV_LOGP, COV_OLD, COV_ADV, COV_MASK, clip_cov_ratio=1.0, clip_cov_lb=-10.0,
                           clip_cov_ub=10.0)
    assert m["cov_frac"].item() == pytest.approx(4 / 5)


def test_kl_cov_by_hand():
    logp = COV_LOGP.clone().requires_grad_(True)
    loss, m = A.kl_cov_loss(logp, COV_OLD, COV_ADV, COV_MASK, kl_cov_ratio=0.4, kl_cov_coef=1.0)
    # int(0.4 * 5) = 2 tokens with the largest cov: (1, 0) 2.52 and (0, 0) 1.32. No clip: -ratio * A per token,
    # plus |log ratio| on those two: row 0 [-3 + ln 1.5, -2, -2], row 1 [e^0.1 + 0.1, 1]
    # -> token_mean (-2.594535 - 4 + 1.205171 + 1) / 5 = -0.877873
    assert loss.item() == pytest.approx((-3 + math.log(1.5) - 4 + E01 + 0.1 + 1) / 5, abs=1e-6)
    assert m["cov_frac"].item() == pytest.approx(2 / 5) and m["clip_frac"].item() == 0.0
    loss.backward()
    # d/dlogp = -A * ratio + coef * sign(log ratio) on the penalised tokens, / 5: (-3 + 1) / 5 = -0.4 (no clip
    # stops the ratio-1.5 token), -0.4, -0.4 | (e^0.1 + 1) / 5, 0.2
    expected = torch.tensor([[-0.4, -0.4, -0.4], [(E01 + 1) / 5, 0.2, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    # the paper's ratio on 5 tokens still penalises max(1, int(2e-4 * 5)) = 1 token: the top one, (1, 0)
    _, m = A.kl_cov_loss(COV_LOGP, COV_OLD, COV_ADV, COV_MASK)
    assert m["cov_frac"].item() == pytest.approx(1 / 5)


def test_gmpo_and_kl_cov_keep_the_log_ratio_guard_verl_leaves_out():
    """rlflow clamps log(p / p_old) to +-20 in every loss; verl does in its PPO, CISPO and SAPO losses but not in
    geo_mean (GMPO) or kl_cov. Past the bound the clamped value stays and the gradient stops."""
    one = torch.ones(1, 1)
    # KL-Cov, log-ratio 25 on the one (penalised) token, A = 0: penalty 0.1 * 20 = 2 (verl: 2.5, gradient 0.1)
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, m = A.kl_cov_loss(logp, torch.tensor([[-25.0]]), torch.tensor([0.0]), one, kl_cov_coef=0.1)
    assert loss.item() == pytest.approx(2.0) and m["cov_frac"].item() == 1.0
    loss.backward()
    assert logp.grad.item() == 0.0
    # GMPO, log-ratio -25 with A = +1 (its band clips above only): s = e^-20, loss -e^-20, no gradient
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, m = A.gmpo_loss(logp, torch.tensor([[25.0]]), torch.tensor([1.0]), one)
    assert loss.item() == pytest.approx(-math.exp(-20), rel=1e-5) and m["clip_frac"].item() == 0.0
    loss.backward()
    assert logp.grad.item() == 0.0


@pytest.mark.parametrize("policy", ["cispo", "gmpo", "sapo", "clip_cov", "kl_cov"])
def test_new_policy_losses_with_empty_masks_and_weights(policy):
    fn = {"cispo": A.cispo_loss, "gmpo": A.gmpo_loss, "sapo": A.sapo_loss, "clip_cov": A.clip_cov_loss,
          "kl_cov": A.kl_cov_loss}[policy]
    for agg in A.LOSS_AGG_MODES:  # nothing to train on: 0 and zero metrics, never NaN
        loss, m = fn(COV_LOGP, COV_OLD, COV_ADV, torch.zeros(3, 3), loss_agg=agg, norm_len=3)
        assert loss.item() == 0.0 and all(v.item() == 0.0 for v in m.values()), agg
    # token weights (importance weights) multiply each token's loss: weights 2 on row 0 and 0.5 on row 1 give
    # 2 * (the loss of row 0's tokens) + 0.5 * (row 1's), with the tokens chosen on the whole batch as unweighted
    def weighted(row0: float, row1: float) -> float:
        w = torch.tensor([[row0] * 3, [row1, row1, NAN], [NAN] * 3])
        gen = {"generator": torch.Generator().manual_seed(0)} if policy == "clip_cov" else {}
        return fn(COV_LOGP, COV_OLD, COV_ADV, COV_MASK, loss_agg="token_sum", token_weights=w, **gen)[0].item()

    assert weighted(2.0, 0.5) == pytest.approx(2 * weighted(1.0, 0.0) + 0.5 * weighted(0.0, 1.0), abs=1e-6)
    assert weighted(1.0, 0.0) != 0.0 and weighted(0.0, 1.0) != 0.0
    plain = fn(COV_LOGP, COV_OLD, COV_ADV, COV_MASK, loss_agg="token_sum")[0].item()
    assert weighted(1.0, 1.0) == pytest.approx(plain, abs=1e-6)


# ----------------------------------------------------------------------------- rl_loss


def _rl(logp, old, adv, ref, ent, **kw):
    args = {"clip_low": 0.2, "clip_high": 0.2, "loss_agg": "token_mean", **kw}
    return A.rl_loss(logp, old, adv, torch.ones(1, 1), ref_logprobs=ref, entropy=ent, **args)


def test_rl_loss_adds_kl_and_entropy():
    logp, ref, ent = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]]), torch.tensor([[0.3]])
    loss, m = _rl(logp, logp, torch.tensor([1.0]), ref, ent, kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    # pg = -1 (ratio 1, A 1); kl = ln 2; total = -1 + 0.1 ln 2 - 0.01 * 0.3 = -0.933685
    assert loss.item() == pytest.approx(-1 + 0.1 * LN2 - 0.003, abs=1e-6)
    assert m["pg_loss"].item() == pytest.approx(-1) and m["kl"].item() == pytest.approx(LN2)
    assert m["entropy"].item() == pytest.approx(0.3) and m["loss"].item() == pytest.approx(loss.item())
    assert {"clip_frac", "approx_kl_k1", "approx_kl_k2", "ratio_mean", "nonfinite_old_frac"} <= m.keys()


def test_rl_loss_optional_terms():
    logp, ref, ent = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]]), torch.tensor([[0.3]])
    adv = torch.tensor([1.0])
    # no reference, no entropy: loss is the policy loss, no kl / entropy metric
    loss, m = _rl(logp, logp, adv, None, None, kl_coef=0.1)
    assert loss.item() == pytest.approx(-1) and "kl" not in m and "entropy" not in m
    # kl_coef 0: the KL is not computed even with a reference
    loss, m = _rl(logp, logp, adv, ref, None, kl_coef=0.0)
    assert loss.item() == pytest.approx(-1) and "kl" not in m
    # entropy given with coef 0: logged, not in the loss
    loss, m = _rl(logp, logp, adv, None, ent)
    assert loss.item() == pytest.approx(-1) and m["entropy"].item() == pytest.approx(0.3)


def test_rl_loss_gradients_flow_only_through_logprobs():
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    old = torch.tensor([[math.log(0.5)]], requires_grad=True)
    adv = torch.tensor([1.0], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], requires_grad=True)
    ent = torch.tensor([[0.3]], requires_grad=True)
    loss, _ = _rl(logp, old, adv, ref, ent, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    # loss = -ratio * A + 0.1 * k3 - 0.01 * H; ratio 1, q/p 0.5 -> 0.1 * (0.5 + ln 2 - 1) = 0.0193147
    assert loss.item() == pytest.approx(-1 + 0.1 * (0.5 + LN2 - 1) - 0.003, abs=1e-6)
    loss.backward()
    # d/dlogp = -ratio * A + 0.1 * (1 - q/p) = -1 + 0.1 * 0.5 = -0.95
    assert logp.grad.item() == pytest.approx(-0.95, abs=1e-6)
    assert old.grad is None and adv.grad is None and ref.grad is None
    assert ent.grad.item() == pytest.approx(-0.01)  # the entropy bonus is the caller's to detach


def test_rl_loss_with_padding_stays_finite():
    # two sequences, the second one empty; garbage everywhere under the mask
    logp = torch.tensor([[math.log(0.5), NAN], [INF, -INF]], requires_grad=True)
    old = torch.tensor([[math.log(0.5), INF], [NAN, 5.0]])
    ref = torch.tensor([[math.log(0.25), -INF], [INF, NAN]])
    ent = torch.tensor([[0.3, NAN], [INF, INF]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    kw = {"clip_low": 0.2, "clip_high": 0.2, "norm_len": 1, "kl_coef": 0.1, "kl_estimator": "k1", "entropy_coef": 0.01}
    for agg in A.LOSS_AGG_MODES:
        logp.grad = None
        adv = torch.tensor([1.0, NAN])
        loss, m = A.rl_loss(logp, old, adv, mask, loss_agg=agg, ref_logprobs=ref, entropy=ent, **kw)
        # only token (0, 0) counts, and each mode reduces one token of one sequence to itself (norm_len 1)
        assert loss.item() == pytest.approx(-1 + 0.1 * LN2 - 0.003, abs=1e-6), agg
        assert all(torch.isfinite(v) for v in m.values()), agg
        loss.backward()
        assert torch.allclose(logp.grad, torch.tensor([[-1.0 + 0.1, 0.0], [0.0, 0.0]]), atol=1e-6), agg


def _rl_is(mode, **kw):
    # train engine (old) and current policy: p = 0.5 on both tokens; rollout engine: 0.5 and 0.2 -> ratios 1, 2.5
    logp = torch.full((1, 2), math.log(0.5), requires_grad=True)
    old = torch.full((1, 2), math.log(0.5))
    rollout = torch.tensor([[math.log(0.5), math.log(0.2)]])
    ref = torch.full((1, 2), math.log(0.25))
    loss, m = A.rl_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2,
                        loss_agg="token_mean", ref_logprobs=ref, kl_coef=0.1, kl_estimator="k1",
                        rollout_logprobs=rollout, is_correction=mode, **kw)
    loss.backward()
    return loss.item(), logp.grad, m


def test_rl_loss_tis_weights_the_policy_term_only():
    # weights min([1, 2.5], 2) = [1, 2]; PPO ratio 1, A 1: pg = -(1 + 2) / 2 = -1.5; KL k1 = ln 2 per token, unweighted
    loss, grad, m = _rl_is("tis", tis_cap=2.0)
    assert loss == pytest.approx(-1.5 + 0.1 * LN2, abs=1e-6)
    assert m["pg_loss"].item() == pytest.approx(-1.5, abs=1e-6) and m["kl"].item() == pytest.approx(LN2, abs=1e-6)
    assert m["is_clip_frac"].item() == 0.5 and m["is_weight_mean"].item() == pytest.approx(1.5, abs=1e-6)
    # d/dlogp = (-A * ratio * w + 0.1) / 2 tokens: (-1 + 0.1) / 2 = -0.45, (-2 + 0.1) / 2 = -0.95
    assert torch.allclose(grad, torch.tensor([[-0.45, -0.95]]), atol=1e-6)


def test_rl_loss_icepop_drops_tokens_from_the_policy_term():
    # band [0.5, 2]: 2.5 is outside -> weights [1, 0]; pg = -1 / 2 tokens = -0.5; the KL still reaches both tokens
    loss, grad, m = _rl_is("icepop", icepop_low=0.5, icepop_high=2.0)
    assert loss == pytest.approx(-0.5 + 0.1 * LN2, abs=1e-6)
    assert m["is_mask_frac"].item() == 0.5
    assert torch.allclose(grad, torch.tensor([[-0.45, 0.05]]), atol=1e-6)


def test_rl_loss_measures_mismatch_without_correcting():
    loss, grad, m = _rl_is("none")
    assert loss == pytest.approx(-1 + 0.1 * LN2, abs=1e-6)  # as without rollout_logprobs
    assert m["is_ratio_mean"].item() == pytest.approx(1.75, abs=1e-6)
    assert m["mismatch_kl"].item() == pytest.approx((1.5 - math.log(2.5)) / 2, abs=1e-6)
    assert "is_clip_frac" not in m and "is_mask_frac" not in m


def test_rl_loss_gspo_and_errors():
    kw = {"clip_low": 0.5, "clip_high": 0.5, "loss_agg": "seq_mean_token_mean"}
    loss, m = A.rl_loss(GSPO_LOGP, GSPO_OLD, GSPO_ADV, GSPO_MASK, policy="gspo", **kw)
    assert loss.item() == pytest.approx((-S0 + S1) / 2, abs=1e-6) and m["pg_loss"].item() == loss.item()
    one = torch.zeros(1, 1)
    args = (one, one, torch.tensor([1.0]), torch.ones(1, 1))
    with pytest.raises(ValueError, match="is_correction 'tis' needs rollout_logprobs"):
        A.rl_loss(*args, is_correction="tis", **kw)
    with pytest.raises(ValueError, match="clip_ratio_c .* 'ppo' only"):
        A.rl_loss(*args, policy="gspo", clip_ratio_c=3.0, **kw)
    with pytest.raises(ValueError, match="unknown policy 'a2c'; expected one of ppo, gspo, cispo, gmpo, sapo"):
        A.rl_loss(*args, policy="a2c", **kw)


@pytest.mark.parametrize("policy, direct", [
    ("cispo", lambda *a: A.cispo_loss(*a, clip_low=0.3, clip_high=0.1)),
    ("gmpo", lambda *a: A.gmpo_loss(*a, clip_low=0.3, clip_high=0.1, loss_agg="token_mean")),
    ("sapo", lambda *a: A.sapo_loss(*a, tau_pos=2.0, tau_neg=3.0, loss_agg="token_mean")),
    ("clip_cov", lambda *a: A.clip_cov_loss(*a, clip_low=0.3, clip_high=0.1, clip_cov_ratio=0.4, clip_cov_lb=-1.0,
                                            clip_cov_ub=2.0)),
    ("kl_cov", lambda *a: A.kl_cov_loss(*a, kl_cov_ratio=0.4, kl_cov_coef=0.5)),
])
def test_rl_loss_dispatches_every_policy_with_its_settings(policy, direct):
    # every setting differs from its default, so a setting rl_loss failed to pass on would change the loss
    kw = {"clip_low": 0.3, "clip_high": 0.1, "loss_agg": "token_mean", "sapo_tau_pos": 2.0, "sapo_tau_neg": 3.0,
          "clip_cov_ratio": 0.4, "clip_cov_lb": -1.0, "clip_cov_ub": 2.0, "kl_cov_ratio": 0.4, "kl_cov_coef": 0.5}
    args = (COV_LOGP, COV_OLD, COV_ADV, COV_MASK)
    torch.manual_seed(0)  # clip_cov draws from the global RNG
    loss, m = A.rl_loss(*args, policy=policy, **kw)
    torch.manual_seed(0)
    ref, ref_m = direct(*args)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-7) and m["pg_loss"].item() == loss.item()
    assert {k: v.item() for k, v in ref_m.items()} == {k: m[k].item() for k in ref_m}
    with pytest.raises(ValueError, match="clip_ratio_c .* 'ppo' only"):
        A.rl_loss(*args, policy=policy, clip_ratio_c=3.0, **kw)


# ----------------------------------------------------------------------------- SFT


def test_sft_loss_by_hand_token_mean_and_seq_mean():
    # row 0: prompt at t=0,1 (logprob -9 must be ignored), response tokens -ln2, -ln4 at t=2,3
    # row 1: prompt at t=0, response -ln2 at t=1, then padding (-inf, NaN) at t=2,3
    lp = torch.tensor([[0.0, -9.0, -LN2, -2 * LN2], [0.0, -LN2, -INF, NAN]], requires_grad=True)
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    # token_mean: (ln2 + 2 ln2 + ln2) / 3 tokens = 4/3 ln2
    loss, metrics = A.sft_loss(lp, mask)
    assert loss.item() == pytest.approx(4 / 3 * LN2, abs=1e-6)
    assert metrics["loss"].item() == pytest.approx(4 / 3 * LN2, abs=1e-6)
    loss.backward()
    # d loss / d logprob = -1/3 on each response token, exactly 0 on prompt and padding (no NaN from -inf / NaN)
    assert torch.equal(lp.grad, torch.tensor([[0.0, 0.0, -1 / 3, -1 / 3], [0.0, -1 / 3, 0.0, 0.0]]))
    # seq_mean_token_mean: row 0 mean 1.5 ln2, row 1 mean ln2 -> 1.25 ln2
    seq, _ = A.sft_loss(lp.detach(), mask, "seq_mean_token_mean")
    assert seq.item() == pytest.approx(1.25 * LN2, abs=1e-6)


def test_sft_loss_empty_responses():
    lp = torch.tensor([[0.0, -LN2, -LN2], [0.0, -INF, NAN]])
    # row 1 has an empty response: it adds nothing under either aggregation
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert A.sft_loss(lp, mask)[0].item() == pytest.approx(LN2, abs=1e-6)
    assert A.sft_loss(lp, mask, "seq_mean_token_mean")[0].item() == pytest.approx(LN2, abs=1e-6)
    # every response empty: 0, not NaN, and a zero gradient
    lp = lp.clone().requires_grad_(True)
    loss, _ = A.sft_loss(lp, torch.zeros_like(mask))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros_like(lp))


def test_sft_loss_reports_entropy_and_perfect_prediction_is_zero():
    lp = torch.zeros(1, 3)  # p = 1 on every target: NLL 0
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    ent = torch.tensor([[5.0, LN2, 3 * LN2]])  # masked mean (ln2 + 3 ln2) / 2 = 2 ln2
    loss, metrics = A.sft_loss(lp, mask, entropy=ent)
    assert loss.item() == 0.0
    assert metrics["entropy"].item() == pytest.approx(2 * LN2, abs=1e-6)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        A.sft_loss(lp, mask, "sum")


@pytest.mark.parametrize("policy", A.POLICY_LOSSES)
def test_an_old_logprob_of_minus_inf_gives_no_nan_and_is_counted(policy):
    """SGLang can return no logprob for a token (the rollout function stores -inf): its ratio would be infinite,
    a NaN loss where the advantage is 0 and a NaN gradient elsewhere. Such a token gets ratio 1 and no
    gradient, the others train as usual, and nonfinite_old_frac counts it."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -INF, -0.5], [-1.0, -1.0, -1.0]])
    mask = torch.ones(2, 3)
    for adv in (torch.tensor([0.0, 0.0]), torch.tensor([1.0, -1.0])):
        loss, m = A.rl_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, loss_agg="token_mean", policy=policy)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert logp.grad[0, 1] == 0  # the unknown token takes no gradient
        assert m["nonfinite_old_frac"].item() == pytest.approx(1 / 6)
        logp.grad = None
    # a ratio that drifted far is clamped at e^20, as verl's: finite loss and gradient
    far, _ = A.policy_loss(torch.tensor([[0.0]], requires_grad=True), torch.tensor([[-100.0]]), torch.tensor([1.0]),
                           torch.ones(1, 1), clip_ratio_c=3.0)
    assert torch.isfinite(far)
    seq, _ = A.gspo_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[-50.0, -50.0]]), torch.tensor([-1.0]),
                         torch.ones(1, 2))
    assert seq.item() == pytest.approx(math.exp(10), rel=1e-5)  # sequence log-ratio 50 capped at 10
