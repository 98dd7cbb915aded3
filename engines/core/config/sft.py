"""sft: supervised fine-tuning and rejection sampling (their own flows, on the same tree)."""

from __future__ import annotations

from pydantic import Field

from rlflow.engines.core.config.base import Section
from rlflow.engines.core.config.data import BuiltinTaskConfig


class RejectionSamplingConfig(Section):
    """Rejection sampling (flows/rejection_sampling.py): generate, keep what the verifier accepts, SFT on it."""

    rounds: int = Field(3, gt=0, description="Generate-filter-train rounds.")
    threshold: float = Field(
        1.0, description="A sample is kept when the reward (reward.fn) is >= threshold and it ended on its own."
    )
    max_per_prompt: int = Field(1, gt=0, description="Distinct accepted responses kept per prompt and round.")
    steps_per_round: int = Field(20, gt=0, description="SFT optimizer steps on the kept samples each round.")
    accumulate: bool = Field(
        True, description="Train on the samples kept in every round so far; false: only on this round's."
    )


class SFTConfig(Section):
    """Supervised fine-tuning (flows/sft.py) and rejection sampling. The train section gives the optimizer
    settings (lr unless sft.lr is set, schedule, warmup, grad_clip, threads, device); data gives the prompts
    for evaluation and for rejection sampling."""

    train_path: str | None = Field(
        None, description="Prompt/response file (.jsonl or .parquet) for `rlflow sft`; unused by rejection sampling."
    )
    response_key: str = Field("response", description="Column holding the target response text.")
    generate: BuiltinTaskConfig | None = Field(
        None,
        description="Write a built-in task's prompts with their correct answers to train_path first, if missing "
        "(same task, num_digits, num_eval and seed as data.generate keep the held-out prompts out of it).",
    )
    steps: int = Field(100, gt=0, description="SFT optimizer steps (`rlflow sft`).")
    batch_size: int = Field(64, gt=0, description="Sequences per optimizer step (over all data-parallel workers).")
    lr: float | None = Field(None, gt=0.0, description="Learning rate; empty: train.lr.")
    add_eos: bool = Field(True, description="End every response with the EOS token, so the model learns to stop.")
    rejection: RejectionSamplingConfig = Field(default_factory=RejectionSamplingConfig)

    def total_steps(self, rejection: bool) -> int:
        r = self.rejection
        return r.rounds * r.steps_per_round if rejection else self.steps
