"""Checks a recipe beyond its types before anything starts: files exist, user code imports.

Problems are collected, not raised one at a time, so `rlflow validate` reports all of them at once.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from rlflow.engines.core.config import (
    FnRewardSource,
    JudgeRewardSource,
    ModelRewardSource,
    RecipeError,
    RLConfig,
    config_from_dict,
    valid_sections,
)
from rlflow.engines.data.prompts import DataError, load_pairs, load_prompts
from rlflow.engines.data.rewards import RewardError, load_callable, load_reward_fn
from rlflow.engines.env.host import load_env_class
from rlflow.engines.models.hf import rollout_context
from rlflow.engines.models.moe import is_moe
from rlflow.engines.reward.judge import read_api_key
from rlflow.engines.rollout.functions import load_rollout_fn
from rlflow.engines.session.workers import check_teacher_vocabulary
from rlflow.engines.store.run_store import StorageError, replay_source
from rlflow.engines.train.megatron.hf_config import UnsupportedModel, spec_from_hf
from rlflow.engines.train.megatron.weights import check_moe_tensor_parallel, check_tensor_parallel


def _model_problems(cfg: RLConfig) -> list[str]:
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        return [f"model.path: no Hugging Face model (config.json) in {cfg.model.path}"]
    return []


def _critic_problems(cfg: RLConfig) -> list[str]:
    if cfg.use_critic and cfg.critic.model_path and not (Path(cfg.critic.model_path) / "config.json").is_file():
        return [f"critic.model_path: no Hugging Face model (config.json) in {cfg.critic.model_path}"]
    return []


def _teacher_problems(cfg: RLConfig) -> list[str]:
    """distill.teacher_path is an HF model, with the student's vocabulary when the student is a model on disk (a
    model built from the recipe is compared when the run starts)."""
    teacher = cfg.distill.teacher_path
    if not teacher:
        return []
    if not (Path(teacher) / "config.json").is_file():
        return [f"distill.teacher_path: no Hugging Face model (config.json) in {teacher}"]
    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        try:
            check_teacher_vocabulary(cfg.model.path, teacher)
        except (OSError, ValueError) as e:
            return [str(e)]
    return []


def _data_problems(cfg: RLConfig) -> list[str]:
    problems = []
    generated = cfg.data.generate is not None
    for field, path in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
        if not path or (generated and not Path(path).exists()):
            continue  # written by data.generate when the run starts
        try:
            load_prompts(path, cfg.data.prompt_key, cfg.data.label_key, cfg.storage.fsspec_options(path),
                         cfg.data.max_image_pixels)
        except DataError as e:
            problems.append(f"{field}: {e}")
    return problems


def _sft_problems(cfg: RLConfig) -> list[str]:
    sft_path = cfg.sft.train_path
    if not sft_path or (cfg.sft.generate is not None and not Path(sft_path).exists()):
        return []
    try:
        load_pairs(sft_path, cfg.data.prompt_key, cfg.sft.response_key, cfg.storage.fsspec_options(sft_path))
    except DataError as e:
        return [f"sft.train_path: {e}"]
    return []


def _reward_problems(cfg: RLConfig) -> list[str]:
    """Every reward source loadable: functions import, reward models are on disk, judges' keys are set."""
    if not cfg.reward.sources:
        try:
            load_reward_fn(cfg.reward.fn)
        except RewardError as e:
            return [str(e)]
        return []
    problems = []
    for i, src in enumerate(cfg.reward.sources):
        field = f"reward.sources[{i}]"
        try:
            if isinstance(src, FnRewardSource):
                load_callable(src.fn, f"{field}.fn", RewardError)
            elif isinstance(src, ModelRewardSource) and not (Path(src.path) / "config.json").is_file():
                problems.append(f"{field}.path: no Hugging Face model (config.json) in {src.path}")
            elif isinstance(src, JudgeRewardSource):
                read_api_key(src, field)
        except (RewardError, ValueError) as e:
            problems.append(str(e))
    return problems


def _rollout_fn_problems(cfg: RLConfig) -> list[str]:
    problems = []
    try:
        load_rollout_fn(cfg.rollout.fn)
    except (ValueError, TypeError) as e:
        problems.append(str(e))
    if cfg.rollout.env is not None:
        try:
            load_env_class(cfg.rollout.env.cls)
        except (ValueError, TypeError) as e:
            problems.append(str(e))
    return problems


def _replay_problems(cfg: RLConfig) -> list[str]:
    try:
        replay_source(cfg)
    except (FileNotFoundError, StorageError) as e:
        return [str(e)]
    return []


def _context_problems(cfg: RLConfig) -> list[str]:
    """rollout.max_new_tokens within the tokens a rollout sequence holds, with room for a prompt: the engine
    would otherwise cut every response short without a word."""
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        return []  # reported by _model_problems
    try:
        context, source = rollout_context(cfg.model, cfg.rollout.backend)
    except (ValueError, OSError) as e:
        return [str(e)]
    if cfg.rollout.max_new_tokens >= context:
        return [f"rollout.max_new_tokens: {cfg.rollout.max_new_tokens} does not fit a rollout sequence of {context} "
                f"tokens ({source}), which holds the prompt too"]
    return []


def _model_config(cfg: RLConfig) -> PretrainedConfig | None:
    """model.path's HF config; None for a model built from the recipe (dense: the workers check it) or a missing
    one (reported by _model_problems)."""
    if not cfg.model.path or not (Path(cfg.model.path) / "config.json").is_file():
        return None
    return AutoConfig.from_pretrained(cfg.model.path)


def _routing_replay_problems(cfg: RLConfig) -> list[str]:
    """Routing replay needs a mixture of experts: a dense model has no routing to record."""
    replay = cfg.algorithm.routing_replay
    config = _model_config(cfg) if replay != "off" else None
    if config is None:
        return []
    if not is_moe(config.model_type):
        return [f"algorithm.routing_replay {replay}: model.path {cfg.model.path} is a dense {config.model_type} "
                "model; routing replay applies to mixtures of experts (qwen3_moe, mixtral). Set it to off"]
    return []


def _expert_parallel_problems(cfg: RLConfig) -> list[str]:
    """train.expert_parallel against the model's experts, before any worker loads it."""
    ep = cfg.train.expert_parallel
    config = _model_config(cfg) if ep > 1 else None
    if config is None:
        return []
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return [f"train.expert_parallel {ep}: model.path {cfg.model.path} is a dense {config.model_type} model "
                "(no experts to split); set it to 1"]
    if experts % ep:
        return [f"train.expert_parallel {ep} does not divide the {experts} experts of model.path {cfg.model.path}"]
    return []


def _context_parallel_problems(cfg: RLConfig) -> list[str]:
    """train.context_parallel against the model's attention heads (Ulysses splits them), before any worker loads it."""
    cp = cfg.train.context_parallel
    if cp == 1:
        return []
    config = _model_config(cfg)
    heads = config.num_attention_heads if config is not None else None if cfg.model.path else cfg.model.num_heads
    if heads and heads % cp:
        return [f"train.context_parallel {cp} does not divide the {heads} attention heads of model.path "
                f"{cfg.model.path} (each context-parallel rank attends with 1/{cp} of the heads)"]
    return []


def _megatron_or_none(cfg: RLConfig) -> list[str]:
    return _megatron_problems(cfg) if cfg.train.backend == "megatron" else []


# each check with the sections it reads: on a recipe that fails validation, a check runs when they are all valid
CHECKS: list[tuple[frozenset[str], Callable[[RLConfig], list[str]]]] = [
    (frozenset({"model"}), _model_problems),
    (frozenset({"critic", "algorithm"}), _critic_problems),
    (frozenset({"distill", "model"}), _teacher_problems),
    (frozenset({"data"}), _data_problems),
    (frozenset({"data", "sft"}), _sft_problems),
    (frozenset({"reward"}), _reward_problems),
    (frozenset({"rollout"}), _rollout_fn_problems),
    (frozenset({"model", "rollout"}), _context_problems),
    (frozenset({"train", "model", "megatron"}), _megatron_or_none),
    (frozenset({"algorithm", "model"}), _routing_replay_problems),
    (frozenset({"train", "model"}), _expert_parallel_problems),
    (frozenset({"train", "model"}), _context_parallel_problems),
    (frozenset({"debug", "storage"}), _replay_problems),
]


def find_problems(cfg: RLConfig, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Every problem of the files and code `cfg` names, leaving out the checks that read a section in `skip`."""
    return [p for needs, run_check in CHECKS if not needs & skip for p in run_check(cfg)]


def _megatron_problems(cfg: RLConfig) -> list[str]:
    """megatron-core installed, and the model one the HF <-> Megatron mapping reproduces at this TP size."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return ["train.backend: megatron needs megatron-core (pip install '.[megatron]')"]
    if not cfg.model.path or not (Path(cfg.model.path) / "config.json").is_file():
        return []  # a model built from the recipe is a Llama or Qwen2; a missing path is reported above
    try:
        spec, mcfg = spec_from_hf(AutoConfig.from_pretrained(cfg.model.path)), cfg.megatron
        check_tensor_parallel(spec, mcfg.tensor_parallel)
        check_moe_tensor_parallel(spec, mcfg.tensor_parallel, mcfg.transformer_engine,
                                  bool(mcfg.transformer.get("sequence_parallel", False)))
    except (UnsupportedModel, ValueError) as e:
        return [f"model.path: {e}"]
    return []


def check(cfg: RLConfig, source: str = "<config>") -> RLConfig:
    """Raise RecipeError listing every problem, or return the config unchanged."""
    problems = find_problems(cfg)
    if problems:
        raise RecipeError(source, problems)
    return cfg


def check_recipe(raw: dict, source: str) -> RLConfig:
    """The recipe `raw` validated and checked, or a RecipeError with every problem at once: when the schema fails,
    the data, reward and other checks still run on the sections that are valid, so fixing a typo does not
    uncover a missing data file one attempt later."""
    try:
        cfg = config_from_dict(raw, source)
    except RecipeError as e:
        partial, invalid = valid_sections(raw)
        raise RecipeError(source, e.problems + find_problems(partial, skip=invalid)) from None
    return check(cfg, source)
