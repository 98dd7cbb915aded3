"""orchestration: Prefect retries of a run and of its stages, and each stage's time limit."""

from __future__ import annotations

from pydantic import Field

from rlflow.engines.core.config.base import Section


class StageTimeouts(Section):
    """Seconds a stage of one step may take before its Prefect task fails (0: no limit). A hung reward function,
    a stuck worker or a lost node then fails the step instead of holding the run forever; the run resumes from
    its last checkpoint. Enforced by rlflow in any thread (tasks/time_limits.py): in the flow's own thread an
    alarm interrupts the stage where it blocks; a one-step-off rollout running in a worker thread fails at the
    limit while its blocking call is left to end when the run closes."""

    rollout: float = Field(7200, ge=0, description="Generating the step's samples (rollout.fn).")
    reward: float = Field(1800, ge=0, description="Scoring them (reward.fn).")
    teacher: float = Field(1800, ge=0, description="The distillation teacher scoring the samples (distill).")
    advantages: float = Field(1800, ge=0, description="Advantages (reference, critic and train logprobs).")
    train: float = Field(7200, ge=0, description="The optimizer steps of the step.")
    sync_weights: float = Field(1800, ge=0, description="Sending the weights to the rollout workers.")
    checkpoint: float = Field(7200, ge=0, description="Saving and committing a checkpoint.")
    evaluate: float = Field(7200, ge=0, description="The held-out evaluation.")


class OrchestrationConfig(Section):
    flow_retries: int = Field(0, ge=0, description="Prefect retries of a failed flow run; each resumes from the store.")
    task_retries: int = Field(0, ge=0, description="Retries of rollout, reward, checkpoint and eval (safe to rerun).")
    retry_delay_s: float = Field(10.0, ge=0)
    stage_timeout_s: StageTimeouts = Field(default_factory=StageTimeouts,
                                           description="Per-stage time limits, seconds (0: none).")
