"""RL algorithms as pure tensor functions, shared by every train and rollout backend.

Shapes: B sequences, T token positions, V vocabulary. `mask` is 1 on the tokens that are trained on and 0 on
prompt and padding positions. Whatever sits under mask == 0 (even inf or NaN) never reaches a result or a gradient.
Nothing here holds state or does I/O, so each function is tested against numbers worked out by hand
(tests/test_algorithms.py and its neighbours). One module per kind, lowest first:

  common              masked means, importance-weight application, the clamped log-ratio
  logprobs            logits -> the sampled token's log-probability and the entropy
  aggregation         per-token losses -> a scalar (loss_agg), exact over micro-batches and ranks
  returns             token-level credit: outcome token rewards, discounted returns, whitening, REINFORCE++, GAE
  advantages          sequence-level estimators over groups (GRPO, RLOO, OPO, pass@k, ReMax, ...), overlong shaping
  kl                  KL estimators, KL in the reward, the adaptive coefficient
  rollout_correction  importance weights and rejection masks against the rollout/train mismatch, and its size
  policy_losses       PPO-clip, GSPO, CISPO, GMPO, SAPO, Clip-Cov, KL-Cov
  distillation        on-policy distillation (sampled-token reverse KL, top-k forward KL / JSD)
  supervised          the critic's value loss and SFT's negative log-likelihood
  objective           rl_loss: the policy loss, importance weights, distillation, KL and entropy together

Callers import from here (`from rlflow.engines.core import algorithms`); the modules are how the code is read.
"""

from __future__ import annotations

from rlflow.engines.core.algorithms.advantages import (
    Groups,
    equal_reward_groups,
    group_advantages,
    grpo_passk_advantages,
    opo_advantages,
    overlong_penalty,
    passk_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_baseline_seq_advantages,
    remax_advantages,
    rloo_advantages,
)
from rlflow.engines.core.algorithms.aggregation import (
    AGGREGATED_METRICS,
    LOSS_AGG_MODES,
    SUM_AGG_MODES,
    aggregate_loss,
    aggregation_weight,
    micro_batch_scales,
    scale_metrics,
)
from rlflow.engines.core.algorithms.common import LOG_RATIO_CLAMP, masked_mean
from rlflow.engines.core.algorithms.distillation import (
    DISTILL_LOSSES,
    TOPK_DISTILL_LOSSES,
    distill_loss,
    topk_distill_loss,
)
from rlflow.engines.core.algorithms.kl import KL_ESTIMATORS, adaptive_kl_coef, kl_penalty, kl_reward_penalty
from rlflow.engines.core.algorithms.logprobs import entropy_from_logits, entropy_from_logprobs, token_logprobs
from rlflow.engines.core.algorithms.objective import rl_loss
from rlflow.engines.core.algorithms.policy_losses import (
    GSPO_SEQ_LOG_RATIO_MAX,
    POLICY_LOSSES,
    cispo_loss,
    clip_cov_loss,
    gmpo_loss,
    gspo_loss,
    kl_cov_loss,
    policy_loss,
    sapo_loss,
)
from rlflow.engines.core.algorithms.returns import (
    discounted_returns,
    explained_variance,
    gae_advantages,
    masked_whiten,
    outcome_token_rewards,
    reinforce_pp_advantages,
)
from rlflow.engines.core.algorithms.rollout_correction import (
    IS_CORRECTIONS,
    IS_LEVELS,
    LOGPROB_DIFF_MAX,
    LOGPROB_DIFF_MEAN,
    REJECTIONS,
    importance_weights,
    logprob_diff,
    logprob_diff_metrics,
    merge_logprob_diff,
    rejection_mask,
    rollout_correction,
)
from rlflow.engines.core.algorithms.supervised import sft_loss, value_loss

__all__ = [
    # constants
    "AGGREGATED_METRICS", "DISTILL_LOSSES", "GSPO_SEQ_LOG_RATIO_MAX", "IS_CORRECTIONS", "IS_LEVELS", "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP", "LOGPROB_DIFF_MAX", "LOGPROB_DIFF_MEAN", "LOSS_AGG_MODES", "POLICY_LOSSES", "REJECTIONS",
    "SUM_AGG_MODES", "TOPK_DISTILL_LOSSES",
    "Groups",
    # logits -> per-token quantities
    "entropy_from_logits", "entropy_from_logprobs", "token_logprobs", "masked_mean",
    # advantages and returns
    "discounted_returns", "equal_reward_groups", "explained_variance", "gae_advantages", "group_advantages",
    "grpo_passk_advantages", "masked_whiten", "opo_advantages", "outcome_token_rewards", "overlong_penalty",
    "passk_advantages", "reinforce_pp_advantages", "reinforce_pp_baseline_advantages",
    "reinforce_pp_baseline_seq_advantages", "remax_advantages", "rloo_advantages",
    # KL
    "adaptive_kl_coef", "kl_penalty", "kl_reward_penalty",
    # aggregation
    "aggregate_loss", "aggregation_weight", "micro_batch_scales", "scale_metrics",
    # rollout correction
    "importance_weights", "logprob_diff", "logprob_diff_metrics", "merge_logprob_diff", "rejection_mask",
    "rollout_correction",
    # losses
    "cispo_loss", "clip_cov_loss", "distill_loss", "gmpo_loss", "gspo_loss", "kl_cov_loss", "policy_loss", "rl_loss",
    "sapo_loss", "sft_loss", "topk_distill_loss", "value_loss",
]
