"""rollout: the generating engines (embedded or SGLang), their KV cache, sampling, dynamic sampling and
how far rollout may run ahead of training."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, model_validator

from rlflow.engines.core.config.base import Section, nodes_field
from rlflow.engines.core.config.env import ENV_ROLLOUT_FN, EnvConfig
from rlflow.engines.core.sglang_args import DETERMINISTIC, normalise_args

# launch modules whose flags are SGLang's (the stand-in takes a subset of them, with the same names)
SGLANG_LAUNCHERS = ("sglang.launch_server", "rlflow.engines.rollout.launch")


class SGLangConfig(Section):
    """rollout.backend: sglang. Each rollout worker runs `<python> -m <launch_module> --model-path <model> --host
    <its address> --port <free port> <args>` on the GPUs Ray gave it (docs/rollout.md)."""

    python: str | None = Field(
        None, description="The interpreter that runs the server: an environment with SGLang installed (it pins its "
        "own torch and transformers, so it rarely fits rlflow's). Empty: this interpreter. Weight transports across "
        "two environments: docs/rollout.md.")
    launch_module: str = Field("sglang.launch_server", description="Module started with `python -m` as the server.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="SGLang's launch_server flags: `mem-fraction-static: 0.8` -> `--mem-fraction-static 0.8`; true "
        "-> the bare flag; false or null -> left out; a list -> its values after one flag. Names are checked against "
        "SGLang's flags at validation and written canonically (`tp_size`/`tp-size` -> `tensor-parallel-size`; an "
        "ambiguous one such as `pp` is refused). model-path, host, port and api-key are set by the worker.",
    )
    deterministic: bool = Field(
        True, description="Launch with --enable-deterministic-inference: SGLang honours a request's sampling_seed "
        "only then (a retried request, or a rerun, gives the same tokens). false: SGLang's faster sampling and "
        "attention kernels, and sampling_seed is ignored.")
    startup_timeout_s: float = Field(600, gt=0, description="Seconds to wait for the server's /health to answer 200.")
    drain_timeout_s: float = Field(
        120, gt=0, description="Colocated: seconds to wait for running requests to finish before the server's memory "
        "is released (SGLang releases only an idle server).")

    @model_validator(mode="after")
    def _check_args(self) -> SGLangConfig:
        checked = self.launch_module in SGLANG_LAUNCHERS  # a custom launcher's flags are its own: only re-spelled
        args = normalise_args(self.args, check=checked)
        if checked:
            given = args.get(DETERMINISTIC)
            if given is not None and bool(given) != self.deterministic:
                raise ValueError(f"rollout.sglang.args.{DETERMINISTIC}: {given} contradicts rollout.sglang."
                                 f"deterministic: {self.deterministic}; set deterministic only")
            args[DETERMINISTIC] = self.deterministic
        self.args.clear()  # in place: assigning would validate the model again (validate_assignment)
        self.args.update(args)
        return self


class DynamicSamplingConfig(Section):
    """Over-sample prompts, drop groups whose rewards are all equal (they carry no group-relative signal), and
    abort what is still generating once prompts_per_step groups are kept."""

    enabled: bool = False
    over_sample: float = Field(
        1.5, ge=1.0, description="Prompts started per round, as a multiple of the groups still missing.")
    max_prompts: int = Field(
        0, ge=0, description="Give up filtering after this many prompts in a step and fill the batch with "
        "dropped groups (0: 4 x prompts_per_step).")
    partial_rollout: bool = Field(
        False, description="Keep the generations cut short by the abort and continue them next step (with the "
        "default rollout.fn); otherwise their prompts are started again next step. Finished surplus groups are "
        "always kept for the next step.")


class KVCacheConfig(Section):
    """The embedded engine's paged KV cache (docs/rollout.md): one pool of fixed-size pages shared by every
    running sequence, so contexts are bounded by the model's positions and the pool, not a fixed slot."""

    page_size: int = Field(16, gt=0, description="Tokens per KV page.")
    memory_fraction: float = Field(
        0.5, gt=0.0, lt=1.0, description="CUDA: the share of the GPU memory free once the weights are loaded "
        "that the page pool takes (SGLang's mem_fraction_static idea, of free rather than total memory).")
    tokens: int | None = Field(
        None, gt=0, description="Pool size in tokens; overrides memory_fraction. Empty: from memory_fraction on "
        "CUDA, 65536 tokens on CPU (never more than batch_size x context_len).")
    prefill_chunk_tokens: int = Field(
        8192, gt=0, description="Prompt tokens prefilled per engine step; a longer prompt is prefilled in chunks "
        "over several steps, between the running decodes.")
    share_prompts: bool = Field(
        True, description="Requests with the same prompt (the samples of a GRPO group) prefill once and share the "
        "prompt's full pages (the partial last page is copied); false: each prefills and stores its own.")


class RolloutConfig(Section):
    backend: Literal["torch", "sglang"] = Field(
        "torch", description="Rollout engine: the embedded PyTorch generator, or an SGLang server per worker "
        "(rollout.sglang).")
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description="The SGLang backend's server.")
    router: Literal["auto", "sglang-router", "rlflow"] = Field(
        "auto", description="The router in front of the workers' servers. auto: sglang-router (pip install "
        "'rlflow[router]') for backend sglang where it is installed, else rlflow's own (engines/rollout/router.py), "
        "which also serves the embedded engine: it takes a batched /generate, sglang-router only one item a request.")
    num_workers: int = Field(1, gt=0)
    nodes: int = nodes_field("rollout workers")
    prompts_per_step: int = Field(64, gt=0)
    samples_per_prompt: int = Field(8, gt=0, description="Group size for group-relative advantages.")
    max_new_tokens: int = Field(8, gt=0)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    stop: list[str] = Field(default_factory=list, description="Stop strings besides the EOS token.")
    batch_size: int = Field(512, gt=0, description="Sequences generated together per worker (page-table rows).")
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig, description="The embedded engine's paged KV cache.")
    compile: bool = Field(
        False, description="Embedded engine on CUDA: torch.compile its decode step before capturing it in CUDA graphs "
        "(norms, rotary, SwiGLU and residual adds fused; 1.6x a step on an H100, docs/benchmarks.md), at the cost of "
        "compiling at the first rollout. SGLang's --enable-torch-compile.")
    fn: str = Field(
        "rlflow.engines.rollout.functions:single_turn",
        description="Import path of the async rollout function f(prompt, router_url, sampling_params) -> "
        "list[Sample] (docs/rollout.md): multi-turn, tools and agents live there. The default generates "
        "samples_per_prompt single-turn completions through SGLang's /generate.",
    )
    env: EnvConfig | None = Field(
        None, description="A multi-turn environment (docs/agents.md): its episodes are driven by the built-in env "
        f"rollout ({ENV_ROLLOUT_FN}), which rollout.fn becomes when left at its default.")
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=lambda: DynamicSamplingConfig(), description="DAPO-style group filtering (off by default).")
    device: Literal["cpu", "cuda"] | None = Field(None, description="Where rollout engines run; empty: train.device.")
    precision: Literal["fp32", "bf16", "fp8"] = Field(
        "fp32", description="Weights and compute dtype of the rollout engine. fp8 (embedded engine on CUDA): the "
        "dense projections' weights in e4m3 with per-channel scales, quantized as each weight sync arrives, GEMMs "
        "through torch._scaled_mm; compute, embeddings, the LM head and MoE experts in bf16. It turns "
        "algorithm.is_correction tis on unless the recipe sets is_correction or rejection (docs/rollout.md).")
    true_on_policy: bool = Field(
        False, description="Embedded engine with the native trainer: both run one batch-invariant implementation of "
        "every op (engines/models/invariant.py), so the engine's log-prob of each sampled token equals the trainer's "
        "bit for bit (importance ratio exactly 1), and a step whose log-probs differ at all stops with "
        "OnPolicyMismatch. Costs decode and train throughput (docs/rollout.md, 'True on-policy'); needs "
        "rollout.backend and train.backend torch, one precision and device on both sides, max_staleness 0; refuses "
        "fp8, compile, LoRA, liger kernels, context and expert parallelism and routing replay (dense and MoE models: "
        "Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral); decodes without CUDA graphs.")
    max_staleness: int = Field(
        0, ge=0,
        description="How many weight versions rollout may run ahead of training (docs/rollout.md, asynchronous "
        "training). 0: synchronous (step k samples with step k's weights). 1: one-step-off: step k+1 generates "
        "while step k trains, with weights one update behind, and the sync waits for it (each step's samples "
        "come from one version). k >= 2: the rollouts of steps up to k ahead run while training goes on and "
        "weights are updated under them (a generation in flight continues with the new weights); a step's "
        "rollout starts only once version step - k is on the rollout workers; use algorithm.is_correction with "
        "it (docs/algorithms.md). Replaces off_policy_steps.",
    )

    @model_validator(mode="before")
    @classmethod
    def _env_rollout_fn(cls, data: Any) -> Any:
        """rollout.env without rollout.fn: the env rollout drives it."""
        if isinstance(data, dict) and data.get("env") is not None and "fn" not in data:
            return {**data, "fn": ENV_ROLLOUT_FN}
        return data

    @model_validator(mode="before")
    @classmethod
    def _off_policy_steps_alias(cls, data: Any) -> Any:
        """`off_policy_steps` (0 or 1), the field's old name, still reads as max_staleness, with a warning."""
        if not isinstance(data, dict) or "off_policy_steps" not in data:
            return data
        data = dict(data)
        old = data.pop("off_policy_steps")
        if "max_staleness" in data and data["max_staleness"] != old:
            raise ValueError(f"rollout.off_policy_steps ({old}) and rollout.max_staleness ({data['max_staleness']}) "
                             "disagree: off_policy_steps is max_staleness's old name; give max_staleness alone")
        data["max_staleness"] = old
        warnings.warn(f"rollout.off_policy_steps is deprecated: it is read as rollout.max_staleness: {old} "
                      "(the same run); rename it in the recipe", FutureWarning, stacklevel=2)
        return data
