"""The one configuration tree of rlflow.

A recipe (YAML in deployments/) is parsed into `RLConfig`; the same model is the post_train flow's
parameter type, so Prefect's run form shows these fields with their defaults and descriptions.
Every section forbids unknown keys, so a typo is an error that names the field, not a silent default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="Local Hugging Face causal-LM directory. Empty: build a tiny model from the fields "
        "below with the built-in character tokenizer (the CPU demo).",
    )
    arch: Literal["llama", "qwen2"] = Field("llama", description="Architecture of a model built from scratch.")
    hidden_size: int = Field(96, gt=0)
    intermediate_size: int = Field(256, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(4, gt=0)
    max_seq_len: int = Field(64, gt=0, description="Longest prompt + response, in tokens.")


class BuiltinTaskConfig(Section):
    task: Literal["sort", "reverse", "add"] = Field(..., description="Which built-in verifiable task to generate.")
    num_digits: int = Field(4, gt=0, le=12)
    num_train: int = Field(20000, gt=0)
    num_eval: int = Field(256, gt=0)
    seed: int = 1234


class DataConfig(Section):
    train_path: str = Field(..., description="Prompt file for training: .jsonl or .parquet.")
    eval_path: str | None = Field(None, description="Held-out prompt file; empty disables eval.")
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    label_key: str = Field("label", description="Column holding what the reward checks against.")
    shuffle: bool = True
    seed: int = 0
    generate: BuiltinTaskConfig | None = Field(
        None, description="Write a built-in task to train_path/eval_path first, if those files are missing."
    )


class RolloutConfig(Section):
    backend: Literal["torch"] = Field("torch", description="Rollout engine: the embedded PyTorch generator.")
    num_workers: int = Field(1, gt=0)
    prompts_per_step: int = Field(64, gt=0)
    samples_per_prompt: int = Field(8, gt=0, description="Group size for group-relative advantages.")
    max_new_tokens: int = Field(8, gt=0)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    stop: list[str] = Field(default_factory=list, description="Stop strings besides the EOS token.")
    batch_size: int = Field(512, gt=0, description="Sequences generated together per worker (KV-cache slots).")
    http_server: bool = Field(
        False, description="Every rollout worker also serves SGLang's HTTP routes on an ephemeral port "
        "(docs/rollout.md); the session's `server_urls` lists them and `router.url` balances over them.",
    )
    device: Literal["cpu", "cuda"] | None = Field(None, description="Where rollout engines run; empty: train.device.")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="Weights and compute dtype of the rollout engine.")
    off_policy_steps: int = Field(
        0, ge=0, le=1,
        description="0: synchronous (step k samples with step k's weights). 1: one-step-off async: step k+1's "
        "rollout generates while step k trains, with weights one update behind.",
    )


class RewardConfig(Section):
    fn: str = Field(
        "engines.rewards:sort_reward",
        description="Import path 'module:function' of f(prompts, responses, labels) -> list[float] (sync or async).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the reward.")


class AlgorithmConfig(Section):
    """Advantage estimator, policy loss, KL, entropy and rollout/train mismatch correction (docs/algorithms.md)."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = Field(
        "grpo",
        description="grpo: (r - mean) / std per group; dr_grpo: r - mean; rloo: r - mean of the group's other "
        "samples; reinforce_pp: discounted token returns whitened over the batch (no group needed); "
        "reinforce_pp_baseline: r - group mean, divided by the batch std.",
    )
    normalize_std: bool | None = Field(
        None, description="Override std normalisation of grpo / dr_grpo (default: grpo yes, dr_grpo no)."
    )
    gamma: float = Field(
        1.0, gt=0.0, le=1.0, description="Discount of reinforce_pp's token returns; 1 credits every token fully."
    )
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo",
        description="ppo: token-level clipped ratio; gspo: clipped sequence ratio exp(mean token log-ratio) "
        "(use clip_low 3e-4, clip_high 4e-4 and loss_agg seq_mean_token_mean).",
    )
    clip_low: float = Field(0.2, ge=0.0, description="Ratio may fall to 1 - clip_low before the loss clips it.")
    clip_high: float = Field(
        0.2, ge=0.0, description="Ratio may rise to 1 + clip_high; above clip_low is DAPO's clip-higher."
    )
    clip_ratio_c: float | None = Field(
        None,
        gt=1.0,
        description="Dual-clip PPO: caps the loss of negative-advantage tokens at clip_ratio_c * |A| (typically "
        "3); empty disables. ppo only.",
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="How per-token losses become one number: over all tokens, per sequence then batch, or "
        "Dr.GRPO's sum over tokens divided by a constant (max_new_tokens).",
    )
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of KL to the frozen reference model; 0 disables it.")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3",
        description="k1: log-ratio; k2: squared log-ratio / 2; k3: low-variance unbiased estimator; "
        "low_var_kl: k3 clamped to [-10, 10].",
    )
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: kl_coef * KL is added to the loss; reward: kl_coef * per-token KL is subtracted from "
        "the rewards before the advantages.",
    )
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (subtracted from the loss).")
    is_correction: Literal["none", "tis", "icepop"] = Field(
        "none",
        description="Rollout/train mismatch correction: tis weighs each token by min(p_train / p_rollout, "
        "tis_cap); icepop drops tokens whose ratio is outside [icepop_low, icepop_high]. Either costs one "
        "extra forward pass per step (the train engine's logprobs before the update).",
    )
    tis_cap: float = Field(2.0, gt=0.0, description="TIS: upper bound of the importance weight.")
    icepop_low: float = Field(0.5, gt=0.0, description="IcePop: smallest p_train / p_rollout kept.")
    icepop_high: float = Field(5.0, gt=0.0, description="IcePop: largest p_train / p_rollout kept.")
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO overlong shaping: the last overlong_buffer tokens before rollout.max_new_tokens cost "
        "reward linearly, up to overlong_penalty at the limit; 0 disables.",
    )
    overlong_penalty: float = Field(0.0, ge=0.0, description="Reward lost at the length limit; 0 disables.")

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.normalize_std is not None and self.advantage not in ("grpo", "dr_grpo"):
            raise ValueError(f"normalize_std applies to grpo / dr_grpo only, not advantage {self.advantage!r}")
        if self.clip_ratio_c is not None and self.policy_loss != "ppo":
            raise ValueError("clip_ratio_c (dual clip) applies to policy_loss 'ppo' only")
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"icepop_low ({self.icepop_low}) must be below icepop_high ({self.icepop_high})")
        return self

    def loss_kwargs(self) -> dict[str, Any]:
        """rl_loss's keyword arguments from this config, so every train backend passes the same ones."""
        return {
            "clip_low": self.clip_low, "clip_high": self.clip_high, "loss_agg": self.loss_agg,
            "kl_coef": self.kl_coef if self.kl_in == "loss" else 0.0, "kl_estimator": self.kl_estimator,
            "entropy_coef": self.entropy_coef, "policy": self.policy_loss, "clip_ratio_c": self.clip_ratio_c,
            "is_correction": self.is_correction, "tis_cap": self.tis_cap,
            "icepop_low": self.icepop_low, "icepop_high": self.icepop_high,
        }


class TrainConfig(Section):
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="Train engine: the native PyTorch backend, or Megatron-core (see the megatron section)."
    )
    num_workers: int = Field(
        1, gt=0, description="Train workers (gloo on CPU, nccl on GPU): data-parallel copies for torch; "
        "tensor x pipeline x data-parallel ranks for megatron."
    )
    steps: int = Field(100, gt=0, description="RL iterations.")
    lr: float = Field(3e-3, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0.0)
    mini_batches: int = Field(1, gt=0, description="Optimizer steps per pass over the batch (PPO mini-batches).")
    epochs: int = Field(1, gt=0, description="Passes over each rollout batch (PPO epochs).")
    micro_batch_size: int = Field(512, gt=0, description="Sequences per forward/backward on one worker.")
    precision: Literal["fp32", "bf16"] = "fp32"
    threads: int = Field(2, gt=0, description="torch threads per worker.")
    device: Literal["cpu", "cuda"] = "cpu"


class MegatronConfig(Section):
    """The Megatron-core backend (train.backend: megatron). The three dicts reach megatron-core untouched."""

    tensor_parallel: int = Field(1, gt=0, description="Tensor-parallel size.")
    pipeline_parallel: int = Field(1, gt=0, description="Pipeline-parallel size.")
    micro_batch_tokens: int = Field(
        0, ge=0, description="Token budget of one micro-batch (rows x padded length); 0: train.micro_batch_size rows."
    )
    use_distributed_optimizer: bool = Field(True, description="Shard optimizer state over data-parallel ranks.")
    transformer_engine: bool | None = Field(
        None, description="Build layers from Transformer Engine; empty: when it is installed."
    )
    transformer: dict[str, Any] = Field(
        default_factory=dict, description="Extra TransformerConfig keyword arguments (override the derived ones)."
    )
    optimizer: dict[str, Any] = Field(
        default_factory=dict, description="Extra OptimizerConfig keyword arguments (override the derived ones)."
    )
    ddp: dict[str, Any] = Field(
        default_factory=dict, description="Extra DistributedDataParallelConfig keyword arguments."
    )

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


class ClusterConfig(Section):
    address: str | None = Field(
        None, description="Ray address to join ('auto' joins the one in RAY_ADDRESS); empty starts a private local Ray."
    )
    num_cpus: int | None = Field(None, gt=0, description="CPUs for a local Ray; empty: all.")
    cpus_per_worker: float = Field(0.5, ge=0, description="CPUs Ray reserves for each train/rollout actor.")
    object_store_mb: int = Field(512, gt=0, description="Object store size of a local Ray, MiB.")
    use_ray: bool = Field(True, description="False runs the workers inside the flow process (debugging).")
    colocate: bool = Field(
        False,
        description="GPU placement. true: rollout worker i shares train worker i's GPU; the rollout engine releases "
        "its weights' memory while training runs and takes the new ones after (slime's --colocate). false "
        "(disaggregated): train and rollout workers get GPUs of their own.",
    )


class CheckpointConfig(Section):
    every: int = Field(0, ge=0, description="Save every N steps; 0 saves only at the end.")
    keep_last: int = Field(2, gt=0, description="Committed checkpoints kept; the newest is never deleted.")
    save_rollouts: bool = Field(True, description="Persist each step's samples so a retried step reuses them.")
    keep_rollouts: bool = Field(False, description="Keep rollout batches older than the newest checkpoint.")


class EvalConfig(Section):
    every: int = Field(10, ge=0, description="Evaluate every N steps on data.eval_path; 0 disables.")
    max_prompts: int = Field(256, gt=0)
    temperature: float = Field(0.0, ge=0.0, description="0 means greedy decoding.")


class TrackingConfig(Section):
    uri: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI.")
    experiment: str = "rlflow"
    log_samples: int = Field(8, ge=0, description="Sample rollouts logged as a table each eval.")


class StorageConfig(Section):
    uri: str = Field("runs", description="Run store root: a local path, file:// or s3:// URI.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto, ...); empty: AWS.")
    profile: str | None = Field(None, description="AWS profile name; empty: the environment's credentials.")
    key: SecretStr | None = Field(None, description="Access key id (prefer the environment: AWS_ACCESS_KEY_ID).")
    secret: SecretStr | None = Field(None, description="Secret key (prefer the environment: AWS_SECRET_ACCESS_KEY).")
    region: str | None = None
    retries: int = Field(5, ge=0, description="Retries of a storage call after a transient error (backoff).")

    def fsspec_options(self) -> dict[str, Any]:
        """Keyword arguments for fsspec; empty for local paths. Secrets appear here and nowhere else."""
        if not self.uri.startswith(("s3://", "s3a://")):
            return {}
        opts: dict[str, Any] = {}
        client: dict[str, Any] = {}
        if self.endpoint_url:
            client["endpoint_url"] = self.endpoint_url
        if self.region:
            client["region_name"] = self.region
        if client:
            opts["client_kwargs"] = client
        if self.profile:
            opts["profile"] = self.profile
        if self.key and self.secret:
            opts["key"], opts["secret"] = self.key.get_secret_value(), self.secret.get_secret_value()
        return opts


class WeightSyncConfig(Section):
    transport: Literal["ray", "store", "cuda_ipc", "nccl"] = Field(
        "ray",
        description="ray: tensors go actor to actor through Ray's object store, bucket by bucket. store: rank 0 "
        "writes safetensors under the run store and rollout workers read them (works wherever the store does). "
        "cuda_ipc (colocated GPUs): rollout workers copy straight from their train worker's parameters. "
        "nccl (separate GPUs): train rank 0 broadcasts buckets to the rollout workers over NCCL.",
    )
    bucket_mb: float = Field(64, gt=0, description="Size of one weight bucket, MiB.")


class OrchestrationConfig(Section):
    flow_retries: int = Field(0, ge=0, description="Prefect retries of a failed flow run; each resumes from the store.")
    task_retries: int = Field(0, ge=0, description="Retries of rollout, reward, checkpoint and eval (safe to rerun).")
    retry_delay_s: float = Field(10.0, ge=0)


class RLConfig(Section):
    """A whole post-training run."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$", description="Run name: its folder in the run store.")
    seed: int = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)

    @model_validator(mode="after")
    def _consistent(self) -> RLConfig:
        mp = self.megatron.model_parallel
        if self.train.backend == "megatron" and self.train.num_workers % mp:
            raise ValueError(f"train.num_workers ({self.train.num_workers}) must be a multiple of "
                             f"megatron.tensor_parallel x megatron.pipeline_parallel ({mp})")
        batch = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if batch % (self.data_parallel_size * self.train.mini_batches) != 0:
            raise ValueError(
                f"train: rollout.prompts_per_step * rollout.samples_per_prompt = {batch} must divide evenly "
                f"into {self.data_parallel_size} data-parallel workers x train.mini_batches "
                f"({self.train.mini_batches})"
            )
        if self.rollout.off_policy_steps and not self.checkpoint.save_rollouts:
            raise ValueError(
                "checkpoint.save_rollouts: must be true with rollout.off_policy_steps > 0 (a resumed run needs the "
                "batch the last checkpoint's weights did not generate)"
            )
        if self.algorithm.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({self.algorithm.overlong_buffer}) must not exceed "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens})"
            )
        self._check_placement()
        if self.model.hidden_size % self.model.num_heads or self.model.num_heads % self.model.num_kv_heads:
            raise ValueError("model: hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        return self

    def _check_placement(self) -> None:
        transport, on_gpu = self.weight_sync.transport, self.train.device == "cuda" and self.rollout_device == "cuda"
        if transport in ("cuda_ipc", "nccl"):
            if not on_gpu or not self.cluster.use_ray:
                raise ValueError(f"weight_sync.transport: {transport} needs train.device and rollout.device 'cuda' "
                                 "and cluster.use_ray: true (train and rollout in separate processes)")
            if self.train.backend != "torch":
                raise ValueError(f"weight_sync.transport: {transport} works with train.backend 'torch'; "
                                 "use 'ray' or 'store' with megatron")
        if transport == "cuda_ipc" and not self.cluster.colocate:
            raise ValueError("weight_sync.transport: cuda_ipc needs cluster.colocate: true (a shared GPU)")
        if self.cluster.colocate:
            if not on_gpu:
                raise ValueError("cluster.colocate: needs train.device and rollout.device 'cuda'")
            if self.rollout.num_workers != self.train.num_workers:
                raise ValueError(f"cluster.colocate: rollout.num_workers ({self.rollout.num_workers}) must equal "
                                 f"train.num_workers ({self.train.num_workers}): one pair per GPU")
            if self.rollout.off_policy_steps:
                raise ValueError("cluster.colocate: one-step-off async (rollout.off_policy_steps: 1) needs "
                                 "separate GPUs for rollout and training (colocate: false)")

    @property
    def rollout_device(self) -> str:
        return self.rollout.device or self.train.device

    @property
    def data_parallel_size(self) -> int:
        if self.train.backend == "megatron":
            return self.train.num_workers // self.megatron.model_parallel
        return self.train.num_workers


class RecipeError(ValueError):
    """A recipe that cannot run; the message lists every problem, one per line, each naming its field."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))


def _format_errors(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<recipe>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and e["type"] not in ("value_error",):
            msg = f"{msg} (got {e['input']!r})"
        out.append(f"{field}: {msg}")
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=c' -> (['a', 'b'], value), the value parsed as YAML so numbers and lists keep their types."""
    if "=" not in text:
        raise RecipeError("--set", [f"{text!r}: expected KEY.PATH=VALUE"])
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError("--set", [f"{text!r}: {part} is not a section"])
        node[path[-1]] = value
    return raw


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> RLConfig:
    """Read a YAML recipe, apply `--set` overrides, validate. Raises RecipeError naming every bad field."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(str(path), ["recipe file not found"])
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(str(path), [f"not valid YAML: {e}"]) from None
    if not isinstance(raw, dict):
        raise RecipeError(str(path), ["top level must be a mapping of sections"])
    return config_from_dict(apply_overrides(raw, overrides or []), source=str(path))


def config_from_dict(raw: dict, source: str = "<config>") -> RLConfig:
    try:
        return RLConfig.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(source, _format_errors(e)) from None
