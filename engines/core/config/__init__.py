"""The one configuration tree of rlflow.

A recipe (YAML in deployments/) is parsed into `RLConfig`; the same model is the post_train flow's
parameter type, so Prefect's run form shows these fields with their defaults and descriptions.
Every section forbids unknown keys, so a typo is an error that names the field, not a silent default.

One module per section (model, data, rollout, ...), the root `RLConfig` in run.py with the checks that span
sections, the evaluate and pipeline flows' trees, and the recipe loader in recipe.py. Import from this package.
"""

from rlflow.engines.core.config.algorithm import GROUP_ESTIMATORS, AlgorithmConfig
from rlflow.engines.core.config.base import NAME_PATTERN, Name, Section
from rlflow.engines.core.config.checkpoint import CheckpointConfig
from rlflow.engines.core.config.cluster import ClusterConfig
from rlflow.engines.core.config.data import BuiltinTaskConfig, DataConfig
from rlflow.engines.core.config.debug import DebugConfig
from rlflow.engines.core.config.distill import DistillConfig
from rlflow.engines.core.config.env import ENV_ROLLOUT_FN, EnvConfig
from rlflow.engines.core.config.evaluation import EvalConfig, EvalDatasetConfig, EvalSamplingConfig, EvaluationConfig
from rlflow.engines.core.config.health import HealthConfig
from rlflow.engines.core.config.megatron import MegatronConfig
from rlflow.engines.core.config.model import ModelConfig
from rlflow.engines.core.config.orchestration import OrchestrationConfig, StageTimeouts
from rlflow.engines.core.config.pipeline import PipelineConfig, PromoteConfig, RegisterConfig
from rlflow.engines.core.config.recipe import (
    RecipeError,
    apply_overrides,
    config_from_dict,
    deep_merge,
    load_recipe,
    parse_override,
    public_tree,
    read_recipe,
    resolve_config,
    valid_sections,
)
from rlflow.engines.core.config.reward import (
    DEFAULT_REWARD_FN,
    DEFAULT_RUBRIC,
    RUBRIC_FIELDS,
    FnRewardSource,
    JudgeRewardSource,
    ModelRewardSource,
    RewardConfig,
    RewardSource,
    check_template,
)
from rlflow.engines.core.config.rollout import (
    SGLANG_LAUNCHERS,
    DynamicSamplingConfig,
    KVCacheConfig,
    RolloutConfig,
    SGLangConfig,
)
from rlflow.engines.core.config.run import RLConfig
from rlflow.engines.core.config.sandbox import SandboxConfig, SandboxLimits
from rlflow.engines.core.config.sft import RejectionSamplingConfig, SFTConfig
from rlflow.engines.core.config.storage import StorageConfig
from rlflow.engines.core.config.tracking import TrackingConfig
from rlflow.engines.core.config.train import LORA_TARGETS, CriticConfig, LoraConfig, TrainConfig
from rlflow.engines.core.config.weight_sync import WeightSyncConfig

__all__ = [
    # the trees: a run, an evaluation, a pipeline
    "RLConfig", "EvaluationConfig", "PipelineConfig",
    # the sections
    "Section", "Name", "NAME_PATTERN",
    "ModelConfig", "DataConfig", "BuiltinTaskConfig",
    "RolloutConfig", "SGLangConfig", "SGLANG_LAUNCHERS", "KVCacheConfig", "DynamicSamplingConfig",
    "EnvConfig", "ENV_ROLLOUT_FN",
    "RewardConfig", "RewardSource", "FnRewardSource", "ModelRewardSource", "JudgeRewardSource",
    "DEFAULT_REWARD_FN", "DEFAULT_RUBRIC", "RUBRIC_FIELDS", "check_template",
    "AlgorithmConfig", "GROUP_ESTIMATORS",
    "SFTConfig", "RejectionSamplingConfig",
    "TrainConfig", "LoraConfig", "LORA_TARGETS", "CriticConfig", "DistillConfig", "MegatronConfig",
    "ClusterConfig", "CheckpointConfig", "EvalConfig", "TrackingConfig", "StorageConfig", "WeightSyncConfig",
    "OrchestrationConfig", "StageTimeouts", "DebugConfig", "HealthConfig",
    "SandboxConfig", "SandboxLimits",
    "EvalDatasetConfig", "EvalSamplingConfig", "RegisterConfig", "PromoteConfig",
    # recipes
    "RecipeError", "load_recipe", "read_recipe", "parse_override", "apply_overrides", "config_from_dict",
    "valid_sections", "resolve_config", "deep_merge", "public_tree",
]
