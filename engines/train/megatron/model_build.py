"""Megatron process groups, and one pipeline stage's GPTModel built from a Hugging Face model directory."""

from __future__ import annotations

import gc
import importlib.util
import json
import re
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from safetensors import safe_open

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.config import MegatronConfig
from rlflow.engines.train.megatron import fused_kernels
from rlflow.engines.train.megatron.attention import local_layer_spec
from rlflow.engines.train.megatron.hf_config import ModelSpec
from rlflow.engines.train.megatron.weights import Rule, check_tensor_parallel, model_rules, to_megatron

# TransformerConfig fields the backend sets itself: the loss scaling and the weight layout depend on them
RESERVED = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "calculate_per_token_loss",
            "params_dtype", "bf16", "fp16", "perform_initialization", "use_cpu_initialization")


def init_parallel(rank: int, world_size: int, dist_url: str | None, cfg: MegatronConfig, device: str,
                  seed: int, timeout_s: float = 1800) -> None:
    """torch.distributed (nccl on CUDA, gloo on CPU) and megatron's TP/PP/DP groups over this worker group; a
    collective waiting longer than `timeout_s` for a peer raises."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # Ray shows each actor one GPU; torchrun all
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size,
                                init_method=dist_url or f"tcp://127.0.0.1:{free_port()}",
                                timeout=timedelta(seconds=timeout_s))
    elif dist.get_world_size() != world_size:
        raise RuntimeError(f"torch.distributed is already up with {dist.get_world_size()} ranks, not {world_size}")
    if world_size % cfg.model_parallel:
        raise ValueError(f"{world_size} ranks do not split into tensor_parallel x pipeline_parallel = "
                         f"{cfg.model_parallel}")
    if (world_size // cfg.model_parallel) % cfg.expert_parallel:
        raise ValueError(f"megatron.expert_parallel {cfg.expert_parallel} does not divide the data-parallel size "
                         f"{world_size // cfg.model_parallel}")
    _form_megatron_groups(cfg)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


# the process groups megatron's initialize_model_parallel made in this process, and the layout they were formed for
# (default group, world size, TP, PP, EP): a later backend of the same layout reuses them, another releases them
_MEGATRON_GROUPS: list[dist.ProcessGroup] = []
_FORMED_FOR: tuple[weakref.ref, tuple[int, ...]] | None = None


def _form_megatron_groups(cfg: MegatronConfig) -> None:
    """Megatron's TP/PP/DP/EP groups over the default group: the ones an earlier backend of this process formed
    when the layout is the same, else new ones, after releasing the old. megatron's destroy_model_parallel only
    forgets its groups, and a group's gloo threads (three each) live as long as any object refers to it: a process
    that built backends one after another (the tests) held 1,400 idle threads polling a core's worth of CPU away
    from everything after. torch lists every group it made (c10d's private registry, which has no public
    equivalent): megatron's are the ones new after its call."""
    global _FORMED_FOR
    # the default group by weak reference: a strong one would keep a destroyed default group's threads
    layout = (dist.get_world_size(), cfg.tensor_parallel, cfg.pipeline_parallel, cfg.expert_parallel)
    if (parallel_state.model_parallel_is_initialized() and _FORMED_FOR is not None
            and _FORMED_FOR[0]() is dist.group.WORLD and _FORMED_FOR[1] == layout):
        return
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    registry = dist.distributed_c10d._world.pg_map
    for group in _MEGATRON_GROUPS:
        if group in registry:  # destroying a group can take groups split from it along
            dist.destroy_process_group(group)
    if _MEGATRON_GROUPS:
        # megatron's rotary embeddings cache forward() per module in a class-wide lru_cache, which keeps up to 32
        # old modules (each with its context-parallel group) and their tables alive after their model is gone
        for rotary in (RotaryEmbedding, YarnRotaryEmbedding):
            rotary.forward.cache_clear()
        gc.collect()  # the old backends' models refer to their groups, often from reference cycles
    _MEGATRON_GROUPS.clear()
    before = set(registry)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tensor_parallel,
                                             pipeline_model_parallel_size=cfg.pipeline_parallel,
                                             expert_model_parallel_size=cfg.expert_parallel)
    _MEGATRON_GROUPS.extend(group for group in registry if group not in before)
    _FORMED_FOR = (weakref.ref(dist.group.WORLD), layout)


def use_transformer_engine(cfg: MegatronConfig, device: str) -> bool:
    if cfg.transformer_engine is not None:
        return cfg.transformer_engine
    return device == "cuda" and importlib.util.find_spec("transformer_engine") is not None


def transformer_config(spec: ModelSpec, cfg: MegatronConfig, dtype: torch.dtype, device: str,
                       use_te: bool = False, compiled: bool = False, routing_replay: bool = False) -> TransformerConfig:
    """The derived TransformerConfig, then the recipe's megatron.transformer keys on top (except RESERVED).
    `compiled`: the decoder layers will go through torch.compile (compile_decoder_layers). `routing_replay`: the
    MoE routers can record and replay their choice (engines/train/megatron/routing.py)."""
    clash = sorted(set(cfg.transformer) & set(RESERVED))
    if clash:
        raise ValueError(f"megatron.transformer: {', '.join(clash)} are set by the backend, not the recipe")
    check_tensor_parallel(spec, cfg.tensor_parallel)
    if spec.num_layers % cfg.pipeline_parallel and "num_layers_in_first_pipeline_stage" not in cfg.transformer:
        raise ValueError(f"pipeline_parallel={cfg.pipeline_parallel} does not divide {spec.num_layers} layers")
    if cfg.expert_parallel > 1 and not spec.num_experts:
        raise ValueError(f"megatron.expert_parallel={cfg.expert_parallel}: the {spec.family} model has no experts")
    if cfg.expert_parallel > 1 and spec.num_experts % cfg.expert_parallel:
        raise ValueError(f"megatron.expert_parallel={cfg.expert_parallel} does not divide {spec.num_experts} experts")
    kwargs: dict[str, Any] = spec.transformer_kwargs() | {
        "tensor_model_parallel_size": cfg.tensor_parallel,
        "pipeline_model_parallel_size": cfg.pipeline_parallel,
        "expert_model_parallel_size": cfg.expert_parallel,
        # losses arrive already scaled by their share of the global batch: megatron must sum, not average
        "calculate_per_token_loss": True,
        "params_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        # initialised, then overwritten from the HF checkpoint: without it, megatron-core (0.16) leaves the
        # tensor-parallel attributes of the weights unset and the gradient norm misses the other TP ranks' shards
        "perform_initialization": True,
        "use_cpu_initialization": device == "cpu",
    }
    if routing_replay:
        kwargs["moe_enable_routing_replay"] = True
    if cfg.torch_fused_kernels and not use_te:
        fused_kernels.install()
        # the local spec's linears: weight-gradient GEMMs add into main_grad. Not under torch.compile: dynamo
        # cannot trace that backward (it writes into main_grad, a tensor from outside the graph) and breaks the
        # layer at every linear, which cost more than the fusion saves (docs/benchmarks.md, 2026-11-27)
        kwargs["gradient_accumulation_fusion"] = not compiled
    if cfg.pipeline_parallel > 1:  # micro-batches differ in shape: stages exchange shapes first
        # (megatron-core 0.16 rejects variable lengths with the default MoE dispatcher even for dense models)
        kwargs |= {"pipeline_dtype": dtype, "variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"}
    return TransformerConfig(**(kwargs | cfg.transformer))


def build_model(spec: ModelSpec, config: TransformerConfig, use_te: bool, attention: str) -> GPTModel:
    """This pipeline stage's GPTModel with megatron's random init (load_hf_weights overwrites every weight)."""
    if spec.num_experts:
        _define_te_gemm_when_missing()
    if use_te:
        # needs Transformer Engine, which only use_te runs have
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        layer_spec = get_gpt_layer_with_transformer_engine_spec(num_experts=spec.num_experts or None,
                                                                moe_grouped_gemm=config.moe_grouped_gemm,
                                                                qk_layernorm=spec.qk_norm)
    else:
        layer_spec = local_layer_spec(spec.qk_norm, attention, spec.num_experts)
    return GPTModel(config=config, transformer_layer_spec=layer_spec,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(), **spec.gpt_kwargs())


def compile_decoder_layers(model: GPTModel) -> None:
    """torch.compile each decoder layer's forward (dynamic shapes: micro-batch lengths vary). Without Transformer
    Engine the local spec runs RMSNorm, rotary, SwiGLU, residual adds and casts as separate kernels; compiled,
    the elementwise work between the GEMMs fuses (the native trainer's train.compile, on megatron's layers).

    The layers share one compiled graph per piece (their code is the same; parameters are graph inputs). Two
    things in megatron's code would split them:
    - megatron's rotary for packed (THD) streams splits q and k per sample after copying the sample lengths to
      the host: traced, it would recompile for every new count of samples, so it stays eager
      (torch.compiler.disable);
    - megatron-core 0.19 warns (DeprecationWarning) on every linear-layer call that passes no tensor-parallel
      group, which RowParallelLinear always does. dynamo cannot trace the warning, and inside the
      activation-offload context manager it cannot resume after a break, so it gave up on whole frames. The
      layers get megatron's group lookup without the warning instead (`_default_tp_group`)."""
    from megatron.core.models.common.embeddings import rope_utils  # the module whose global the layers look up
    from megatron.core.tensor_parallel import layers  # likewise

    if not getattr(rope_utils._apply_rotary_pos_emb_thd, "_rlflow_eager", False):
        eager = torch.compiler.disable(rope_utils._apply_rotary_pos_emb_thd)
        eager._rlflow_eager = True
        rope_utils._apply_rotary_pos_emb_thd = eager
    layers.get_tensor_model_parallel_group_if_none = _default_tp_group
    for layer in model.decoder.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


def _default_tp_group(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
    """megatron.core.utils.get_tensor_model_parallel_group_if_none, less its deprecation warning: the group
    given, else the default (expert) tensor-parallel group once both torch.distributed and megatron's groups are
    up."""
    if not dist.is_initialized():
        return None
    if tp_group is not None or not parallel_state.is_initialized():
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def _define_te_gemm_when_missing() -> None:
    """megatron-core 0.16's MoE router tests `te_general_gemm is not None`, a name its module defines only when
    Transformer Engine imports: without TE the router raises NameError. None is what it means there."""
    from megatron.core.transformer.moe import moe_utils  # MoE models only: dense runs never import it

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def stage_params(model: GPTModel) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters under their global names: decoder.layers.<global layer>.*, and with expert
    parallelism mlp.experts.local_experts.<global expert>.* (rank e of E holds experts e*n .. e*n + n - 1)."""
    to_global = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    local_experts = (model.config.num_moe_experts or 0) // parallel_state.get_expert_model_parallel_world_size()
    first_expert = parallel_state.get_expert_model_parallel_rank() * local_experts
    out = {}
    for name, p in model.named_parameters():
        m = _LAYER.match(name)
        if m:
            name = f"decoder.layers.{to_global[int(m.group(1))]}.{name[m.end():]}"
        e = _EXPERT.search(name)
        if e:
            name = f"{name[:e.start()]}.mlp.experts.local_experts.{first_expert + int(e.group(1))}.{name[e.end():]}"
        out[name] = p
    return out


def stage_rules(spec: ModelSpec, params: dict[str, torch.nn.Parameter], fused_norms: bool) -> list[Rule]:
    """The rules for this stage's parameters. A last stage without the embedding holds its own copy of tied
    output weights, loaded from embed_tokens."""
    rules = [r for r in model_rules(spec, fused_norms) if r.megatron in params]
    if spec.tied_embeddings and "output_layer.weight" in params:
        rules.append(Rule("output_layer.weight", ("model.embed_tokens.weight",), "column"))
    unmapped = sorted(set(params) - {r.megatron for r in rules})
    if unmapped:
        raise RuntimeError(f"Megatron parameters without an HF mapping: {unmapped[:5]}")
    return rules


class HFWeights:
    """Tensors of a HF model directory by name, read lazily from one or many safetensors files."""

    def __init__(self, path: str | Path):
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: path / f for name, f in files.items()}
        else:
            single = path / "model.safetensors"
            with safe_open(str(single), framework="pt") as f:
                self.file_of = {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        self._open: dict[Path, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        file = self.file_of.get(name)
        if file is None:
            raise KeyError(f"{name} is not in the HF checkpoint")
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file].get_tensor(name)


@torch.no_grad()
def load_hf_weights(model: GPTModel, spec: ModelSpec, path: str | Path, fused_norms: bool = False) -> int:
    """Copy this stage's and this TP rank's share of the HF weights into `model`. Returns the tensors loaded."""
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    params = stage_params(model)
    weights = HFWeights(path)
    rules = stage_rules(spec, params, fused_norms)
    for rule in rules:
        value = to_megatron(rule, [weights.get(n) for n in rule.hf], spec, tp, rank)
        param = params[rule.megatron]
        if value.shape != param.shape:
            raise RuntimeError(f"{rule.megatron}: HF gives {tuple(value.shape)}, Megatron has {tuple(param.shape)}")
        param.copy_(value)
    return len(rules)
