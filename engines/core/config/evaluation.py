"""Held-out evaluation: during a run (the eval section) and of one checkpoint (the evaluate flow's tree)."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Literal

from pydantic import Field, model_validator

from rlflow.engines.core.config.base import Name, Section
from rlflow.engines.core.config.reward import RewardConfig
from rlflow.engines.core.config.storage import StorageConfig
from rlflow.engines.core.config.tracking import TrackingConfig


class EvalConfig(Section):
    every: int = Field(10, ge=0, description="Evaluate every N steps on data.eval_path; 0 disables.")
    max_prompts: int = Field(256, gt=0)
    temperature: float = Field(0.0, ge=0.0, description="0 means greedy decoding.")


# file stems that name a split, not a dataset: such a file takes its folder's name (data/sort4/eval.jsonl: sort4)
SPLIT_STEMS = frozenset({"eval", "test", "validation", "val", "dev", "heldout", "held_out", "train"})


class EvalDatasetConfig(Section):
    path: str = Field(..., description="Held-out prompt file: .jsonl or .parquet.")
    name: Name | None = Field(
        None, description="Name in metric keys (eval/<name>/accuracy); empty: the file's stem, or its folder's name "
        "when the stem only names a split (eval, test, validation, val, dev, heldout, train): data/sort4/eval.jsonl "
        "is sort4.",
    )
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    label_key: str = Field("label", description="Column holding what the reward checks against.")

    @property
    def key(self) -> str:
        """The dataset's name in metric keys: eval/<key>/accuracy."""
        if self.name:
            return self.name
        path = PurePosixPath(self.path.split("://", 1)[-1])
        folder = path.parent.name
        return folder if path.stem.lower() in SPLIT_STEMS and folder not in ("", ".", "..") else path.stem


class EvalSamplingConfig(Section):
    """How a checkpoint is evaluated: samples per prompt, decoding, size. Shared by the evaluate and pipeline flows."""

    datasets: list[EvalDatasetConfig] = Field(
        default_factory=list, description="Held-out datasets. In the pipeline, empty: the training recipe's eval_path."
    )
    max_prompts: int = Field(256, gt=0, description="Prompts evaluated per dataset (the first ones).")
    samples_per_prompt: int = Field(4, gt=0, description="n: responses sampled per prompt (pass@k needs k <= n).")
    pass_k: list[int] = Field(default_factory=lambda: [1], description="k values of pass@k, each at most n.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 means greedy (then use n = 1).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int | None = Field(None, gt=0, description="Response length limit; empty: 8, or in the pipeline "
                                       "the training recipe's rollout.max_new_tokens.")
    chat_template: bool | None = Field(
        None, description="Render each prompt as training did (data.chat_template): true: one user message in the "
        "tokenizer's chat template with the generation prompt; false: the text as it is. Empty: the training recipe's "
        "data.chat_template (a run-store checkpoint's config.json; in the pipeline, train_recipe), false for a "
        "Hugging Face directory.",
    )
    batch_size: int = Field(512, gt=0, description="Sequences generated together.")
    threads: int = Field(2, gt=0, description="torch threads.")
    device: Literal["cpu", "cuda"] = "cpu"
    seed: int = 0
    samples_logged: int = Field(8, ge=0, description="Sample responses per dataset in the report and MLflow table.")
    shards: int = Field(
        1, gt=0, description="Prefect tasks each dataset's prompts are split into (contiguous, near-equal; at most one "
        "per prompt). Each shard generates and rewards its prompts; the flow scores the merged samples, so the "
        "metrics equal an unsharded evaluation's.",
    )
    shard_runner: Literal["thread", "ray"] = Field(
        "thread", description="Where shard tasks run. thread: threads of the flow process, sharing one rollout "
        "engine (no Ray). ray: each shard a Ray task through prefect-ray's RayTaskRunner, reserving `threads` "
        "CPUs (and a GPU on cuda); each Ray worker process loads the checkpoint once. The cluster: `ray_address`, "
        "else RAY_ADDRESS, else a private local Ray of shards x threads CPUs.",
    )
    ray_address: str | None = Field(
        None, description="shard_runner ray: address of the Ray cluster to join ('auto': the running one); empty: "
        "RAY_ADDRESS if set, else a private local Ray for this evaluation.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> EvalSamplingConfig:
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples_per_prompt]
        if bad:
            raise ValueError(f"pass_k: {bad} must be between 1 and samples_per_prompt ({self.samples_per_prompt})")
        names = [d.key for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"datasets: names must be unique, got {names}; give each a `name`")
        return self


class EvaluationConfig(Section):
    """One evaluation of one checkpoint (flows/evaluate.py): metrics to MLflow and Prefect artifacts."""

    name: Name = Field("eval", description="Name of the evaluation's MLflow run.")
    checkpoint: str = Field(
        ...,
        description="What to evaluate: a run-store checkpoint (<store>/<run>/checkpoints/<step>, file:// or s3://), "
        "a run (<store>/<run>: its newest committed checkpoint), or a local Hugging Face model directory.",
    )
    training_run_id: str | None = Field(
        None, description="MLflow run id of the training run to link to; empty: the one in the checkpoint's meta.json."
    )
    eval: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="Credentials and endpoint for an s3:// checkpoint (uri unused)."
    )

    @model_validator(mode="after")
    def _has_data(self) -> EvaluationConfig:
        if not self.eval.datasets:
            raise ValueError("eval.datasets: at least one dataset is required")
        return self
