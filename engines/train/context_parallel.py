"""Context parallelism for the native trainer (`train.context_parallel`): one long sample's tokens over a CP group.

The trainer's ranks form one device mesh with named dims ("dp", "cp"), dp outer (torchtitan's layout): ranks
dp * CP .. dp * CP + CP - 1 are one CP group, and take the same data shard (`data_parallel_rank` is rank // CP).
FSDP2 shards parameters over the whole world, which is dp x cp flattened (torchtitan's dp_shard_cp): a CP rank's
parameter gradient holds its token slice's part, and FSDP2's sum over every rank adds the slices of a group and
the groups of the world, so the update is CP=1's.

What runs per micro-batch (engines/models/ulysses.py, engines/models/packed.py): the planner groups each dp
shard's samples by CP x train.micro_batch_tokens, every rank of a CP group packs the same micro-batch, runs its
1/CP slice of the stream through the model with Ulysses all-to-alls around attention, and gathers the per-token
log-probs, so every rank of the group computes the same loss; normalisation sums and metrics are reduced over
"dp" only (each CP group counts its tokens once).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def check_context_parallel(model: torch.nn.Module, cp: int, world_size: int, model_path: str,
                           clashes: dict[str, bool] | None = None) -> None:
    """A named error for a CP size this model and trainer cannot take; `clashes`: settings (by recipe name) that
    are on and not supported with it."""
    if cp == 1:
        return
    on = [name for name, is_on in (clashes or {}).items() if is_on]
    if on:
        raise ValueError(f"train.context_parallel {cp} with {', '.join(on)}: not supported together")
    heads = model.config.num_attention_heads
    if heads % cp:
        raise ValueError(f"train.context_parallel {cp} must divide the model's {heads} attention heads "
                         f"({model_path}): Ulysses splits the heads over the CP group")
    if any(t != "full_attention" for t in getattr(model.config, "layer_types", None) or ()):
        raise ValueError(f"train.context_parallel {cp}: the model at {model_path} has layers other than full "
                         "attention (sliding windows, linear attention), which the packed attention does not split")
    if world_size % cp:
        raise ValueError(f"train.context_parallel {cp} must divide the trainer's ranks (train.num_workers, "
                         f"{world_size} here)")


def context_mesh(device: str, world_size: int, cp: int) -> DeviceMesh:
    """The trainer's ranks as a ("dp", "cp") mesh. Collective (every rank builds its groups)."""
    return init_device_mesh(device, (world_size // cp, cp), mesh_dim_names=("dp", "cp"))


def check_lengths(lengths: list[int], cp: int, micro_batch_tokens: int) -> None:
    """With CP, a micro-batch's budget is CP x train.micro_batch_tokens (each rank runs 1/CP of it): a sample
    longer than that would not fit one CP group's activations, which CP=1 would run alone in a micro-batch of its
    own anyway. Named, before any forward."""
    budget = cp * micro_batch_tokens
    if micro_batch_tokens and lengths and max(lengths) > budget:
        raise ValueError(f"a sample of {max(lengths)} tokens is longer than train.context_parallel x "
                         f"train.micro_batch_tokens = {cp} x {micro_batch_tokens} = {budget}: raise either")

