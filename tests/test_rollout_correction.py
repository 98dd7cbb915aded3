"""Rollout correction beyond token TIS/IcePop: sequence-level and batch-normalised importance weights, and
token / sequence / geometric rejection masks, against numbers worked out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlflow.engines.core import algorithms as A
from rlflow.engines.core.config import AlgorithmConfig
from rlflow.engines.session.stages.advantages import _rollout_correction
from rlflow.engines.session.step_state import StepState

LN2 = math.log(2.0)
# ratios p_train / p_rollout: row 0: 1, 2, 0.5 (sequence: exp(0 + ln2 - ln2) = 1); row 1: 4, 1, padding
# (sequence: 4). The padding holds garbage that must never show.
ROLLOUT = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -1.0, float("inf")]])
TRAIN = ROLLOUT.nan_to_num(posinf=0.0) + torch.tensor([[0.0, LN2, -LN2], [2 * LN2, 0.0, float("nan")]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_sequence_tis_by_hand():
    w, m = A.importance_weights(TRAIN, ROLLOUT, MASK, "tis", tis_cap=2.0, level="sequence")
    # row 0: min(1, 2) = 1 on each token; row 1: min(4, 2) = 2 on each token
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]), atol=1e-6)
    assert m["is_clip_frac"].item() == pytest.approx(2 / 5)  # row 1's two tokens
    assert m["is_weight_mean"].item() == pytest.approx(7 / 5, abs=1e-6)
    assert m["is_ratio_mean"].item() == pytest.approx((1 + 2 + 0.5 + 4 + 1) / 5, abs=1e-6)  # token ratios


def test_sequence_icepop_by_hand():
    w, m = A.importance_weights(TRAIN, ROLLOUT, MASK, "icepop", icepop_low=0.5, icepop_high=3.0, level="sequence")
    # row 1's sequence ratio 4 is outside [0.5, 3]: the whole sequence is dropped (token level would keep its 1)
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), atol=1e-6)
    assert m["is_mask_frac"].item() == pytest.approx(2 / 5)


def test_batch_normalised_weights_by_hand():
    # token TIS weights 1, 2, 0.5, 2, 1: mean 6.5 / 5 = 1.3 -> each divided by 1.3
    w, m = A.importance_weights(TRAIN, ROLLOUT, MASK, "tis", tis_cap=2.0, batch_normalize=True)
    expected = torch.tensor([[1.0, 2.0, 0.5], [2.0, 1.0, 0.0]]) / 1.3
    assert torch.allclose(w, expected, atol=1e-6)
    assert m["is_weight_mean"].item() == pytest.approx(1.0, abs=1e-6)
    # sequence TIS weights 1 and 2: the mean over sequences is 1.5 (over tokens it would be 7/5)
    w, _ = A.importance_weights(TRAIN, ROLLOUT, MASK, "tis", tis_cap=2.0, level="sequence", batch_normalize=True)
    assert torch.allclose(w, torch.tensor([[2 / 3, 2 / 3, 2 / 3], [4 / 3, 4 / 3, 0.0]]), atol=1e-6)


def test_batch_normalise_leaves_all_zero_weights_and_none_alone():
    w, _ = A.importance_weights(TRAIN, ROLLOUT, MASK, "icepop", icepop_low=10.0, icepop_high=20.0, batch_normalize=True)
    assert torch.equal(w, torch.zeros(2, 3))
    w, _ = A.importance_weights(TRAIN, ROLLOUT, MASK, "none", batch_normalize=True)
    assert torch.equal(w, MASK)
    with pytest.raises(ValueError, match="unknown level 'seq'.*token, sequence"):
        A.importance_weights(TRAIN, ROLLOUT, MASK, "tis", level="seq")


# Rejection bounds the inverse ratio, p_rollout / p_train = exp(k1) as verl's *_k1 thresholds do: row 0: 1, 0.5, 2
# (sequence 1, geometric 1); row 1: 0.25, 1 (sequence 0.25, geometric exp(ln 0.25 / 2) = 0.5).
@pytest.mark.parametrize(
    "level, low, high, keep, token_frac, seq_frac",
    [
        # token: only the 0.25 is outside [0.5, 2] (bounds are inclusive: 0.5 and 2 stay)
        ("token", 0.5, 2.0, [[1, 1, 1], [0, 1, 0]], 1 / 5, 1 / 2),
        # sequence: 1 | 0.25 -> row 1 goes under [0.5, 2] and under [0.5, 4.5] (its train/rollout ratio 4 would
        # pass [0.5, 4.5]: the direction matters), stays under [0.2, 2]
        ("sequence", 0.5, 2.0, [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),
        ("sequence", 0.5, 4.5, [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),
        ("sequence", 0.2, 2.0, [[1, 1, 1], [1, 1, 0]], 0.0, 0.0),
        # geometric: 1 | 0.5 -> row 1 stays under [0.45, 2], goes under [0.55, 2]
        ("geometric", 0.45, 2.0, [[1, 1, 1], [1, 1, 0]], 0.0, 0.0),
        ("geometric", 0.55, 2.0, [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),
        ("none", 0.5, 2.0, [[1, 1, 1], [1, 1, 0]], 0.0, 0.0),
    ],
)
def test_rejection_masks_by_hand(level, low, high, keep, token_frac, seq_frac):
    got, m = A.rejection_mask(TRAIN, ROLLOUT, MASK, level, low, high)
    assert torch.equal(got, torch.tensor(keep, dtype=torch.float32))
    assert m["reject_token_frac"].item() == pytest.approx(token_frac)
    assert m["reject_seq_frac"].item() == pytest.approx(seq_frac)


def test_rejection_bounds_are_verls_k1_thresholds():
    """verl's token_k1 keeps a token when log(low) <= log p_rollout - log p_train <= log(high) (threshold
    "low_high"); reject_low / reject_high are those numbers one to one. With [0.9, 1.1] (sort-tiny-rollout-corr's
    geometric bounds before this change, as verl's "0.9_1.1"): train/rollout ratios 0.92, 1.105, 0.905 are
    rollout/train 1.087, 0.905, 1.105 -> kept, kept, rejected (bounding p_train / p_rollout instead kept the first
    and last and rejected the middle one)."""
    rollout = torch.full((1, 3), -1.0)
    train = rollout + torch.tensor([[math.log(0.92), math.log(1.105), math.log(0.905)]])
    keep, _ = A.rejection_mask(train, rollout, torch.ones(1, 3), "token", 0.9, 1.1)
    assert keep.tolist() == [[1.0, 1.0, 0.0]]
    # the geometric mean ratio of the three (rollout/train): (1 / (0.92 * 1.105 * 0.905))^(1/3) = 1.0282
    for low, high, kept in ((0.9, 1.1, 1.0), (0.9, 1.02, 0.0), (1.03, 1.1, 0.0)):
        keep, _ = A.rejection_mask(train, rollout, torch.ones(1, 3), "geometric", low, high)
        assert keep.tolist() == [[kept] * 3], (low, high)


def test_rejection_treats_unknown_rollout_logprobs_as_agreement():
    rollout = ROLLOUT.clone()
    rollout[1, 0] = -float("inf")  # the engine gave no logprob for the token of ratio 4
    keep, _ = A.rejection_mask(TRAIN, rollout, MASK, "token", 0.5, 2.0)
    assert torch.equal(keep, MASK)
    with pytest.raises(ValueError, match="unknown level 'seq_sum_k1'"):
        A.rejection_mask(TRAIN, ROLLOUT, MASK, "seq_sum_k1", 0.5, 2.0)


def test_rl_loss_uses_given_weights_and_still_measures():
    """Weights computed over the whole batch (is_weights) replace the micro-batch's own; the mismatch metrics
    still come from the logprobs."""
    logprobs = TRAIN.nan_to_num().clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    given = torch.tensor([[0.5, 1.0, 2.0], [3.0, 0.25, 9.0]])
    kw = {"clip_low": 0.2, "clip_high": 0.2, "loss_agg": "token_mean", "is_correction": "tis"}
    loss, m = A.rl_loss(logprobs, TRAIN.nan_to_num(), adv, MASK, rollout_logprobs=ROLLOUT, is_weights=given, **kw)
    # on-policy (ratio 1): per-token loss -A * w = -0.5, -1, -2 | 3, 0.25 -> mean over 5 tokens = -0.25 / 5
    assert loss.item() == pytest.approx(-0.25 / 5, abs=1e-6)
    assert m["is_weight_mean"].item() == pytest.approx((0.5 + 1 + 2 + 3 + 0.25) / 5)
    assert m["is_clip_frac"].item() == pytest.approx(1 / 5)  # measured: token ratio 4 > 2
    seq, _ = A.rl_loss(logprobs, TRAIN.nan_to_num(), adv, MASK, rollout_logprobs=ROLLOUT, is_level="sequence", **kw)
    # sequence TIS weights 1 | 2: -1 * 3 + 2 * 2 = 1 -> 1 / 5
    assert seq.item() == pytest.approx(1 / 5, abs=1e-6)


def test_rollout_correction_takes_the_weights_before_rejection_as_verl():
    """verl computes the importance weights on the response mask as sampled and rejects afterwards, so a sequence's
    weight is the likelihood ratio of all its tokens, rejected ones included, and batch normalisation averages over
    the same tokens whatever the rejection dropped. Token rejection [0.5, 2] drops row 1's first token
    (p_rollout / p_train = 0.25); row 1's sequence ratio p_train / p_rollout is still 4 * 1 = 4 (from its kept token
    alone it would be 1)."""
    kw = {"is_correction": "tis", "tis_cap": 5.0, "rejection": "token", "reject_low": 0.5, "reject_high": 2.0}
    keep, w, m = A.rollout_correction(TRAIN, ROLLOUT, MASK, is_level="sequence", **kw)
    assert torch.equal(keep, torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]))
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1.0], [4.0, 4.0, 0.0]]), atol=1e-5)
    assert m["reject_token_frac"].item() == pytest.approx(1 / 5)
    assert m["is_weight_mean"].item() == pytest.approx((3 * 1 + 2 * 4) / 5, abs=1e-5)  # over the sampled tokens
    # batch-normalised over both sequences: mean (1 + 4) / 2 = 2.5 -> 0.4 | 1.6
    _, w, _ = A.rollout_correction(TRAIN, ROLLOUT, MASK, is_level="sequence", batch_normalize=True, **kw)
    assert torch.allclose(w, torch.tensor([[0.4, 0.4, 0.4], [1.6, 1.6, 0.0]]), atol=1e-5)
    # token TIS (cap 2): 1, 2, 0.5 | 2, 1, normalised by their mean over all 5 tokens, 6.5 / 5 = 1.3 (the kept
    # tokens' mean would be 4.5 / 4 = 1.125)
    _, w, _ = A.rollout_correction(TRAIN, ROLLOUT, MASK, batch_normalize=True, **(kw | {"tis_cap": 2.0}))
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.5], [2.0, 1.0, 0.0]]) / 1.3, atol=1e-6)
    # rejection alone: no weights, the same keep mask
    keep_only, w, m = A.rollout_correction(TRAIN, ROLLOUT, MASK, rejection="token")
    assert w is None and torch.equal(keep_only, keep) and "is_weight_mean" not in m


def test_the_advantages_stage_weighs_before_it_rejects():
    """The session's advantages stage hands the workers verl's order too: sequence weights over every sampled token
    (row 1: 4, not the kept token's 1) beside the keep mask that drops row 1's first token."""
    algo = AlgorithmConfig(is_correction="tis", tis_cap=5.0, is_level="sequence", rejection="token",
                           reject_low=0.5, reject_high=2.0)
    st = StepState(step=0, rows=[], batch=None, train_logprobs=TRAIN)
    metrics = _rollout_correction(SimpleNamespace(cfg=SimpleNamespace(algorithm=algo)), st,
                                  {"loss_mask": MASK, "old_logprobs": ROLLOUT})
    assert torch.equal(st.keep, torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]))
    assert torch.allclose(st.is_weights, torch.tensor([[1.0, 1.0, 1.0], [4.0, 4.0, 0.0]]), atol=1e-5)
    assert metrics["rollout_corr/reject_token_frac"] == pytest.approx(1 / 5)
