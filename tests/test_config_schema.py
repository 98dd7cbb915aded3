"""The recipe schema and the Prefect run forms are a contract with users: their saved recipes and the forms of
deployed flows. The live JSON schemas must equal, key order included, the ones stored in
tests/fixtures/config_schema/.

A deliberate schema change (a new field, a new description) regenerates them, and the diff is reviewed:

    .venv/bin/python -m tests.test_config_schema
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prefect.utilities.callables import parameter_schema
from pydantic import BaseModel

from rlflow.engines.core.config import EvaluationConfig, PipelineConfig, RegisterConfig, RLConfig, StorageConfig
from rlflow.flows.evaluate import evaluate
from rlflow.flows.pipeline import pipeline
from rlflow.flows.post_train import post_train
from rlflow.flows.register import register_model
from rlflow.flows.rejection_sampling import rejection_sampling
from rlflow.flows.sft import sft

FIXTURES = Path(__file__).parent / "fixtures" / "config_schema"

# the trees a recipe is validated against (load_recipe's `model`), and the other models that are flow parameters
MODELS: dict[str, type[BaseModel]] = {
    "RLConfig": RLConfig, "EvaluationConfig": EvaluationConfig, "PipelineConfig": PipelineConfig,
    "RegisterConfig": RegisterConfig, "StorageConfig": StorageConfig,
}
FLOWS = (post_train, evaluate, pipeline, register_model, sft, rejection_sampling)


def live_schemas() -> dict[str, dict[str, Any]]:
    """Each model's JSON schema, and each flow's parameter schema as a deployment stores it (its run form)."""
    models = {f"model-{name}": model.model_json_schema() for name, model in MODELS.items()}
    flows = {f"flow-{f.name}": parameter_schema(f.fn).model_dump_for_openapi() for f in FLOWS}
    return models | flows


def as_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1) + "\n"


@pytest.fixture(scope="module")
def live() -> dict[str, dict[str, Any]]:
    return live_schemas()


@pytest.mark.parametrize("name", [f"model-{n}" for n in MODELS] + [f"flow-{f.name}" for f in FLOWS])
def test_schema_equals_the_stored_one(live, name):
    path = FIXTURES / f"{name}.json"
    assert path.is_file(), f"{path}: missing; regenerate the fixtures deliberately (this module's docstring)"
    # line by line, so a failure shows the changed lines; a deliberate change: regenerate and review the diff
    assert as_text(live[name]).splitlines() == path.read_text().splitlines(), f"{name}: the schema changed"


def test_every_stored_schema_is_checked(live):
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(live)


def write_fixtures() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for old in FIXTURES.glob("*.json"):
        old.unlink()
    for name, schema in live_schemas().items():
        (FIXTURES / f"{name}.json").write_text(as_text(schema))
        print(f"wrote {FIXTURES / name}.json")


if __name__ == "__main__":
    write_fixtures()
