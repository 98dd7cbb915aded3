"""One RL run's session: its engines and its stages, independent of Prefect.

`RLSession` is the engines a run holds (`RunEngines`, engines/session/run_engines.py) with one method per stage,
in the order the loop runs them; each method looks up the step's state and hands it to its stage's module under
engines/session/stages/, where the work is. The Prefect flow calls these methods from tasks (tasks/stages.py);
the bare loop (bench/, tests) calls them directly, with or without Ray.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import pyarrow as pa

from rlflow.engines.core.batch import RolloutBatch
from rlflow.engines.core.config import StorageConfig
from rlflow.engines.core.protocols import RolloutBackend
from rlflow.engines.session import stages
from rlflow.engines.session.run_engines import RunEngines


class RLSession(RunEngines):
    """The run's engines with one method per stage; each returns a small dict of metrics."""

    # ---- stages, in the loop's order -----------------------------------------------------------------
    def rollout(self, step: int) -> dict[str, float]:
        """Generate samples_per_prompt responses for the next prompts_per_step prompts (or replay them)."""
        return stages.rollout.run(self, step)

    def restore_rollout(self, step: int, table: pa.Table) -> dict[str, float]:
        """Take a persisted batch as this step's rollout; the data cursor moves exactly as a fresh rollout would."""
        return stages.rollout.restore(self, step, table)

    def reward(self, step: int) -> dict[str, float]:
        """Every sample's response text and reward, and the step's reward metrics."""
        return stages.reward.run(self, self.steps.get(step))

    def teacher(self, step: int) -> dict[str, float]:
        """On-policy distillation: the teacher scores the step's sampled tokens ({} without a teacher)."""
        return stages.teacher.run(self, self.steps.get(step))

    def advantages(self, step: int) -> dict[str, float]:
        """Rewards -> advantages (shaping, rollout correction, KL in the reward, the critic's values and GAE)."""
        return stages.advantages.run(self, self.steps.get(step))

    def train(self, step: int) -> dict[str, float]:
        """One train step of the policy on the step's samples (and the critic's beside it)."""
        return stages.train.run(self, self.steps.get(step))

    def sync_weights(self, step: int) -> dict[str, float]:
        """Send the trainer's weights to every rollout worker as version step+1, by the recipe's transport."""
        return stages.sync.run(self, step)

    def save(self, path: str | Path, step: int, storage: StorageConfig | None = None, background: bool = False
             ) -> dict:
        """Every worker saves its state into `path`; returns the controller state to store beside it."""
        return stages.checkpoint.save(self, path, step, storage, background)

    def load(self, path: str | Path, controller_state: dict, storage: StorageConfig | None = None) -> None:
        """Every worker loads its state from `path` (with `storage`: straight from that run store's folder)."""
        stages.checkpoint.load(self, path, controller_state, storage)

    def written_markers(self) -> list[str]:
        """The files a background save leaves in the checkpoint's folder, one a worker."""
        return stages.checkpoint.written_markers(self)

    def drain_saves(self) -> None:
        """Wait for every worker's background checkpoint write to end."""
        stages.checkpoint.drain_saves(self)

    def save_problem(self) -> str | None:
        """Why a background checkpoint's markers may never all come; None while they may still come."""
        return stages.checkpoint.save_problem(self)

    def evaluate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """Held-out reward with eval.temperature (greedy by default); also returns a few sample rows."""
        return stages.evaluate.run(self, step)

    # ---- the step's samples --------------------------------------------------------------------------
    def rollout_batch(self, step: int) -> RolloutBatch:
        """The step's samples (scored once the reward stage has run)."""
        return self.steps.get(step).batch

    def rollout_table(self, step: int) -> pa.Table:
        """The step's samples as one table (a row per sample, ROLLOUT_SCHEMA): what the run store persists."""
        return self.steps.get(step).batch.to_arrow()

    def sample_rows(self, step: int, k: int) -> list[dict]:
        """The first sample of each of the step's first k prompts, for the samples table."""
        return stages.evaluate.sample_rows(self.steps.get(step), k)

    # ---- trace timeline ------------------------------------------------------------------------------
    def stage_span(self, stage: str, step: int) -> AbstractContextManager[None]:
        """Record the stage as a span on its lane of the driver's timeline (free when tracing is off)."""
        return self.timeline.span(stage, step)

    def trace_events(self, step: int) -> dict:
        """The Chrome trace of `step`: the driver's stage spans and every rollout worker's events."""
        return self.timeline.trace(step, self.rollout_group.call(RolloutBackend.drain_trace))
