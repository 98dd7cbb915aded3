"""Megatron model weights as layout-free shards: each rank writes the global slices it owns, any layout reads them.

Megatron-core's `sharded_state_dict()` names, for every local tensor, its global key, global shape and global offset
(tensor-parallel splits, pipeline stages' layer offsets) and which replica it is. save_shards writes the main
replica of each (so nothing is written twice and no rank gathers the model) into one safetensors file per rank,
laid out like the native trainer's sharded checkpoints (engines/train/dcp_store.py): global offsets as JSON in the
file's metadata. One difference: a tensor is named `<key>@<offsets>`, because megatron gives every layer's copy of
a weight one key (the layer index is a global axis), so a file holds several chunks of a key, which DCP's HF
format (one chunk per name and file) cannot; hence DCP's reader is not reused. load_shards reads, for each local
tensor of the running layout, the overlapping parts of every saved chunk and assembles its slice. No pickle:
megatron's dist_checkpointing `torch_dist` backend writes DCP's pickled `.metadata`, so it is not used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY, SUFFIX


def _local_tensors(model: torch.nn.Module) -> list[ShardedTensor]:
    """This rank's ShardedTensors of the model; refuses the kinds this format does not hold."""
    state = model.sharded_state_dict()
    apply_factories(state)  # e.g. the fused gate/up projection as two tensors: views of the local parameter
    out = []
    for item in nested_values(state):
        if not isinstance(item, ShardedTensor):
            continue  # ShardedObjects (extra state of fused layers) are rebuilt from the config, not saved
        if item.flattened_range is not None:
            raise ValueError(f"sharded tensor {item.key}: flattened ranges are not supported in model shards")
        out.append(item)
    return out


def _full_view(item: ShardedTensor) -> torch.Tensor:
    """The local data with the prepended axes (pipeline layer index) as size-1 dimensions: global rank."""
    data = item.data
    for _ in range(item.prepend_axis_num):
        data = data.unsqueeze(0)
    return data


def save_shards(model: torch.nn.Module, folder: str | Path, rank: int) -> int:
    """Write this rank's main-replica slices to `folder/shard-<rank>.safetensors`; returns tensors written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    offsets: dict[str, dict[str, list[int]]] = {}
    for item in _local_tensors(model):
        if not is_main_replica(item.replica_id):
            continue
        # one key has a chunk per layer (the layer index is a prepended global axis): the name holds the offset
        name = f"{item.key}@{','.join(map(str, item.global_offset))}"
        tensors[name] = _full_view(item).detach().cpu().contiguous()
        offsets[name] = {
            "key": item.key,
            SAVED_OFFSETS_KEY: list(item.global_offset),
            "global_shape": list(item.global_shape),
        }
    save_file(tensors, str(folder / f"shard-{rank}{SUFFIX}"), metadata={CUSTOM_METADATA_KEY: json.dumps(offsets)})
    return len(tensors)


def _chunks(folder: Path) -> dict[str, list[tuple[Path, str, list[int], list[int], list[int]]]]:
    """key -> [(file, tensor name, global offset, chunk shape, global shape)] over every shard file."""
    files = sorted(folder.glob(f"*{SUFFIX}"))
    if not files:
        raise FileNotFoundError(f"model shards {folder}: no *{SUFFIX} files")
    out: dict[str, list[Any]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            if CUSTOM_METADATA_KEY not in meta:
                raise ValueError(f"model shards {file}: no '{CUSTOM_METADATA_KEY}' offsets in its metadata")
            offsets = json.loads(meta[CUSTOM_METADATA_KEY])
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shape = list(f.get_slice(name).get_shape())
                info = offsets[name]
                chunk = (file, name, info[SAVED_OFFSETS_KEY], shape, info["global_shape"])
                out.setdefault(info["key"], []).append(chunk)
    return out


@torch.no_grad()
def load_shards(model: torch.nn.Module, folder: str | Path) -> None:
    """Fill every local tensor of `model` (any TP/PP/DP layout) from the overlapping saved chunks. Each element
    must be covered: a key or region missing from the checkpoint is an error naming it."""
    folder = Path(folder)
    chunks = _chunks(folder)
    for item in _local_tensors(model):
        if item.key not in chunks:
            raise KeyError(f"model shards {folder}: no tensor '{item.key}' (saved from another model?)")
        target = _full_view(item)
        lo, hi = list(item.global_offset), [o + s for o, s in zip(item.global_offset, target.shape, strict=True)]
        covered = 0
        for file, name, off, shape, global_shape in chunks[item.key]:
            if list(global_shape) != list(item.global_shape):
                raise ValueError(
                    f"model shards {file}: '{item.key}' has global shape {global_shape}, this run "
                    f"{list(item.global_shape)}"
                )
            a = [max(x, o) for x, o in zip(lo, off, strict=True)]
            b = [min(y, o + s) for y, o, s in zip(hi, off, shape, strict=True)]
            if any(x >= y for x, y in zip(a, b, strict=True)):
                continue
            with safe_open(str(file), framework="pt") as f:
                part = f.get_slice(name)[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, off, strict=True))]
            target[tuple(slice(x - t, y - t) for x, y, t in zip(a, b, lo, strict=True))].copy_(part)
            covered += part.numel()
        if covered != target.numel():
            raise ValueError(
                f"model shards {folder}: '{item.key}' covers {covered} of this rank's {target.numel()} elements"
            )
