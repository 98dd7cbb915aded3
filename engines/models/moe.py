"""Mixture-of-experts weights under the names their checkpoints use.

transformers 5 stacks each MoE block's experts into two parameters per layer (`mlp.experts.gate_up_proj`
[E, 2f, h]: every expert's gate rows, then its up rows; `mlp.experts.down_proj` [E, h, f]), and calls Mixtral's
block `mlp`. Checkpoints on disk, SGLang and the Megatron backend's export name every expert's projections
(`mlp.experts.<j>.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.<j>.w1.weight`). `checkpoint_named`
gives views of the stacked tensors under those names, so a weight update in either naming lands in place.
"""

from __future__ import annotations

import torch

# per model_type: the block's name in checkpoints and its experts' gate, up and down projections
CHECKPOINT_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                    "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def is_moe(model_type: str) -> bool:
    return model_type in CHECKPOINT_NAMES


def checkpoint_named(tensors: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """`tensors` (a transformers 5 model's parameters or state dict, by module name) under checkpoint names:
    stacked experts as per-expert views (no copy), the router under the block's checkpoint name, the rest as it
    is. A model that is not MoE is returned unchanged."""
    if model_type not in CHECKPOINT_NAMES:
        return tensors
    block, gate, up, down = CHECKPOINT_NAMES[model_type]
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        layer, _, rest = name.partition(".mlp.")
        if not rest:
            out[name] = t
        elif rest == "experts.gate_up_proj":
            half = t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"{layer}.{block}.experts.{j}.{gate}.weight"] = t[j, :half]
                out[f"{layer}.{block}.experts.{j}.{up}.weight"] = t[j, half:]
        elif rest == "experts.down_proj":
            out |= {f"{layer}.{block}.experts.{j}.{down}.weight": t[j] for j in range(t.shape[0])}
        else:  # the router, or a dense layer's MLP between MoE ones
            out[f"{layer}.{block}.{rest}"] = t
    return out


def moe_layers(config) -> list[int]:
    """The decoder layers of an HF config that are MoE blocks (Qwen3-MoE may keep some dense: mlp_only_layers,
    decoder_sparse_step); [] for a dense model."""
    if config.model_type == "mixtral":
        return list(range(config.num_hidden_layers))
    if config.model_type == "qwen3_moe" and config.num_experts > 0:
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or [])
        return [i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]
    return []


def routing_width(config) -> int | None:
    """Ids a token's routing record holds: MoE layers x experts per token (None for a dense model)."""
    layers = moe_layers(config)
    return len(layers) * config.num_experts_per_tok if layers else None
