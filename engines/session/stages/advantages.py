"""The advantages stage: rewards -> advantages. Overlong shaping and KL-in-reward first (with the adaptive KL
controller), rollout correction's rejection mask and importance weights over the whole batch, the critic's values
and GAE, then the recipe's estimator (engines/core/algorithms/)."""

from __future__ import annotations

import numpy as np
import torch

from rlflow.engines.core import algorithms
from rlflow.engines.core.batch import TrainBatch
from rlflow.engines.core.on_policy import DIFF_TOKENS, check_on_policy
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.session.stages.train_batch import critic_values, pack, train_logprobs
from rlflow.engines.session.step_state import StepState

TOKEN_ADVANTAGES = ("reinforce_pp", "gae", "reinforce_pp_baseline")  # estimators giving per-token advantages


def run(s: RunEngines, st: StepState) -> dict[str, float]:
    """Rewards -> advantages: overlong shaping and KL-in-reward first, then the recipe's estimator.

    KL in the reward needs per-token logprobs of the reference (and, with IS correction, of the train
    engine): the train workers compute them here, and the train stage reuses the train engine's. With a
    critic, its workers compute the values of the batch here, and GAE turns them into advantages and into
    the returns the critic trains on.
    """
    algo, groups = s.cfg.algorithm, torch.as_tensor(st.batch.group)
    rewards = scored = torch.tensor(st.batch.reward, dtype=torch.float32)
    metrics = {}
    if algo.overlong_buffer and algo.overlong_penalty:
        lengths = torch.as_tensor(st.batch.lengths)
        pen = algorithms.overlong_penalty(lengths, s.cfg.rollout.max_new_tokens, algo.overlong_buffer,
                                          algo.overlong_penalty)
        rewards = rewards + pen
        metrics |= {"adv/overlong_penalty": float(pen.mean()), "adv/overlong_frac": float((pen < 0).float().mean())}
    kl_in_reward = algo.kl_in == "reward" and algo.kl_coef > 0
    token_level = algo.advantage in TOKEN_ADVANTAGES or s.critic_group is not None
    st.train_logprobs, st.keep, st.is_weights, mask, penalty = None, None, None, None, None
    if kl_in_reward or token_level or algo.corrects_rollout:
        batch = pack(s, st, torch.zeros(len(rewards)))
        mask = batch["loss_mask"]
        penalty = torch.zeros_like(mask)
        if algo.corrects_rollout:  # the train engine's logprobs become PPO's old policy (with_train_logprobs)
            st.train_logprobs = train_logprobs(s, batch)
            metrics |= _rollout_correction(s, st, batch)
            # measured here, over the whole batch; without correction the train step's first forward measures it
            diff = algorithms.logprob_diff(st.train_logprobs, batch["old_logprobs"], batch["loss_mask"])
            metrics |= {f"train/{k}": v for k, v in algorithms.logprob_diff_metrics(diff).items()}
            if s.cfg.rollout.true_on_policy:  # exactly 0, or the step stops here (engines/core/on_policy.py)
                metrics[DIFF_TOKENS] = float(diff[2])
                check_on_policy(st.step, metrics)
            mask = mask * st.keep
        if kl_in_reward:
            # the behaviour policy: the rollout engine's, or with correction the train engine's, which PPO's
            # ratio is also taken against
            policy = batch["old_logprobs"] if st.train_logprobs is None else st.train_logprobs
            ref = train_logprobs(s, batch, reference=True)
            kl = algorithms.kl_reward_penalty(policy, ref, mask, 1.0, algo.kl_estimator)
            metrics |= _kl_in_reward(s, st, kl, mask)
            penalty = st.kl_coef * kl
            metrics["adv/kl_penalty"] = float(penalty.sum(-1).mean())
    if token_level:
        token_rewards = algorithms.outcome_token_rewards(rewards, mask) - penalty
    if s.critic_group is not None:
        st.values = critic_values(s.critic_group, batch)
        gae, st.returns = algorithms.gae_advantages(token_rewards, st.values, mask, algo.gamma, algo.lam)
        metrics |= {
            "critic/values_mean": float(algorithms.masked_mean(st.values, mask)),
            "critic/returns_mean": float(algorithms.masked_mean(st.returns, mask)),
            "critic/vf_explained_var": float(algorithms.explained_variance(st.values, st.returns, mask)),
        }
    if kl_in_reward and algo.advantage not in ("reinforce_pp", "gae"):  # those take the per-token penalty
        rewards = rewards - penalty.sum(-1)
    if algo.advantage in TOKEN_ADVANTAGES:  # [B, T]
        if algo.advantage == "gae":  # whitened over the batch's response tokens, as verl does
            st.advantages = algorithms.masked_whiten(gae, mask)
        elif algo.advantage == "reinforce_pp":
            st.advantages = algorithms.reinforce_pp_advantages(token_rewards, mask, algo.gamma)
        else:
            st.advantages = algorithms.reinforce_pp_baseline_advantages(rewards, groups, mask)
        abs_mean = float(algorithms.masked_mean(st.advantages.abs(), mask))
    else:
        st.advantages = _sequence_advantages(s, st, rewards, groups)
        abs_mean = float(st.advantages.abs().mean())
    if rewards is not scored:
        metrics["adv/shaped_reward_mean"] = float(rewards.mean())
    return metrics | s.gpu.take_metrics() | {
        "adv/abs_mean": abs_mean,
        "adv/zero_std_groups": float(algorithms.equal_reward_groups(rewards, groups).float().mean()),
    }


def _sequence_advantages(s: RunEngines, st: StepState, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    algo = s.cfg.algorithm
    if algo.advantage in ("grpo", "dr_grpo"):
        normalize = algo.normalize_std if algo.normalize_std is not None else algo.advantage == "grpo"
        return algorithms.group_advantages(rewards, groups, normalize)
    if algo.advantage == "passk":
        return algorithms.passk_advantages(rewards, groups, algo.passk_k, algo.passk_threshold)
    if algo.advantage == "grpo_passk":
        return algorithms.grpo_passk_advantages(rewards, groups, algo.normalize_std is not False)
    if algo.advantage == "rloo":
        return algorithms.rloo_advantages(rewards, groups)
    if algo.advantage == "remax":
        return algorithms.remax_advantages(rewards, groups, torch.as_tensor(st.batch.baseline))
    if algo.advantage == "opo":  # lengths: the response tokens each sample trains on
        trained = torch.from_numpy(st.batch.loss_mask.astype(np.float32))
        sample = torch.from_numpy(np.repeat(np.arange(len(st.batch)), st.batch.lengths))
        lengths = torch.zeros(len(st.batch)).index_add_(0, sample, trained)
        return algorithms.opo_advantages(rewards, groups, lengths)
    return algorithms.reinforce_pp_baseline_seq_advantages(rewards, groups)


def _rollout_correction(s: RunEngines, st: StepState, batch: TrainBatch) -> dict[str, float]:
    """Rejection mask and importance weights of the step over its whole batch (batch normalisation needs
    all of it; a micro-batch would give another mean): the train stage hands both to the workers."""
    algo = s.cfg.algorithm
    st.keep, st.is_weights, metrics = algorithms.rollout_correction(
        st.train_logprobs, batch["old_logprobs"], batch["loss_mask"], is_correction=algo.is_correction,
        tis_cap=algo.tis_cap, icepop_low=algo.icepop_low, icepop_high=algo.icepop_high, is_level=algo.is_level,
        batch_normalize=algo.is_batch_normalize, rejection=algo.rejection, reject_low=algo.reject_low,
        reject_high=algo.reject_high)
    return {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}


def _kl_in_reward(s: RunEngines, st: StepState, kl: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Fix the step's KL-in-reward coefficient and, with adaptive kl_ctrl, move the next step's by the KL
    measured here (mean over samples of the per-token mean). A retried stage reuses the step's coefficient,
    so the controller moves once per step."""
    algo = s.cfg.algorithm
    if st.kl_coef is None:
        st.kl_coef = s.kl_coef
    out = {"adv/kl_coef": st.kl_coef}
    if algo.kl_ctrl == "adaptive":
        current = float((kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean())
        s.kl_coef = algorithms.adaptive_kl_coef(st.kl_coef, current, algo.kl_target, algo.kl_horizon, len(kl))
        out["adv/kl_mean"] = current
    return out
