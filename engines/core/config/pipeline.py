"""The pipeline flow's tree: train, evaluate, and register the checkpoint in MLflow's model registry."""

from __future__ import annotations

from pydantic import Field

from rlflow.engines.core.config.base import Section
from rlflow.engines.core.config.evaluation import EvalSamplingConfig


class RegisterConfig(Section):
    """When the pipeline registers an evaluated checkpoint in the MLflow model registry."""

    model_name: str = Field("rlflow-model", description="Registered model name in MLflow.")
    metric: str = Field(
        "accuracy", description="Eval metric that decides: accuracy, reward_mean, pass_at_<k>, response_len_mean."
    )
    dataset: str | None = Field(None, description="Dataset whose metric decides; empty: the first one.")
    threshold: float | None = Field(None, description="Register only if the metric is at least this; empty: no bar.")
    beat_best: bool = Field(True, description="Register only if the metric beats every registered version's.")


class PipelineConfig(Section):
    """post-train -> evaluate -> register (flows/pipeline.py); each stage is its own flow run."""

    train_recipe: str = Field(..., description="The training recipe (YAML, relative to the working directory).")
    train_overrides: list[str] = Field(default_factory=list, description="KEY.PATH=VALUE overrides of the recipe.")
    eval: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    registry: RegisterConfig = Field(default_factory=RegisterConfig)
    train_deployment: str = Field("post-train/post-train", description="Deployment that runs the training stage.")
    eval_deployment: str = Field("evaluate/evaluate", description="Deployment that runs the evaluation stage.")
