"""Checks a recipe beyond its types before anything starts: files exist, user code imports.

Problems are collected, not raised one at a time, so `rlflow validate` reports all of them at once.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from transformers import AutoConfig

from rlflow.engines.core.config import RecipeError, RLConfig
from rlflow.engines.data.prompts import DataError, load_pairs, load_prompts
from rlflow.engines.data.rewards import RewardError, load_reward_fn
from rlflow.engines.rollout.functions import load_rollout_fn
from rlflow.engines.store.run_store import StorageError, replay_source
from rlflow.engines.train.megatron.hf_config import UnsupportedModel, spec_from_hf
from rlflow.engines.train.megatron.weights import check_tensor_parallel


def find_problems(cfg: RLConfig) -> list[str]:
    problems: list[str] = []
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        problems.append(f"model.path: no Hugging Face model (config.json) in {cfg.model.path}")
    if cfg.use_critic and cfg.critic.model_path and not (Path(cfg.critic.model_path) / "config.json").is_file():
        problems.append(f"critic.model_path: no Hugging Face model (config.json) in {cfg.critic.model_path}")
    generated = cfg.data.generate is not None
    for field, path in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
        if not path or (generated and not Path(path).exists()):
            continue  # written by data.generate when the run starts
        try:
            load_prompts(path, cfg.data.prompt_key, cfg.data.label_key)
        except DataError as e:
            problems.append(f"{field}: {e}")
    sft_path = cfg.sft.train_path
    if sft_path and not (cfg.sft.generate is not None and not Path(sft_path).exists()):
        try:
            load_pairs(sft_path, cfg.data.prompt_key, cfg.sft.response_key)
        except DataError as e:
            problems.append(f"sft.train_path: {e}")
    try:
        load_reward_fn(cfg.reward.fn)
    except RewardError as e:
        problems.append(str(e))
    try:
        load_rollout_fn(cfg.rollout.fn)
    except (ValueError, TypeError) as e:
        problems.append(str(e))
    if cfg.train.backend == "megatron":
        problems += _megatron_problems(cfg)
    if cfg.debug.replay_run:
        try:
            replay_source(cfg)
        except (FileNotFoundError, StorageError) as e:
            problems.append(str(e))
    return problems


def _megatron_problems(cfg: RLConfig) -> list[str]:
    """megatron-core installed, and the model one the HF <-> Megatron mapping reproduces at this TP size."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return ["train.backend: megatron needs megatron-core (pip install '.[megatron]')"]
    if not cfg.model.path or not (Path(cfg.model.path) / "config.json").is_file():
        return []  # a model built from the recipe is a Llama or Qwen2; a missing path is reported above
    try:
        check_tensor_parallel(spec_from_hf(AutoConfig.from_pretrained(cfg.model.path)), cfg.megatron.tensor_parallel)
    except (UnsupportedModel, ValueError) as e:
        return [f"model.path: {e}"]
    return []


def check(cfg: RLConfig, source: str = "<config>") -> RLConfig:
    """Raise RecipeError listing every problem, or return the config unchanged."""
    problems = find_problems(cfg)
    if problems:
        raise RecipeError(source, problems)
    return cfg
