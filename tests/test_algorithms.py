"""Algorithms against numbers worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from engines import algorithms as A


def test_grpo_advantages_by_hand():
    # group 1: [1, 0, 0, 1] mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735 -> +-0.866025
    # group 2: [1, 1, 1, 1] all equal -> exactly 0
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = A.group_advantages(r, 4, normalize_std=True, eps=0.0)
    s = 0.5 / math.sqrt(1 / 3)
    assert torch.allclose(adv, torch.tensor([s, -s, -s, s, 0, 0, 0, 0]), atol=1e-6)
    assert torch.isfinite(A.group_advantages(r, 4, eps=1e-6)).all()


def test_dr_grpo_advantages_are_centered_only():
    r = torch.tensor([0.25, 0.75, 1.0, 0.0])  # group of 2: means 0.5, 0.5
    assert torch.allclose(A.group_advantages(r, 2, normalize_std=False), torch.tensor([-0.25, 0.25, 0.5, -0.5]))


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="groups of 3"):
        A.group_advantages(torch.zeros(4), 3)


def test_token_logprobs_and_entropy_by_hand():
    # logits [0, ln 3] -> probs [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    lp = A.token_logprobs(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    ent = A.entropy_from_logits(logits).item()
    assert ent == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)


VALUES = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0], [99.0, 99.0, 99.0]])  # 99 = padding garbage
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # third row: empty response


def test_aggregation_modes_by_hand():
    # token_mean: (1 + 2 + 3) / 3 tokens = 2
    assert A.aggregate_loss(VALUES, MASK, "token_mean").item() == pytest.approx(2.0)
    # seq_mean_token_mean: mean(1.5, 3) over the 2 non-empty rows = 2.25
    assert A.aggregate_loss(VALUES, MASK, "seq_mean_token_mean").item() == pytest.approx(2.25)
    # Dr.GRPO: mean(3 / 4, 3 / 4) with norm_len 4 = 0.75
    assert A.aggregate_loss(VALUES, MASK, "seq_mean_token_sum_norm", norm_len=4).item() == pytest.approx(0.75)
    assert A.aggregation_weight(MASK, "token_mean").item() == 3
    assert A.aggregation_weight(MASK, "seq_mean_token_mean").item() == 2


def test_aggregation_of_all_empty_is_zero_not_nan():
    empty = torch.zeros(2, 3)
    for mode in A.LOSS_AGG_MODES:
        assert A.aggregate_loss(VALUES[:2], empty, mode, norm_len=3).item() == 0.0


def test_aggregation_errors():
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        A.aggregate_loss(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match="needs norm_len"):
        A.aggregate_loss(VALUES, MASK, "seq_mean_token_sum_norm")


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert A.kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))  # ln 0.5 - ln 0.25
    # k3: r = q/p = 0.5 -> 0.5 - ln 0.5 - 1 = 0.193147
    assert A.kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - math.log(0.5) - 1, abs=1e-6)
    assert A.kl_penalty(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="unknown estimator 'k9'"):
        A.kl_penalty(logp, ref, "k9")


def _ratio_case(ratio: float, adv: float, clip_low=0.2, clip_high=0.28):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, m = A.policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), clip_low, clip_high)
    return logp, loss, m


def test_ppo_clip_asymmetric_branches():
    # A > 0, ratio 1.5 above 1 + 0.28: clipped term 1.28 * 1 is smaller -> loss -1.28, no gradient
    logp, loss, m = _ratio_case(1.5, 1.0)
    loss.backward()
    assert loss.item() == pytest.approx(-1.28) and logp.grad.item() == 0.0 and m["clip_frac"].item() == 1.0
    # A > 0, ratio 1.25 inside the clip-higher range: loss -1.25, grad -ratio * A = -1.25
    logp, loss, m = _ratio_case(1.25, 1.0)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25) and logp.grad.item() == pytest.approx(-1.25)
    assert m["clip_frac"].item() == 0.0
    # A < 0, ratio 0.5 below 1 - 0.2: min(0.5 * -1, 0.8 * -1) = -0.8 -> loss 0.8, clipped, no gradient
    logp, loss, m = _ratio_case(0.5, -1.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.8) and logp.grad.item() == 0.0 and m["clip_frac"].item() == 1.0
    # A < 0, ratio 1.5: unclipped -1.5 is the smaller -> loss 1.5, gradient flows (1.5)
    logp, loss, m = _ratio_case(1.5, -1.0)
    loss.backward()
    assert loss.item() == pytest.approx(1.5) and logp.grad.item() == pytest.approx(1.5)


def test_policy_loss_ignores_padding_and_reports_metrics():
    logp = torch.tensor([[0.0, 0.1, 7.0]])
    old = torch.tensor([[0.0, 0.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = A.policy_loss(logp, old, torch.tensor([2.0]), mask)
    # ratios 1 and e^0.1 = 1.10517 (inside 1.2): loss = -(2 * 1 + 2 * 1.10517) / 2 = -2.10517
    assert loss.item() == pytest.approx(-(2 + 2 * math.exp(0.1)) / 2, abs=1e-6)
    assert m["approx_kl"].item() == pytest.approx(0.5 * 0.01 / 2)
    assert m["ratio_mean"].item() == pytest.approx((1 + math.exp(0.1)) / 2, abs=1e-6)


def test_rl_loss_adds_kl_and_entropy():
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    mask = torch.ones(1, 1)
    ent = torch.tensor([[0.3]])
    loss, m = A.rl_loss(logp, logp, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.2, loss_agg="token_mean",
                        ref_logprobs=ref, kl_coef=0.1, kl_estimator="k1", entropy=ent, entropy_coef=0.01)
    # pg = -1 (ratio 1, A 1); kl = ln 2; total = -1 + 0.1 ln 2 - 0.01 * 0.3
    assert loss.item() == pytest.approx(-1 + 0.1 * math.log(2) - 0.003, abs=1e-6)
    assert m["pg_loss"].item() == pytest.approx(-1) and m["kl"].item() == pytest.approx(math.log(2))
    assert m["entropy"].item() == pytest.approx(0.3)
