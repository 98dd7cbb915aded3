"""Shared fixtures: a tiny model on disk, small recipes, and quiet, offline Prefect/Ray settings."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from engines.config import ModelConfig, config_from_dict  # noqa: E402
from engines.model import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny_model")
    build_tiny_model(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                 max_seq_len=32), out, seed=0)
    return str(out)


def small_recipe(tmp_path, **sections) -> dict:
    """A fast sort recipe writing everything under tmp_path; sections override (shallowly merged)."""
    raw = {
        "name": "t",
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 16},
        "data": {"train_path": str(tmp_path / "data/train.jsonl"), "eval_path": str(tmp_path / "data/eval.jsonl"),
                 "generate": {"task": "sort", "num_digits": 3, "num_train": 2000, "num_eval": 32}},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 4},
        "train": {"steps": 3, "threads": 1},
        "eval": {"every": 2, "max_prompts": 16},
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"},
        "storage": {"uri": str(tmp_path / "runs")},
    }
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return raw


@pytest.fixture
def recipe(tmp_path):
    def make(**sections):
        return config_from_dict(small_recipe(tmp_path, **sections))

    return make
