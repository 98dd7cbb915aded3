"""Hugging Face <-> Megatron weight mapping, with tensor-parallel split and gather.

One `Rule` ties a Megatron parameter to the HF tensors it is made of, and says how it is fused and split:
- qkv: q, k and v projections fused per query group, [q of group 0, k0, v0, q of group 1, ...], so a TP rank's
  slice of the fused rows is exactly its query groups (Qwen2's q/k/v biases fuse the same way);
- fc1: the SwiGLU gate and up projections as cat(gate, up) *per TP rank*: rank r holds cat(gate_r, up_r);
- column / row: split along output rows (dim 0: vocab, ColumnParallelLinear) or input columns (dim 1,
  RowParallelLinear);
- replicated: norms, identical on every TP rank.
Layer indices here are global; a pipeline stage renames them to its local ones. MoE experts map one by one, under
their checkpoint names (engines/models/moe.py). Plain torch: no megatron import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlflow.engines.models.moe import CHECKPOINT_NAMES
from rlflow.engines.train.megatron.hf_config import ModelSpec

KINDS = ("replicated", "column", "row", "qkv", "fc1")


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    kind: str


def layer_rules(spec: ModelSpec, i: int, fused_norms: bool = False) -> list[Rule]:
    """Rules of decoder layer i. fused_norms: Transformer Engine's layer spec keeps the pre-attention and pre-MLP
    norms inside linear_qkv / linear_fc1 (as layer_norm_weight); the local spec has them as separate modules."""
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn = h + "self_attn."
    qkv = tuple(attn + f"{p}_proj" for p in "qkv")
    rules = [
        Rule(m + ("self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"),
             (h + "input_layernorm.weight",), "replicated"),
        Rule(m + "self_attention.linear_qkv.weight", tuple(n + ".weight" for n in qkv), "qkv"),
    ]
    if spec.qkv_bias:
        rules.append(Rule(m + "self_attention.linear_qkv.bias", tuple(n + ".bias" for n in qkv), "qkv"))
    if spec.qk_norm:
        rules.append(Rule(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"))
        rules.append(Rule(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"))
    rules.append(Rule(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"))
    if spec.num_experts:  # the MoE layer never fuses its norm into a linear
        rules.append(Rule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated"))
        return rules + moe_rules(spec, i)
    return rules + [
        Rule(m + ("mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"),
             (h + "post_attention_layernorm.weight",), "replicated"),
        Rule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "fc1"),
        Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
    ]


def moe_rules(spec: ModelSpec, i: int) -> list[Rule]:
    """The router (replicated: megatron's router is not tensor-parallel) and each expert's SwiGLU, split over TP
    like a dense MLP (megatron's expert tensor parallelism, which equals TP here). Expert indices are global."""
    m, (block, gate, up, down) = f"decoder.layers.{i}.mlp.", CHECKPOINT_NAMES[spec.family]
    h = f"model.layers.{i}.{block}."
    rules = [Rule(m + "router.weight", (h + "gate.weight",), "replicated")]
    for j in range(spec.num_experts):
        e, he = m + f"experts.local_experts.{j}.", h + f"experts.{j}."
        rules += [Rule(e + "linear_fc1.weight", (he + gate + ".weight", he + up + ".weight"), "fc1"),
                  Rule(e + "linear_fc2.weight", (he + down + ".weight",), "row")]
    return rules


def model_rules(spec: ModelSpec, fused_norms: bool = False) -> list[Rule]:
    """Every rule of the model, in HF order. With tied embeddings there is no lm_head: the output layer is the
    embedding."""
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column")]
    for i in range(spec.num_layers):
        rules += layer_rules(spec, i, fused_norms)
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not spec.tied_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "column"))
    return rules


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every HF tensor the mapping exports, in HF order."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for name, rows in (("q", spec.num_heads * d), ("k", spec.num_kv_heads * d), ("v", spec.num_kv_heads * d)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, h)
            if spec.qkv_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, spec.num_heads * d)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if spec.num_experts:
            block, gate, up, down = CHECKPOINT_NAMES[spec.family]
            shapes[p + f"{block}.gate.weight"] = (spec.num_experts, h)
            fe = spec.moe_ffn_hidden_size
            for j in range(spec.num_experts):
                e = p + f"{block}.experts.{j}."
                shapes |= {e + f"{gate}.weight": (fe, h), e + f"{up}.weight": (fe, h), e + f"{down}.weight": (h, fe)}
            continue
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    if not spec.tied_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """Every split dimension must divide by the TP size (vocab padding is not implemented)."""
    sizes = {"num_key_value_heads": spec.num_kv_heads, "num_attention_heads": spec.num_heads,
             "vocab_size": spec.vocab_size}
    if spec.num_experts:
        sizes["moe_intermediate_size"] = spec.moe_ffn_hidden_size
    else:
        sizes["intermediate_size"] = spec.ffn_hidden_size
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise ValueError(f"tensor_parallel={tp} does not divide {', '.join(bad)}")


def check_moe_tensor_parallel(spec: ModelSpec, tp: int, transformer_engine: bool | None,
                              sequence_parallel: bool) -> None:
    """megatron's MoE layer trains at TP > 1 only with sequence parallelism, which the local spec's norms do not
    have: MoE at TP > 1 needs Transformer Engine (`transformer_engine` None: not known yet, checked at build)."""
    if not spec.num_experts or tp == 1 or (sequence_parallel and transformer_engine is not False):
        return
    raise ValueError(f"tensor_parallel={tp} with an MoE model ({spec.num_experts} experts): megatron's MoE layer "
                     "trains at TP > 1 only with sequence parallelism (megatron.transformer.sequence_parallel: true), "
                     "which needs Transformer Engine (megatron.transformer_engine: true); without it use "
                     "tensor_parallel 1 and megatron.expert_parallel for the experts")


# ----------------------------------------------------------------------------- HF -> Megatron


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[q, k, v] rows regrouped per query group: the layout of Megatron's linear_qkv (weight or bias)."""
    g, rest = spec.num_kv_heads, q.shape[1:]
    parts = [t.reshape(g, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv, on the full (TP-gathered) tensor."""
    g, d, rest = spec.num_kv_heads, spec.head_dim, fused.shape[1:]
    per_q = spec.num_heads // g * d
    q, k, v = fused.reshape(g, per_q + 2 * d, *rest).split([per_q, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))  # type: ignore[return-value]


def to_megatron(rule: Rule, tensors: Sequence[torch.Tensor], spec: ModelSpec, tp: int = 1,
                rank: int = 0) -> torch.Tensor:
    """The Megatron tensor of `rule` on TP rank `rank` of `tp`, from its HF tensors (in rule.hf order)."""
    if rule.kind == "replicated":
        return tensors[0].clone()
    if rule.kind == "column":
        return tensors[0].chunk(tp, dim=0)[rank].clone()
    if rule.kind == "row":
        return tensors[0].chunk(tp, dim=1)[rank].contiguous()
    if rule.kind == "qkv":
        return fuse_qkv(*tensors, spec).chunk(tp, dim=0)[rank].clone()
    if rule.kind == "fc1":
        gate, up = (t.chunk(tp, dim=0)[rank] for t in tensors)
        return torch.cat([gate, up], dim=0)
    raise ValueError(f"unknown rule kind {rule.kind!r}")


# ----------------------------------------------------------------------------- Megatron -> HF


def to_hf(rule: Rule, shards: Sequence[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
    """The HF tensors of `rule` (in rule.hf order) from its Megatron shards, one per TP rank in rank order."""
    if rule.kind == "replicated":
        return [shards[0].clone()]
    if rule.kind == "column":
        return [torch.cat(list(shards), dim=0)]
    if rule.kind == "row":
        return [torch.cat(list(shards), dim=1)]
    if rule.kind == "qkv":
        return list(split_qkv(torch.cat(list(shards), dim=0), spec))
    if rule.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def hf_to_megatron_state(hf: dict[str, torch.Tensor], spec: ModelSpec, tp: int = 1, rank: int = 0,
                         fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """A whole HF state dict as one TP rank's Megatron state dict (global layer names)."""
    return {r.megatron: to_megatron(r, [hf[n] for n in r.hf], spec, tp, rank) for r in model_rules(spec, fused_norms)}


def megatron_to_hf_state(shards: Sequence[dict[str, torch.Tensor]], spec: ModelSpec,
                         fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """Per-TP-rank Megatron state dicts (global layer names) gathered back into one HF state dict."""
    out: dict[str, torch.Tensor] = {}
    for r in model_rules(spec, fused_norms):
        out.update(zip(r.hf, to_hf(r, [s[r.megatron] for s in shards], spec), strict=True))
    return out
