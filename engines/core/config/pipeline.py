"""The pipeline flow's tree: train, evaluate, register the checkpoint in MLflow's model registry, and promote it."""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import Field, model_validator

from rlflow.engines.core.config.base import Section
from rlflow.engines.core.config.evaluation import EvalSamplingConfig

# the registry section's former gate fields and where each went (promote.*); beat_best has no one-to-one successor
MOVED_TO_PROMOTE = ("metric", "dataset", "threshold")


class RegisterConfig(Section):
    """Where the pipeline registers evaluated checkpoints: every one becomes a version of this model."""

    model_name: str = Field("rlflow-model", description="Registered model name in MLflow.")


class PromoteConfig(Section):
    """When a registered candidate becomes the model's `champion` (MLflow registry alias; every candidate is the
    `challenger` when registered): it must pass `threshold` and beat the current champion, measured by the same
    evaluation, by at least `min_delta`. A worse candidate, or one within min_delta of the champion, never does."""

    metric: str = Field(
        "accuracy", description="Eval metric that decides: accuracy, reward_mean, pass_at_<k>, response_len_mean."
    )
    dataset: str | None = Field(
        None, description="Dataset whose metric decides (its key in eval/<dataset>/<metric>); empty: the first one."
    )
    min_delta: float = Field(
        0.0, ge=0.0, description="How much the candidate must beat the champion by (in the metric's units; 0: any "
        "strict improvement). A candidate within min_delta of the champion stays challenger.",
    )
    threshold: float | None = Field(
        None, description="Absolute bar the candidate must reach to be champion (the least it may be, or with "
        "higher_is_better false the most); empty: none. The first version becomes champion if it passes it.",
    )
    higher_is_better: bool = Field(
        True, description="Direction of the metric: true for accuracy, pass@k, reward; false e.g. for "
        "response_len_mean when shorter answers are wanted.",
    )


class PipelineConfig(Section):
    """post-train -> evaluate -> register and promote (flows/pipeline.py); each stage is its own flow run."""

    train_recipe: str = Field(..., description="The training recipe (YAML, relative to the working directory).")
    train_overrides: list[str] = Field(default_factory=list, description="KEY.PATH=VALUE overrides of the recipe.")
    eval: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    registry: RegisterConfig = Field(default_factory=RegisterConfig)
    promote: PromoteConfig = Field(default_factory=PromoteConfig)
    train_deployment: str = Field("post-train/post-train", description="Deployment that runs the training stage.")
    eval_deployment: str = Field("evaluate/evaluate", description="Deployment that runs the evaluation stage.")

    @model_validator(mode="before")
    @classmethod
    def _registry_gates_moved(cls, data: Any) -> Any:
        """registry.metric / dataset / threshold, the gate's former place, still read as promote.*, with a warning;
        registry.beat_best is gone (the champion comparison always applies: promote.min_delta)."""
        if not isinstance(data, dict) or not isinstance(data.get("registry"), dict):
            return data
        registry = dict(data["registry"])
        moved = {k: registry.pop(k) for k in MOVED_TO_PROMOTE if k in registry}
        beat_best = "beat_best" in registry
        registry.pop("beat_best", None)
        if not moved and not beat_best:
            return data
        promote = dict(data.get("promote") or {})
        clash = [k for k, v in moved.items() if k in promote and promote[k] != v]
        if clash:
            raise ValueError(f"registry.{clash[0]} ({moved[clash[0]]!r}) and promote.{clash[0]} "
                             f"({promote[clash[0]]!r}) disagree: registry.{clash[0]} is promote.{clash[0]}'s old "
                             f"place; give promote.{clash[0]} alone")
        if moved:
            warnings.warn(f"registry.{', registry.'.join(moved)} moved to the promote section: read as "
                          f"promote.{', promote.'.join(moved)}; move them in the recipe", FutureWarning, stacklevel=2)
        if beat_best:
            warnings.warn("registry.beat_best is gone and ignored: every candidate is registered (alias challenger) "
                          "and becomes champion only if it beats the champion by promote.min_delta", FutureWarning,
                          stacklevel=2)
        return data | {"registry": registry, "promote": promote | moved}
