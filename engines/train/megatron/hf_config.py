"""A Hugging Face config as the Megatron model it maps to: TransformerConfig and GPTModel arguments.

Llama, Qwen2 and Qwen3 share one decoder (RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention);
Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm on queries and keys. Mixtral (Llama's attention) and Qwen3-MoE
(Qwen3's) replace every layer's MLP with softmax-routed top-k SwiGLU experts, megatron's MoE layer. A config
feature this mapping would not reproduce exactly (sliding windows, other RoPE scalings, extra biases, dense layers
between MoE ones, router jitter) is an error, never an approximation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen3_moe")
# megatron-core's llama3 RoPE scaling has these constants built in; other values cannot be expressed
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModel(ValueError):
    """The HF model uses a feature the Megatron mapping does not reproduce."""


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None
    max_position_embeddings: int
    attention_dropout: float = 0.0
    # mixture of experts (0 experts: a dense MLP): experts per layer, experts per token, each expert's width, and
    # whether the top-k routing weights are renormalised to sum to 1 (Mixtral: always; Qwen3-MoE: norm_topk_prob)
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_renormalize: bool = True

    def transformer_kwargs(self) -> dict[str, Any]:
        """TransformerConfig arguments that make megatron-core compute what the HF model computes."""
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_heads,
            "num_query_groups": self.num_kv_heads,
            "kv_channels": self.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.norm_eps,
            "gated_linear_unit": True,
            "activation_func": F.silu,
            "add_bias_linear": False,
            "add_qkv_bias": self.qkv_bias,
            "qk_layernorm": self.qk_norm,
            "hidden_dropout": 0.0,
            "attention_dropout": self.attention_dropout,
        } | self._moe_kwargs()

    def _moe_kwargs(self) -> dict[str, Any]:
        """Megatron's MoE layer computing the HF block: softmax over the router logits then top-k is
        pre-softmax routing; top-k then a softmax over the k is the same as renormalising the top-k
        probabilities. No load-balancing loss (rlflow's losses do not include HF's either; a recipe adds one
        through megatron.transformer), no token dropping."""
        if not self.num_experts:
            return {}
        return {
            "num_moe_experts": self.num_experts,
            "moe_router_topk": self.moe_top_k,
            "moe_ffn_hidden_size": self.moe_ffn_hidden_size,
            "moe_router_pre_softmax": not self.moe_renormalize,
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": False,
        }

    def gpt_kwargs(self) -> dict[str, Any]:
        """GPTModel arguments besides config, layer spec and pipeline stage."""
        return {
            "vocab_size": self.vocab_size,
            "max_sequence_length": self.max_position_embeddings,
            "position_embedding_type": "rope",
            "rotary_base": self.rope_theta,
            "rope_scaling": self.rope_scaling_factor is not None,
            "rope_scaling_factor": self.rope_scaling_factor or 8.0,
            "share_embeddings_and_output_weights": self.tied_embeddings,
        }


def spec_from_hf(config: Any) -> ModelSpec:
    """The ModelSpec of a transformers config (LlamaConfig, Qwen2Config, Qwen3Config, MixtralConfig,
    Qwen3MoeConfig)."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise UnsupportedModel(f"model_type {family!r}: the Megatron backend maps {', '.join(FAMILIES)}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config.hidden_act!r}: only silu (SwiGLU) is mapped")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModel("mlp_bias: MLP biases are not mapped")
    # Qwen2 always has q/k/v biases; Llama and Qwen3 have them (and an o_proj bias) only with attention_bias
    if family != "qwen2" and getattr(config, "attention_bias", False):
        raise UnsupportedModel("attention_bias: the o_proj bias has no Megatron counterpart in this mapping")
    if getattr(config, "use_sliding_window", False) or (family == "mixtral" and config.sliding_window):
        raise UnsupportedModel("use_sliding_window / sliding_window: sliding-window attention is not mapped")
    moe = _moe(config) if family in MOE_FAMILIES else {}
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    theta, factor = _rope(config)
    return ModelSpec(
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        norm_eps=config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling_factor=factor,
        max_position_embeddings=config.max_position_embeddings,
        attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        **moe,
    )


def _moe(config: Any) -> dict[str, Any]:
    """ModelSpec's MoE fields of a MixtralConfig or Qwen3MoeConfig."""
    if config.model_type == "mixtral":
        if getattr(config, "router_jitter_noise", 0.0):
            raise UnsupportedModel(f"router_jitter_noise {config.router_jitter_noise}: router jitter is not mapped")
        return {"num_experts": config.num_local_experts, "moe_top_k": config.num_experts_per_tok,
                "moe_ffn_hidden_size": config.intermediate_size, "moe_renormalize": True}
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise UnsupportedModel("mlp_only_layers / decoder_sparse_step: dense MLP layers between MoE layers are "
                               "not mapped (every layer must be MoE)")
    return {"num_experts": config.num_experts, "moe_top_k": config.num_experts_per_tok,
            "moe_ffn_hidden_size": config.moe_intermediate_size, "moe_renormalize": bool(config.norm_topk_prob)}


def _rope(config: Any) -> tuple[float, float | None]:
    """(theta, llama3 scaling factor or None), from `rope_parameters` (transformers 5) or `rope_theta` and
    `rope_scaling` (4.x)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    if not params:
        params = {**legacy, "rope_theta": getattr(config, "rope_theta", 10000.0)}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UnsupportedModel(f"RoPE scaling {kind!r}: only default and llama3 are mapped")
    for key, value in LLAMA3_ROPE.items():
        if float(params.get(key, value)) != value:
            raise UnsupportedModel(f"llama3 RoPE {key}={params[key]}: megatron-core fixes it at {value}")
    return theta, float(params["factor"])
