"""algorithm: advantage estimator, policy loss, KL, entropy and rollout/train mismatch correction."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlflow.engines.core.config.base import Section

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp_baseline_seq", "opo",
                    "grpo_passk", "passk")


# the settings of one policy loss: changed from their defaults with another loss, they would do nothing
_POLICY_LOSS_KEYS = {
    "sapo": ("sapo_tau_pos", "sapo_tau_neg"),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "kl_cov_coef"),
}


class AlgorithmConfig(Section):
    """Advantage estimator, policy loss, KL, entropy and rollout/train mismatch correction (docs/algorithms.md)."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "reinforce_pp_baseline_seq",
                       "opo", "grpo_passk", "passk", "remax", "gae"] = Field(
        "grpo",
        description="grpo: (r - mean) / std per group; dr_grpo: r - mean; rloo: r - mean of the group's other "
        "samples; reinforce_pp: discounted token returns whitened over the batch (no group needed); "
        "reinforce_pp_baseline: r - group mean, whitened over the batch's response tokens (verl, OpenRLHF); "
        "reinforce_pp_baseline_seq: r - group mean, divided by its std over the batch's samples; opo: r - the "
        "length-weighted mean reward of the group (OPO's optimal baseline); grpo_passk: only each group's best "
        "sample is reinforced, by its margin over the runner-up (pass@n training, verl's grpo_passk); passk: "
        "analytic pass@k advantages for binary rewards (passk_k; Pass@k Training); remax: r - the "
        "reward of the prompt's greedy response, generated as one extra sample per prompt (ReMax); gae: PPO "
        "with a "
        "critic (the critic section), generalised advantage estimation over the critic's token values, whitened "
        "over the batch. Group estimators take groups by the samples' group ids: groups may differ in size.",
    )
    normalize_std: bool | None = Field(
        None, description="Override std normalisation of grpo / dr_grpo / grpo_passk (default: grpo and grpo_passk "
        "yes, dr_grpo no)."
    )
    passk_k: int = Field(
        2, ge=1, description="passk: the k of pass@k the group's reward is (at most rollout.samples_per_prompt). "
        "1 is GRPO on 0/1 rewards; a larger k rewards exploration (a prompt counts as solved by any of k samples).",
    )
    passk_threshold: float = Field(
        1.0, description="passk: a sample counts as correct when its reward is >= this (1: fully correct, as "
        "rollout/accuracy counts).",
    )
    gamma: float = Field(
        1.0, gt=0.0, le=1.0,
        description="Discount of reinforce_pp's and gae's token returns; 1 credits every token fully.",
    )
    lam: float = Field(
        1.0, ge=0.0, le=1.0,
        description="GAE's lambda (gae and a critic only): 1 is Monte-Carlo returns minus V (unbiased, noisier); "
        "0 the one-step TD error r_t + gamma V_t+1 - V_t (leans on the critic).",
    )
    policy_loss: Literal["ppo", "gspo", "cispo", "gmpo", "sapo", "clip_cov", "kl_cov"] = Field(
        "ppo",
        description="ppo: token-level clipped ratio; gspo: clipped sequence ratio exp(mean token log-ratio) "
        "(use clip_low 3e-4, clip_high 4e-4 and loss_agg seq_mean_token_mean); cispo: clipped importance weight "
        "under stop-gradient times log p, every token keeps a gradient (MiniMax-M1); gmpo: geometric mean of the "
        "token ratios, clip_low / clip_high bound the log-ratio (paper: 0.4 / 0.4, seq_mean_token_mean); sapo: "
        "sigmoid soft gate instead of a clip (sapo_tau_pos / sapo_tau_neg, seq_mean_token_mean); clip_cov: PPO-clip "
        "and the gradient of a few high-covariance tokens detached; kl_cov: unclipped ratio and a |log-ratio| "
        "penalty on the highest-covariance tokens (docs/algorithms.md).",
    )
    clip_low: float = Field(
        0.2, ge=0.0, description="Ratio may fall to 1 - clip_low before the loss clips it (gmpo: the log-ratio to "
        "-clip_low; cispo: >= 1 sets no lower bound, as the paper; unused by sapo and kl_cov)."
    )
    clip_high: float = Field(
        0.2, ge=0.0, description="Ratio may rise to 1 + clip_high; above clip_low is DAPO's clip-higher (gmpo: the "
        "log-ratio to clip_high; unused by sapo and kl_cov)."
    )
    clip_ratio_c: float | None = Field(
        None,
        gt=1.0,
        description="Dual-clip PPO: caps the loss of negative-advantage tokens at clip_ratio_c * |A| (typically "
        "3); empty disables. ppo only.",
    )
    sapo_tau_pos: float = Field(
        1.0, gt=0.0, description="sapo: temperature of the soft gate for tokens with A > 0 (paper: 1.0); larger "
        "damps a token's gradient sooner as its ratio leaves 1.",
    )
    sapo_tau_neg: float = Field(
        1.05, gt=0.0, description="sapo: temperature for tokens with A <= 0 (paper: 1.05; above sapo_tau_pos, "
        "since negative updates destabilise more).",
    )
    clip_cov_ratio: float = Field(
        2e-4, gt=0.0, le=1.0, description="clip_cov: share of a micro-batch's response tokens (at least 1) whose "
        "gradient is detached, drawn among those with covariance in (clip_cov_lb, clip_cov_ub) (paper: 2e-4).",
    )
    clip_cov_lb: float = Field(1.0, description="clip_cov: covariance a token must exceed to be drawn (paper: 1).")
    clip_cov_ub: float = Field(5.0, description="clip_cov: covariance a token must stay below to be drawn (paper: 5).")
    kl_cov_ratio: float = Field(
        2e-4, gt=0.0, le=1.0, description="kl_cov: share of a micro-batch's response tokens (at least 1), those "
        "with the largest covariance, that get the KL penalty (authors' recipes: 2e-3 for 7B, 2e-4 for 32B).",
    )
    kl_cov_coef: float = Field(
        1.0, ge=0.0, description="kl_cov: weight of the |log(p / p_old)| penalty on those tokens (verl's ppo_kl_coef; "
        "authors' recipes: 1).",
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum",
                      "seq_mean_token_sum"] = Field(
        "token_mean",
        description="How per-token losses become one number: over all tokens, per sequence then batch, "
        "Dr.GRPO's sum over tokens divided by a constant (max_new_tokens), the plain sum over tokens (token_sum), "
        "or each sequence's sum averaged over sequences (seq_mean_token_sum).",
    )
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of KL to the frozen reference model; 0 disables it.")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3",
        description="k1: log-ratio; k2: squared log-ratio / 2; k3: the low-variance estimator q/p - log(q/p) - 1, "
        "clamped to [-10, 10] as verl's; low_var_kl: verl's name for the same k3.",
    )
    kl_ctrl: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: kl_coef throughout. adaptive: PPO's adaptive KL controller (kl_in: reward "
        "only, as verl's kl_ctrl): kl_coef is the starting value, then each step it is multiplied by "
        "1 + clip(KL / kl_target - 1, -0.2, 0.2) * batch size / kl_horizon, with KL the batch's mean per-token KL; "
        "the coefficient is saved with each checkpoint.",
    )
    kl_target: float = Field(0.1, gt=0.0, description="adaptive kl_ctrl: the KL per token the coefficient steers "
                             "toward (verl's target_kl).")
    kl_horizon: int = Field(10000, gt=0, description="adaptive kl_ctrl: samples over which the coefficient may "
                            "change by the full 20% (verl's horizon).")
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: kl_coef * KL is added to the loss; reward: kl_coef * per-token KL is subtracted from "
        "the rewards before the advantages.",
    )
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (subtracted from the loss).")
    is_correction: Literal["none", "tis", "icepop"] = Field(
        "none",
        description="Rollout/train mismatch correction: tis weighs each token by min(p_train / p_rollout, "
        "tis_cap); icepop drops tokens whose ratio is outside [icepop_low, icepop_high]. Either costs one "
        "extra forward pass per step (the train engine's logprobs before the update).",
    )
    is_level: Literal["token", "sequence"] = Field(
        "token", description="Ratio the is_correction weight is taken from: each token's own, or the sequence's "
        "exp(sum of token log-ratios) given to all its tokens (verl's rollout_is: sequence; unbiased, higher "
        "variance: raise tis_cap).",
    )
    is_batch_normalize: bool = Field(
        False, description="Divide the importance weights by their mean over the step's batch (tokens, or "
        "sequences at sequence level), so they only re-weight (verl's rollout_is_batch_normalize).",
    )
    rejection: Literal["none", "token", "sequence", "geometric"] = Field(
        "none", description="Rejection of mismatched rollouts (verl's rollout_rs): drop from the loss mask the "
        "tokens (token), whole sequences by their ratio exp(sum log-ratio) (sequence, verl's seq_sum_k1) or by "
        "their geometric-mean ratio exp(mean log-ratio) (geometric, verl's seq_mean_k1) whose p_rollout / "
        "p_train (verl's k1 direction) is outside [reject_low, reject_high]. Combines with is_correction; costs "
        "the same extra forward pass.",
    )
    reject_low: float = Field(0.5, gt=0.0, description="rejection: smallest p_rollout / p_train kept (at most 1).")
    reject_high: float = Field(2.0, gt=0.0, description="rejection: largest p_rollout / p_train kept (at least 1).")
    routing_replay: Literal["off", "r2", "r3"] = Field(
        "off",
        description="MoE models: force the trainer's expert choice to a recorded one (only the choice: the routing "
        "weights stay the live router's, so the router still learns). r3: the rollout engine records every token's "
        "experts and the trainer replays them in all its forwards (old logprobs and training), removing routing "
        "flips from the train/rollout mismatch. r2: the trainer records its own routing in a forward before the "
        "update and replays it in the step's training forwards (one extra forward a step). docs/algorithms.md.",
    )
    tis_cap: float = Field(2.0, gt=0.0, description="TIS: upper bound of the importance weight.")
    icepop_low: float = Field(0.5, gt=0.0, description="IcePop: smallest p_train / p_rollout kept.")
    icepop_high: float = Field(5.0, gt=0.0, description="IcePop: largest p_train / p_rollout kept.")
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO overlong shaping: the last overlong_buffer tokens before rollout.max_new_tokens cost "
        "reward linearly, up to overlong_penalty at the limit; 0 disables.",
    )
    overlong_penalty: float = Field(0.0, ge=0.0, description="Reward lost at the length limit; 0 disables.")

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.normalize_std is not None and self.advantage not in ("grpo", "dr_grpo", "grpo_passk"):
            raise ValueError(f"normalize_std applies to grpo / dr_grpo / grpo_passk only, not advantage "
                             f"{self.advantage!r}")
        if self.clip_ratio_c is not None and self.policy_loss != "ppo":
            raise ValueError("clip_ratio_c (dual clip) applies to policy_loss 'ppo' only")
        changed = [k for k in ("passk_k", "passk_threshold") if getattr(self, k) != type(self).model_fields[k].default]
        if changed and self.advantage != "passk":
            raise ValueError(f"{', '.join(changed)} apply to advantage 'passk' only (advantage is {self.advantage!r})")
        for loss, keys in _POLICY_LOSS_KEYS.items():
            changed = [k for k in keys if getattr(self, k) != type(self).model_fields[k].default]
            if changed and self.policy_loss != loss:
                verb = "apply" if len(changed) > 1 else "applies"
                raise ValueError(f"{', '.join(changed)} {verb} to policy_loss {loss!r} only "
                                 f"(policy_loss is {self.policy_loss!r})")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub})")
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"icepop_low ({self.icepop_low}) must be below icepop_high ({self.icepop_high})")
        if self.is_correction == "none" and (self.is_level != "token" or self.is_batch_normalize):
            raise ValueError("is_level / is_batch_normalize shape the is_correction weights: set is_correction "
                             "to tis or icepop")
        if not self.reject_low <= 1.0 <= self.reject_high or self.reject_low == self.reject_high:
            raise ValueError(f"reject_low ({self.reject_low}) must be <= 1 <= reject_high ({self.reject_high}), "
                             "and below it: a token the engines agree on (ratio 1) must be kept")
        if self.kl_ctrl == "adaptive" and (self.kl_in != "reward" or self.kl_coef <= 0):
            raise ValueError("kl_ctrl: adaptive steers the KL penalty in the reward: it needs kl_in: reward and "
                             f"a starting kl_coef > 0 (got kl_in {self.kl_in!r}, kl_coef {self.kl_coef})")
        return self

    @property
    def corrects_rollout(self) -> bool:
        """Whether the step needs the train engine's logprobs of the pre-update weights against the rollout's:
        importance weights or rejection."""
        return self.is_correction != "none" or self.rejection != "none"

    def loss_kwargs(self) -> dict[str, Any]:
        """rl_loss's keyword arguments from this config, so every train backend passes the same ones."""
        return {
            "clip_low": self.clip_low, "clip_high": self.clip_high, "loss_agg": self.loss_agg,
            "kl_coef": self.kl_coef if self.kl_in == "loss" else 0.0, "kl_estimator": self.kl_estimator,
            "entropy_coef": self.entropy_coef, "policy": self.policy_loss, "clip_ratio_c": self.clip_ratio_c,
            "is_correction": self.is_correction, "tis_cap": self.tis_cap,
            "icepop_low": self.icepop_low, "icepop_high": self.icepop_high, "is_level": self.is_level,
            "sapo_tau_pos": self.sapo_tau_pos, "sapo_tau_neg": self.sapo_tau_neg,
            "clip_cov_ratio": self.clip_cov_ratio, "clip_cov_lb": self.clip_cov_lb, "clip_cov_ub": self.clip_cov_ub,
            "kl_cov_ratio": self.kl_cov_ratio, "kl_cov_coef": self.kl_cov_coef,
        }
