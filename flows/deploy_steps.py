"""A `prefect deploy` build step: a deployment's recipe as its default `config`, so the UI's run form opens with it.

prefect.yaml names it in a deployment's `build:` section, with an `id`, and templates its output into the
deployment's parameters (`config: "{{ recipe.config }}"`). Prefect fills a parameter from a placeholder that is
the whole string with the step's value itself, a mapping here, not its text.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from rlflow.engines.core.config import EvaluationConfig, PipelineConfig, RLConfig, load_recipe, public_tree

MODELS: dict[str, type[BaseModel]] = {
    "RLConfig": RLConfig,
    "EvaluationConfig": EvaluationConfig,
    "PipelineConfig": PipelineConfig,
}


def recipe_config(recipe: str, model: str = "RLConfig") -> dict[str, dict]:
    """Read and validate `recipe` (relative to the directory `prefect deploy` runs in) as `model`; returns
    {"config": the tree as JSON, credentials left out}. A bad recipe fails the deploy, naming its fields."""
    if model not in MODELS:
        raise ValueError(f"recipe_config step: model {model!r} is not one of {sorted(MODELS)}")
    return {"config": public_tree(load_recipe(Path(recipe), model=MODELS[model]))}
