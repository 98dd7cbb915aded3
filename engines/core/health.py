"""Run-health gates: pure checks over a run's step metrics (no I/O; tasks/health.py publishes what they find).

`HealthMonitor.observe(step, metrics)` runs every check that is not off on one step's metrics and returns the
findings; `HealthCheckFailed` is what the flow raises for a finding whose action is fail. The windowed checks
(entropy and reward collapse) count consecutive steps; `state()` is that count as JSON, stored with the
checkpoint's controller state, so a resumed run goes on counting where its checkpoint left off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlflow.engines.core.config.health import HealthConfig

DIFF_MAX, DIFF_MEAN = "train/rollout_logprob_diff_max", "train/rollout_logprob_diff_mean"
ENTROPY, ZERO_STD_GROUPS, REWARD_STD, REWARD_MEAN = ("train/entropy", "adv/zero_std_groups", "rollout/reward_std",
                                                     "rollout/reward_mean")


@dataclass(frozen=True)
class Finding:
    """A check that fired at a step: what it measured against what it allows."""

    check: str  # the field under health: non_finite, first_step, ...
    step: int
    action: str  # warn or fail
    metric: str
    value: float
    threshold: str  # what was allowed, in words ("finite", "> 0.01 for 10 steps")
    detail: str = ""

    @property
    def message(self) -> str:
        """One sentence naming the check, the step and the value."""
        extra = f" ({self.detail})" if self.detail else ""
        return (f"health check {self.check} {'failed' if self.action == 'fail' else 'warns'} at step {self.step}: "
                f"{self.metric} = {self.value:.6g}, allowed {self.threshold}{extra}")


class HealthCheckFailed(RuntimeError):
    """A run-health check set to fail fired: the run stops here, naming the check, the step and the value."""

    def __init__(self, finding: Finding):
        super().__init__(finding.message)
        self.finding = finding


class HealthMonitor:
    """The checks of `cfg` over the steps of one attempt of a run, from `start_step` (its first train step)."""

    def __init__(self, cfg: HealthConfig, start_step: int, group_size: int, state: dict | None = None):
        self.cfg, self.start_step, self.group_size = cfg, start_step, group_size
        state = state or {}
        self.entropy_low = int(state.get("entropy_low", 0))  # consecutive steps with collapsed entropy
        self.reward_flat = int(state.get("reward_flat", 0))  # ... without reward signal

    def state(self) -> dict[str, int]:
        """The window counters, for the checkpoint's controller state."""
        return {"entropy_low": self.entropy_low, "reward_flat": self.reward_flat}

    def observe(self, step: int, metrics: dict[str, float]) -> list[Finding]:
        """Every enabled check on `step`'s metrics (windows advance whether or not a check is on); the findings,
        failing ones first."""
        found = [self._non_finite(step, metrics), self._first_step(step, metrics), self._mismatch(step, metrics),
                 self._entropy(step, metrics), self._reward(step, metrics)]
        out = [f for f in found if f is not None]
        return sorted(out, key=lambda f: f.action != "fail")

    def _non_finite(self, step: int, metrics: dict[str, float]) -> Finding | None:
        c = self.cfg.non_finite
        bad = [k for k in c.metrics if k in metrics and not math.isfinite(metrics[k])]
        if c.action == "off" or not bad:
            return None
        return Finding("non_finite", step, c.action, bad[0], metrics[bad[0]], "finite",
                       f"non-finite: {', '.join(bad)}" if len(bad) > 1 else "")

    def _first_step(self, step: int, metrics: dict[str, float]) -> Finding | None:
        c = self.cfg.first_step
        value = metrics.get(DIFF_MEAN)
        if c.action == "off" or step != self.start_step or not _above(value, c.max_logprob_diff_mean):
            return None
        return Finding("first_step", step, c.action, DIFF_MEAN, value, f"<= {c.max_logprob_diff_mean:g}",
                       "the first step's samples are on-policy: the rollout engine's weights are not the trainer's "
                       "(weight sync, checkpoint)")

    def _mismatch(self, step: int, metrics: dict[str, float]) -> Finding | None:
        c = self.cfg.logprob_mismatch
        key = DIFF_MAX if c.statistic == "max" else DIFF_MEAN
        value = metrics.get(key)
        if c.action == "off" or not _above(value, c.threshold):
            return None
        return Finding("logprob_mismatch", step, c.action, key, value, f"<= {c.threshold:g}")

    def _entropy(self, step: int, metrics: dict[str, float]) -> Finding | None:
        c = self.cfg.entropy_collapse
        value = metrics.get(ENTROPY)
        if value is None:  # a step that did not train (rollout_only) neither extends nor breaks the window
            return None
        self.entropy_low = self.entropy_low + 1 if value <= c.threshold else 0
        if c.action == "off" or self.entropy_low < c.window:
            return None
        return Finding("entropy_collapse", step, c.action, ENTROPY, value,
                       f"> {c.threshold:g} within {c.window} steps", f"{self.entropy_low} steps in a row")

    def _reward(self, step: int, metrics: dict[str, float]) -> Finding | None:
        c = self.cfg.reward_collapse
        key = ZERO_STD_GROUPS if self.group_size > 1 else REWARD_STD
        value = metrics.get(key)
        if value is None:
            return None
        flat = value >= c.min_zero_std_groups if key == ZERO_STD_GROUPS else value == 0
        self.reward_flat = self.reward_flat + 1 if flat else 0
        if c.action == "off" or self.reward_flat < c.window:
            return None
        allowed = (f"< {c.min_zero_std_groups:g}" if key == ZERO_STD_GROUPS else "> 0") + f" within {c.window} steps"
        mean = metrics.get(REWARD_MEAN)
        detail = f"{self.reward_flat} steps in a row" + (f", {REWARD_MEAN} = {mean:.6g}" if mean is not None else "")
        return Finding("reward_collapse", step, c.action, key, value, allowed, detail)


def _above(value: float | None, threshold: float) -> bool:
    """A finite value over the threshold (a missing metric is not; NaN and Inf are the non_finite check's)."""
    return value is not None and math.isfinite(value) and value > threshold
