"""Champion and challenger: the promotion gate, and a comparison that is fair.

Every evaluated candidate is registered (alias `challenger`); the alias `champion` moves to it only when `decide`
says so: it passes `promote.threshold`, and it beats the current champion by at least `promote.min_delta` on the
same metric measured by the same evaluation. Same evaluation means the same `evaluation_hash`: the sampling
settings, the reward, the datasets' content (sha256, not their paths) and the rlflow version. A champion whose
recorded metric came from another evaluation is evaluated again with this one before the comparison
(flows/pipeline.py). No Prefect and no MLflow here: the gate is a pure function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlflow.engines.core.config import EvaluationConfig, PromoteConfig, public_tree
from rlflow.flows.lineage import file_sha256, rlflow_version
from rlflow.tasks.tracking import recipe_hash

PROMOTED, REJECTED = "promoted", "rejected"
# settings that do not change what an evaluation measures: where shards run and how much of it is logged
NOT_MEASURED = {"shards", "shard_runner", "ray_address", "samples_logged", "datasets"}
EVAL_HASH_TAG = "rlflow.eval_hash"
REMEASURED_TAG = "rlflow.eval."  # + the first 16 hex of an evaluation hash: the run that measured a version so


@dataclass(frozen=True)
class Decision:
    """Whether the candidate becomes champion, and why, with the numbers the reason quotes."""

    promoted: bool
    reason: str
    candidate: float
    champion: float | None = None
    delta: float | None = None  # the candidate's improvement over the champion, in the metric's good direction

    @property
    def outcome(self) -> str:
        return PROMOTED if self.promoted else REJECTED


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def passes_threshold(value: float, gate: PromoteConfig) -> bool:
    if gate.threshold is None:
        return True
    return value >= gate.threshold if gate.higher_is_better else value <= gate.threshold


def improvement(candidate: float, champion: float, gate: PromoteConfig) -> float:
    """How much better the candidate is than the champion (negative: worse), whatever the metric's direction."""
    return candidate - champion if gate.higher_is_better else champion - candidate


def beats(delta: float, min_delta: float) -> bool:
    """A strict improvement of at least min_delta (a difference equal to min_delta up to float rounding counts:
    0.6 - 0.55 is 0.04999999999999993)."""
    return delta > 0 and (delta >= min_delta or math.isclose(delta, min_delta, rel_tol=1e-9, abs_tol=1e-12))


def decide(candidate: float, champion: float | None, gate: PromoteConfig, metric: str = "the metric",
           champion_name: str = "the champion") -> Decision:
    """The gate: threshold first, then the champion (if any) beaten by at least min_delta. Never promotes a
    candidate that is worse than the champion, equal to it, or better by less than min_delta."""
    bar = ">=" if gate.higher_is_better else "<="
    if not math.isfinite(candidate):
        return Decision(False, f"{metric} is {candidate}: not a measurement", candidate, champion)
    if not passes_threshold(candidate, gate):
        return Decision(False, f"{metric} {fmt(candidate)} misses the threshold ({bar} {fmt(gate.threshold)})",
                        candidate, champion)
    floor = f"; {bar} threshold {fmt(gate.threshold)}" if gate.threshold is not None else ""
    if champion is None:
        return Decision(True, f"no champion yet: {metric} {fmt(candidate)}{floor}", candidate)
    if not math.isfinite(champion):
        return Decision(False, f"{champion_name}'s {metric} is {champion}: nothing to compare with", candidate,
                        champion)
    delta = improvement(candidate, champion, gate)
    numbers = (f"{metric} {fmt(candidate)} vs {fmt(champion)}: {'+' if delta >= 0 else ''}{fmt(delta)} "
               f"({'higher' if gate.higher_is_better else 'lower'} is better), min_delta {fmt(gate.min_delta)}")
    if not beats(delta, gate.min_delta):
        why = "worse than" if delta < 0 else "no better than" if delta == 0 else "not enough better than"
        return Decision(False, f"{why} {champion_name}: {numbers}", candidate, champion, delta)
    return Decision(True, f"beats {champion_name}: {numbers}{floor}", candidate, champion, delta)


def evaluation_settings(evaluation: EvaluationConfig) -> dict:
    """What an evaluation's numbers depend on: sampling and scoring settings, the reward, each dataset's content
    (sha256 through fsspec: the same file under another path is the same dataset) and the rlflow version. Not the
    checkpoint, the run's name, nor where shards run."""
    e = evaluation.eval
    datasets = [{"key": d.key, "prompt_key": d.prompt_key, "label_key": d.label_key,
                 "sha256": file_sha256(d.path, evaluation.storage)} for d in e.datasets]
    return {"eval": e.model_dump(mode="json", exclude=NOT_MEASURED), "datasets": datasets,
            "reward": public_tree(evaluation.reward), "rlflow": rlflow_version()}


def evaluation_hash(settings: dict) -> str:
    """sha256 of the settings as canonical JSON (the recipe hash's function): two metrics with the same hash were
    measured alike."""
    return recipe_hash(settings)


def remeasured_tag(eval_hash: str) -> str:
    """The version tag naming the MLflow run that evaluated that version with the evaluation of `eval_hash`."""
    return REMEASURED_TAG + eval_hash[:16]
