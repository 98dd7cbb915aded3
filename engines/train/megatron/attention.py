"""Fused core attention for megatron-core's local layer spec (no Transformer Engine).

Why: the local spec's DotProductAttention materialises the [batch, heads, s, s] score matrix and runs softmax
as separate kernels; at 4,096 tokens that is most of a step (8% MFU on an H100). This module takes its place in
the layer spec (`layer_spec(...)` below) and runs torch's fused SDPA (flash / memory-efficient kernels) with a
causal mask, or, for packed micro-batches (megatron's THD layout, `PackedSeqParams`), the variable-length
attention the native trainer uses (`causal_varlen_attention`), so no sample attends to another.

It keeps DotProductAttention's constructor and call signature, so megatron builds and calls it unchanged. What
the local spec's module supports and this one does not (attention dropout, sliding windows, softmax offsets,
context parallelism) is refused at construction, naming the TransformerConfig field.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from rlflow.engines.models.packed import causal_varlen_attention
from rlflow.engines.train.megatron.grouped_experts import GroupedSequentialMLP


class SDPAttention(MegatronModule):
    """softmax(q k^T * scale + causal) v for one layer's TP shard of heads, through fused kernels.

    Inputs as megatron's core attention gets them: padded [s, b, heads, d] (keys/values with the query groups'
    heads), or packed [t, heads, d] with `packed_seq_params` (qkv_format "thd"). Returns [s, b, heads * d] or
    [t, heads * d].
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, **_unused: Any):
        super().__init__(config=config)
        unsupported = {
            "attention_dropout": (config.attention_dropout if attention_dropout is None else attention_dropout) != 0,
            "context_parallel_size": config.context_parallel_size != 1,
            "window_size": getattr(config, "window_size", None) is not None,
            "softmax_type": getattr(config, "softmax_type", "vanilla") != "vanilla",
            "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"megatron.transformer: {', '.join(bad)} need(s) Transformer Engine or the unfused "
                             "local attention; the fused SDPA attention (megatron.attention: sdpa) supports "
                             "causal attention without dropout only")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPAttention is causal only, not {attn_mask_type}")
        tp = pg_collection.tp.size() if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: PackedSeqParams | None = None,
                **_unused: Any) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        if packed_seq_params is not None:  # [t, heads, d]: one stream of samples split by cu_seqlens
            cu = packed_seq_params.cu_seqlens_q
            out = causal_varlen_attention(query, key, value, cu, int(packed_seq_params.max_seqlen_q), self.scale)
            return out.reshape(out.shape[0], -1)
        # [s, b, h, d] -> [b, h, s, d]; right padding sits after each row's tokens, so causal alone is exact
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def local_layer_spec(qk_norm: bool, attention: str, num_experts: int = 0) -> ModuleSpec:
    """The local (no Transformer Engine) layer spec, with the fused SDPA core attention unless `attention` is
    "unfused" (megatron's own DotProductAttention: the reference the fused one is tested against). With experts,
    the MLP is megatron's MoE layer with one module per expert, computed as two grouped matmuls
    (GroupedSequentialMLP: megatron's own grouped GEMM needs Transformer Engine or the grouped_gemm package)."""
    spec = get_gpt_layer_local_spec(num_experts=num_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=qk_norm, normalization="RMSNorm")
    if num_experts:
        spec.submodules.mlp.submodules.experts.module = GroupedSequentialMLP
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    elif attention != "unfused":
        raise ValueError(f"megatron.attention must be 'sdpa' or 'unfused', not {attention!r}")
    return spec
