"""The per-algorithm demo recipes learn: the rollout reward rises within 20 steps (slow: ~15-50 s each on 1 thread,
about twice that for ppo, which also trains a critic)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from bench.e2e.bare_loop import run_bare, run_steps
from rlflow.engines.core import algorithms
from rlflow.engines.core.batch import RolloutBatch
from rlflow.engines.core.config import load_recipe
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model

SHORT = ["train.steps=2", "eval.every=0", "train.threads=1", "checkpoint.every=0", "rollout.prompts_per_step=8",
         "rollout.samples_per_prompt=4"]


def _short_recipe(tmp_path, recipe: str = "deployments/sort-tiny.yaml", *extra: str):
    """`recipe` for a 2-step run with its data under tmp_path."""
    data = [f"data.train_path={tmp_path}/train.jsonl", f"data.eval_path={tmp_path}/eval.jsonl"]
    return load_recipe(recipe, [*data, *SHORT, *extra])


@contextlib.contextmanager
def _session(cfg, tmp_path, model: str | None = None) -> Iterator[RLSession]:
    """An in-process session of `cfg` (data and model prepared; `model`: one already prepared), shut down after."""
    if model is None:
        prepare_data(cfg)
        model = prepare_model(cfg, str(tmp_path))
    session = RLSession.create(cfg, model, use_ray=False)
    try:
        yield session
    finally:
        session.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rloo", "reinforce-pp", "ppo", "cispo", "gmpo", "sapo", "clip-cov", "kl-cov", "opo",
                                  "grpo-passk", "rollout-corr", "adaptive-kl", "remax"])
def test_recipe_reward_rises(name, tmp_path):
    overrides = [f"data.train_path={tmp_path}/train.jsonl", f"data.eval_path={tmp_path}/eval.jsonl",
                 "train.steps=20", "eval.every=0", "train.threads=1", "checkpoint.every=0"]
    cfg = load_recipe(f"deployments/sort-tiny-{name}.yaml", overrides)
    rewards = [m["rollout/reward_mean"] for m in run_bare(cfg, str(tmp_path), log=lambda line: None)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"{name}: steps 0-4 {first:.3f}, steps 15-19 {last:.3f}")  # shown with -s
    # 40-step runs went from ~0.08 (steps 0-4) to ~0.39 (steps 15-19); a broken estimator stays near 0.08.
    # The policy losses' recipes (20 steps): ~0.09-0.10 -> 0.40-0.44 (docs/algorithms.md, Recipes)
    assert last > first + 0.15, rewards


# The expected advantages below are worked out with numpy from the step's batch (rewards, groups, loss masks), apart
# from the torch implementation under test.


def _by_group(b: RolloutBatch) -> list[np.ndarray]:
    """The sample indices of each group of the batch."""
    return [np.flatnonzero(b.group == g) for g in np.unique(b.group)]


def _centred(b: RolloutBatch) -> np.ndarray:
    """r - its group's mean reward, per sample."""
    r = b.reward.astype(np.float64)
    out = np.zeros_like(r)
    for rows in _by_group(b):
        out[rows] = r[rows] - r[rows].mean()
    return out


def _grpo(b: RolloutBatch) -> np.ndarray:
    r, out = b.reward.astype(np.float64), np.zeros(len(b))
    for rows in _by_group(b):
        if np.ptp(r[rows]) > 0:
            out[rows] = (r[rows] - r[rows].mean()) / (r[rows].std(ddof=1) + 1e-6)
    return out


def _opo(b: RolloutBatch) -> np.ndarray:
    """r - the group's mean reward weighted by each sample's trained-on response tokens."""
    r = b.reward.astype(np.float64)
    lengths = np.array([m.sum() for m in b.split("loss_mask")], dtype=np.float64)
    out = np.zeros(len(b))
    for rows in _by_group(b):
        if np.ptp(r[rows]) > 0:
            out[rows] = r[rows] - (lengths[rows] * r[rows]).sum() / lengths[rows].sum()
    return out


def _grpo_passk(b: RolloutBatch) -> np.ndarray:
    """Only each group's best sample (the first in batch order on a tie for the top) gets (best - second) / std."""
    r, out = b.reward.astype(np.float64), np.zeros(len(b))
    for rows in _by_group(b):
        ranked = sorted(rows, key=lambda i: -r[i])  # stable: batch order among equal rewards
        margin = r[ranked[0]] - r[ranked[1]]
        if margin > 0:
            out[ranked[0]] = margin / (r[rows].std(ddof=1) + 1e-6)
    return out


def _passk(b: RolloutBatch, k: int, threshold: float) -> np.ndarray:
    """Pass@k Training's analytic advantages, from the numbers of wrong samples per group."""
    r, out = b.reward.astype(np.float64), np.zeros(len(b))
    for rows in _by_group(b):
        n, wrong = len(rows), r[rows] < threshold
        neg = int(wrong.sum())
        mean = 1 - math.comb(neg, k) / math.comb(n, k)
        if 0 < mean < 1:
            std = math.sqrt(mean * (1 - mean))
            a_neg = (1 - mean - math.comb(neg - 1, k - 1) / math.comb(n - 1, k - 1)) / std
            out[rows] = np.where(wrong, a_neg, (1 - mean) / std)
    return out


def _remax(b: RolloutBatch) -> np.ndarray:
    r = b.reward.astype(np.float64)
    greedy = {int(g): r[i] for i, g in enumerate(b.group) if b.baseline[i]}
    return np.array([0.0 if b.baseline[i] else r[i] - greedy[int(g)] for i, g in enumerate(b.group)])


@pytest.mark.parametrize("advantage", ["reinforce_pp_baseline", "reinforce_pp_baseline_seq"])
def test_reinforce_pp_baseline_variants_give_their_advantages_and_train(advantage, tmp_path):
    """The token form hands the trainer [B, T] advantages: r - group mean on every response token, whitened by the
    mean and unbiased std over all response tokens of the batch (a long sample counts once per token), 0 off
    them. The per-sample form gives [B]: r - group mean, divided by the unbiased std of those values over the
    samples. Both then train."""
    cfg = _short_recipe(tmp_path, "deployments/sort-tiny.yaml", f"algorithm.advantage={advantage}")
    with _session(cfg, tmp_path) as session:
        session.rollout(0)
        session.reward(0)
        session.advantages(0)
        st = session.steps.get(0)
        centred = _centred(st.batch)
        assert np.abs(centred).max() > 0  # some group carries a signal, or the comparison proves little
        if advantage == "reinforce_pp_baseline":
            mask = st.batch.to_train_batch(0, torch.zeros(len(st.batch)))["loss_mask"].numpy() > 0
            per_token = np.broadcast_to(centred[:, None], mask.shape)
            tokens = per_token[mask]
            expected = np.where(mask, (per_token - tokens.mean()) / (tokens.std(ddof=1) + 1e-6), 0.0)
        else:
            expected = centred / (centred.std(ddof=1) + 1e-6)
        assert tuple(st.advantages.shape) == expected.shape
        np.testing.assert_allclose(st.advantages.numpy(), expected, atol=1e-5)
        assert math.isfinite(session.train(0)["train/loss"])


@pytest.mark.parametrize("name", ["opo", "grpo-passk", "passk", "rollout-corr", "adaptive-kl", "remax"])
def test_new_recipes_run_two_steps_in_the_loop(name, tmp_path):
    """Each recipe of the newer estimators and corrections trains two steps through the loop (the learning itself is
    the slow test above), and the last step holds what the recipe claims: the estimator's advantages for the
    step's rewards, the rollout correction's weights, the adaptive KL coefficient's move."""
    cfg = _short_recipe(tmp_path, f"deployments/sort-tiny-{name}.yaml")
    with _session(cfg, tmp_path) as session:
        history = run_steps(session, cfg, log=lambda line: None)
        st = session.steps.get(1)
    assert len(history) == 2 and all(m["adv/abs_mean"] > 0 and math.isfinite(m["train/loss"]) for m in history)
    b, adv = st.batch, st.advantages.numpy()
    if name in ("opo", "grpo-passk", "passk", "remax"):
        a = cfg.algorithm
        expected = {"opo": _opo, "grpo-passk": _grpo_passk, "remax": _remax,
                    "passk": lambda b: _passk(b, a.passk_k, a.passk_threshold)}[name](b)
        assert np.abs(expected).max() > 0
        np.testing.assert_allclose(adv, expected, atol=1e-5)
    if name == "remax":  # 8 prompts x (4 samples + 1 greedy baseline)
        assert len(b) == 8 * 5 and b.baseline.sum() == 8
        assert all(0 <= m["rollout/greedy_reward_mean"] <= 1 for m in history)
    if name == "rollout-corr":
        # sequence TIS, batch-normalised: one weight per sequence on its tokens, averaging 1 over the sequences;
        # the embedded engines agree to ~1e-6, so no sequence leaves the geometric bounds and the weights are ~1
        mask = b.to_train_batch(0, torch.zeros(len(b)))["loss_mask"] > 0
        w = st.is_weights
        per_seq = w.max(-1).values
        assert torch.equal(torch.where(mask, per_seq[:, None], 0.0), w)
        assert per_seq.mean().item() == pytest.approx(1.0, abs=1e-6)
        assert torch.allclose(per_seq, torch.ones_like(per_seq), atol=1e-3)
        assert torch.equal(st.keep, mask.float())
        np.testing.assert_allclose(adv, _grpo(b), atol=1e-5)
        for m in history:  # measured over the whole batch by the session; the weights reach the trainer
            assert m["rollout_corr/reject_seq_frac"] == 0 and m["rollout_corr/mismatch_kl"] < 1e-3
            assert m["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    if name == "adaptive-kl":  # step 1's coefficient is step 0's moved by step 0's KL (32 samples a step)
        a = cfg.algorithm
        assert history[0]["adv/kl_coef"] == a.kl_coef
        assert history[1]["adv/kl_coef"] == pytest.approx(
            algorithms.adaptive_kl_coef(a.kl_coef, history[0]["adv/kl_mean"], a.kl_target, a.kl_horizon, 32))
        assert history[1]["adv/kl_coef"] != a.kl_coef


def test_adaptive_kl_coefficient_is_saved_and_restored(tmp_path):
    """The controller's coefficient is part of the checkpoint's controller state (JSON), so a resumed run goes on
    from the coefficient the interrupted one had reached, not from the recipe's kl_coef."""
    cfg = _short_recipe(tmp_path, "deployments/sort-tiny-adaptive-kl.yaml")
    prepare_data(cfg)
    model = prepare_model(cfg, str(tmp_path))
    with _session(cfg, tmp_path, model) as first:
        run_steps(first, cfg, log=lambda line: None)
        state = json.loads(json.dumps(first.save(tmp_path / "ckpt", 1)))
        reached = first.kl_coef
    assert state["kl_coef"] == reached != cfg.algorithm.kl_coef
    with _session(cfg, tmp_path, model) as resumed:
        assert resumed.kl_coef == cfg.algorithm.kl_coef
        resumed.load(tmp_path / "ckpt", state)
        assert resumed.kl_coef == reached


def test_remax_step_holds_one_greedy_baseline_per_prompt(tmp_path):
    """The rollout stage appends each prompt's greedy response to its group, marked as the baseline with an
    all-0 loss mask; its reward is the others' baseline and its own advantage 0; the step trains."""
    cfg = _short_recipe(tmp_path, "deployments/sort-tiny-remax.yaml")
    with _session(cfg, tmp_path) as session:
        session.rollout(0)
        session.reward(0)
        session.advantages(0)
        b, adv = session.rollout_batch(0), session.steps.get(0).advantages
        assert len(b) == 8 * 5 and b.baseline.sum() == 8
        assert sorted(b.group[b.baseline].tolist()) == list(range(8))  # one per group, the group's last
        masks = b.split("loss_mask")
        assert all(not masks[i].any() for i in np.flatnonzero(b.baseline))
        assert all(masks[i].all() for i in np.flatnonzero(~b.baseline))
        baseline_reward = {int(g): r for g, r in zip(b.group[b.baseline], b.reward[b.baseline], strict=True)}
        expected = [0.0 if base else r - baseline_reward[int(g)]
                    for g, r, base in zip(b.group, b.reward, b.baseline, strict=True)]
        assert torch.allclose(adv, torch.tensor(expected, dtype=torch.float32), atol=1e-6)
        assert "train/loss" in session.train(0)
        assert RolloutBatch.from_arrow(session.rollout_table(0)).baseline.tolist() == b.baseline.tolist()



@pytest.mark.parametrize("advantage", ["grpo", "opo", "passk"])
def test_the_advantages_stage_takes_uneven_shuffled_groups(advantage, tmp_path):
    """A batch whose groups are of unequal size and not consecutive (a filter dropped samples, the order was
    shuffled) goes through the advantages and train stages: each sample's advantage is the estimator's over its
    own group, found by group id (main's layout check refused such a batch)."""
    extra = ["train.mini_batches=1", f"algorithm.advantage={advantage}"]
    if advantage == "passk":
        extra += ["algorithm.passk_k=2", "algorithm.passk_threshold=0.25"]
    cfg = _short_recipe(tmp_path, "deployments/sort-tiny.yaml", *extra)
    with _session(cfg, tmp_path) as session:
        session.rollout(0)
        session.reward(0)
        st = session.steps.get(0)
        keep = [i for i in range(32) if i % 4 >= (i // 4) % 3]  # group g keeps 4, 3 or 2 of its samples
        order = torch.randperm(len(keep), generator=torch.Generator().manual_seed(0)).tolist()
        st.batch = b = st.batch.select([keep[i] for i in order])
        session.advantages(0)
        adv = st.advantages
        assert np.bincount(b.group).tolist() == [4 - g % 3 for g in range(8)]
        rewards = torch.tensor(b.reward, dtype=torch.float32)
        for g in range(8):  # each group on its own gives the same advantages
            rows = torch.from_numpy(np.flatnonzero(b.group == g))
            r, n, lengths = rewards[rows], len(rows), torch.from_numpy(b.lengths[rows]).float()
            if advantage == "grpo":
                alone = algorithms.group_advantages(r, n)
            elif advantage == "opo":
                alone = algorithms.opo_advantages(r, n, lengths)
            else:
                alone = algorithms.passk_advantages(r, n, 2, 0.25)
            assert torch.allclose(adv[rows], alone, atol=1e-6)
        assert adv.abs().sum() > 0 and "train/loss" in session.train(0)
