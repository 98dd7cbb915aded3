"""health: the run-health gates checked after every step (engines/core/health.py), each warn, fail or off."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from rlflow.engines.core.config.base import Section

ACTIONS = ("warn", "fail", "off")


def _yaml_off(value: Any) -> Any:
    """YAML 1.1 reads a bare `off` as false (and `on` as true): `off` is what was meant."""
    return "off" if value is False else value


Action = Annotated[Literal["warn", "fail", "off"], BeforeValidator(_yaml_off)]
ACTION_HELP = ("warn: log the finding and tag the MLflow run; fail: also stop the run with HealthCheckFailed; "
               "off: not checked.")


class HealthCheck(Section):
    """One check; `health.<check>: warn` (or fail, off) is short for `health.<check>.action: ...`."""

    action: Action = Field("warn", description=ACTION_HELP)

    @model_validator(mode="before")
    @classmethod
    def _action_shorthand(cls, data: Any) -> Any:
        if isinstance(data, bool | str):
            value = _yaml_off(data)
            if value not in ACTIONS:
                raise ValueError(f"{data!r} is not a check setting: give one of {', '.join(ACTIONS)}, or a mapping "
                                 "of the check's fields (action, thresholds)")
            return {"action": value}
        return data


DEFAULT_FINITE = ("train/loss", "train/grad_norm", "rollout/reward_mean", "adv/abs_mean",
                  "train/rollout_logprob_diff_max", "train/rollout_logprob_diff_mean")


class NonFiniteCheck(HealthCheck):
    """NaN or Inf in a step's loss, gradient norm, rewards, advantages or log-probs (their metrics: a NaN anywhere
    in a mean or max makes it NaN). A NaN never reaches MLflow (it drops non-finite points), so this is where it
    shows."""

    action: Action = Field("fail", description=ACTION_HELP)
    metrics: list[str] = Field(list(DEFAULT_FINITE), min_length=1,
                               description="The step metrics that must be finite; a metric the step lacks is skipped.")


class FirstStepCheck(HealthCheck):
    """At the first train step of each attempt (a fresh run, and every resume) the trainer must score the sampled
    tokens as the rollout engine did: a mean |train - rollout log-prob| above the threshold means the engine
    sampled with other weights (a broken weight sync, a wrong checkpoint)."""

    max_logprob_diff_mean: float = Field(
        0.1, gt=0, description="Largest train/rollout_logprob_diff_mean (mean |log importance ratio| per token) "
        "allowed at the first step (the embedded engines in fp32 on the CPU: ~1e-7).")


class LogprobMismatchCheck(HealthCheck):
    """Every step: the train/rollout log-prob difference above a threshold."""

    statistic: Literal["max", "mean"] = Field(
        "max", description="Which metric is bounded: train/rollout_logprob_diff_max or "
        "train/rollout_logprob_diff_mean.")
    threshold: float = Field(2.0, gt=0, description="Largest value allowed (a log-prob difference: 2.0 is a factor "
                             "of e^2 ~ 7.4 between the engines' probabilities of one token).")


class EntropyCollapseCheck(HealthCheck):
    """The policy's mean entropy (train/entropy) below a threshold for `window` consecutive steps."""

    threshold: float = Field(0.01, ge=0, description="train/entropy at or below this counts as collapsed.")
    window: int = Field(10, gt=0, description="Consecutive collapsed steps before the check fires.")


class RewardCollapseCheck(HealthCheck):
    """No learning signal for `window` consecutive steps: every group's rewards equal (adv/zero_std_groups = 1;
    with one sample per prompt, rollout/reward_std = 0), e.g. the reward flat at its minimum."""

    min_zero_std_groups: float = Field(
        1.0, gt=0, le=1, description="Share of groups with equal rewards at or above which a step counts as "
        "collapsed (1: all of them).")
    window: int = Field(10, gt=0, description="Consecutive collapsed steps before the check fires.")


class HealthConfig(Section):
    """Run-health gates, checked after each step's metrics are logged (docs/metrics.md, "Run health"). A finding
    shows as a Prefect artifact and an MLflow tag `health.<check>`; a failing one stops the run (the data written
    so far, checkpoints and persisted rollout batches, stays)."""

    non_finite: NonFiniteCheck = Field(default_factory=NonFiniteCheck)
    first_step: FirstStepCheck = Field(default_factory=FirstStepCheck)
    logprob_mismatch: LogprobMismatchCheck = Field(default_factory=LogprobMismatchCheck)
    entropy_collapse: EntropyCollapseCheck = Field(default_factory=EntropyCollapseCheck)
    reward_collapse: RewardCollapseCheck = Field(default_factory=RewardCollapseCheck)
