"""debug: rollout-only and train-only runs, replaying another run's batches, and the trace timeline."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlflow.engines.core.config.base import Name, Section


class DebugConfig(Section):
    """Debug modes (as slime's --debug-rollout-only / --debug-train-only), replay and the trace timeline
    (docs/debugging.md)."""

    mode: Literal["rollout_only", "train_only"] | None = Field(
        None,
        description="rollout_only: generate and score, no train workers, no training (throughput and rewards). "
        "train_only: train on replay_run's stored rollout batches, no rollout workers. Empty: a normal run.",
    )
    replay_run: Name | None = Field(
        None,
        description="Take each step's rollout batch from this run's store instead of generating (exact "
        "reproduction). That run must have kept its batches (checkpoint.keep_rollouts: true, or rollout_only).",
    )
    replay_store: str | None = Field(
        None, description="Run store root of replay_run (local path, file:// or s3://); empty: storage.uri, "
        "with storage's endpoint and credentials.",
    )
    trace_every: int = Field(
        0, ge=0, description="Write a Chrome-trace timeline (stage spans, per-request rollout events) every N steps "
        "and log it to MLflow as traces/step_<step>.json; 0: off (nothing is recorded).",
    )

    @property
    def trains(self) -> bool:
        return self.mode != "rollout_only"

    def traced(self, step: int) -> bool:
        return self.trace_every > 0 and (step + 1) % self.trace_every == 0

    @property
    def generates(self) -> bool:
        """Rollout workers run (and weights are synced to them)."""
        return self.mode != "train_only"
