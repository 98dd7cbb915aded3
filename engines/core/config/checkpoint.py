"""checkpoint: when a run saves what it needs to resume, and what it keeps."""

from __future__ import annotations

from pydantic import Field

from rlflow.engines.core.config.base import Section


class CheckpointConfig(Section):
    """When a run saves what it needs to resume. The last step always saves. The defaults make a run with no
    checkpoint settings resumable: a crash loses at most 50 steps or about an hour of work, whichever is less,
    for one checkpoint per interval (docs/operations.md, "When a run checkpoints")."""

    every: int = Field(
        50, ge=0, description="Save every N steps (slime's --save-interval, verl's trainer.save_freq) and at the last "
        "step; 0: no step interval (with every_minutes 0: only at the end).",
    )
    every_minutes: float = Field(
        60, ge=0, description="Also save once this many minutes have passed since the last save (or since this "
        "attempt started), at the end of the step they pass in: bounds the work a crash loses when steps are slow; "
        "0: no time interval.",
    )
    keep_last: int = Field(2, gt=0, description="Committed checkpoints kept; the newest is never deleted.")
    auto_resume: int = Field(3, ge=0, description="How many times a deployed run that crashes (its process killed, "
                             "its machine lost, `rlflow serve` stopped) is rescheduled by Prefect's automations and "
                             "resumed from its last committed checkpoint; 0: never (docs/operations.md).")
    async_save: bool = Field(
        False, description="Write checkpoints in the background (train.backend torch, not with train.lora): the "
        "checkpoint stage returns once every rank has copied its state to host memory (one more copy of each "
        "rank's model and optimizer state there), and the ranks train on while threads write it. It is committed "
        "once every rank's write is done; a run that fails before that resumes from the checkpoint before it. The "
        "last step's checkpoint is waited for.")
    save_rollouts: bool = Field(True, description="Persist each step's samples so a retried step reuses them.")
    keep_rollouts: bool = Field(False, description="Keep rollout batches older than the newest checkpoint.")
