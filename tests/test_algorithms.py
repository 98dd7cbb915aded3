"""Algorithms against numbers worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from engines import algorithms as A

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


def test_aggregation_modes_differ_on_lengths():
    # a long row of 1s (4 tokens) and a short row [1] (1 token), norm_len 4
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert A.aggregate_loss(values, mask, "token_mean").item() == pytest.approx(1.0)  # 5 / 5
    assert A.aggregate_loss(values, mask, "seq_mean_token_mean").item() == pytest.approx(1.0)  # (1 + 1) / 2
    # Dr.GRPO: (4/4 + 1/4) / 2 = 0.625
    assert A.aggregate_loss(values, mask, "seq_mean_token_sum_norm", norm_len=4).item() == pytest.approx(0.625)


def test_aggregation_gradient_skips_padding():
    values = VALUES.clone().requires_grad_(True)
    A.aggregate_loss(values, MASK, "token_mean").backward()
    # d/dv = mask / 3 tokens; padding (inf / NaN) gets exactly 0
    assert torch.equal(values.grad, MASK / 3)
    values.grad = None
    A.aggregate_loss(values, MASK, "seq_mean_token_mean").backward()
    # row 0: 1 / (2 seqs * 2 tokens) = 0.25 per token; row 1: 1 / (2 * 1) = 0.5
    assert torch.equal(values.grad, torch.tensor([[0.25, 0.25, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))


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
    with pytest.raises(ValueError, match="'bogus'"):
        A.aggregation_weight(MASK, "bogus")


# ----------------------------------------------------------------------------- kl_penalty


def test_kl_estimators_by_hand():
    p, q = torch.tensor([math.log(0.5), math.log(0.25)]), torch.tensor([math.log(0.25), math.log(0.5)])
    # k1 = ln p - ln q: ln 0.5 - ln 0.25 = ln 2; ln 0.25 - ln 0.5 = -ln 2
    assert torch.allclose(A.kl_penalty(p, q, "k1"), torch.tensor([LN2, -LN2]), atol=1e-6)
    # k3 = q/p - ln(q/p) - 1: q/p = 0.5 -> 0.5 + ln 2 - 1 = 0.193147; q/p = 2 -> 2 - ln 2 - 1 = 0.306853
    assert torch.allclose(A.kl_penalty(p, q, "k3"), torch.tensor([0.5 + LN2 - 1, 2 - LN2 - 1]), atol=1e-6)
    assert A.kl_penalty(q, q, "k3").eq(0).all()
    with pytest.raises(ValueError, match="unknown estimator 'k9'.*k1, k3"):
        A.kl_penalty(p, q, "k9")


def test_k3_clamps_log_ratio():
    # ref - logp = -100 -> clamped to -20: e^-20 + 20 - 1 = 19.000000002
    # ref - logp = +100 -> clamped to  20: e^20 - 20 - 1 = 485165174.41
    kl = A.kl_penalty(torch.tensor([0.0, -100.0]), torch.tensor([-100.0, 0.0]), "k3")
    assert kl[0].item() == pytest.approx(19.0, abs=1e-5)
    assert kl[1].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)


def test_kl_gradient_reaches_logprobs_only():
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)], requires_grad=True)
    # d k3 / d logp = 1 - e^(ref - logp) = 1 - 0.5 = 0.5
    A.kl_penalty(logp, ref, "k3").sum().backward()
    assert logp.grad.item() == pytest.approx(0.5) and ref.grad is None


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
    assert m["approx_kl"].item() == pytest.approx(0.5 * 0.1**2 / 2, abs=1e-7)  # 0.5 * (0 + 0.01) / 2 tokens
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
    assert {"clip_frac", "approx_kl", "ratio_mean"} <= m.keys()


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
