"""Megatron model weights as layout-free shards: each rank writes the global slices it owns, any layout reads them.

Megatron-core's `sharded_state_dict()` names, for every local tensor, its global key, global shape and global offset
(tensor-parallel splits, pipeline stages' layer offsets) and which replica it is. save_shards writes the main
replica of each (so nothing is written twice and no rank gathers the model) into one safetensors file per rank,
laid out like the native trainer's sharded checkpoints (engines/train/dcp_store.py): global offsets as JSON in the
file's metadata. One difference: a tensor is named `<key>@<offsets>`, because megatron gives every layer's copy of
a weight one key (the layer index is a global axis), so a file holds several chunks of a key, which DCP's HF
format (one chunk per name and file) cannot; hence DCP's reader is not reused. load_shards reads, for each local
tensor of the running layout, the overlapping parts of every saved chunk (by ranged reads, from a local folder or
object storage alike) and assembles its slice. No pickle:
megatron's dist_checkpointing `torch_dist` backend writes DCP's pickled `.metadata`, so it is not used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
from safetensors.torch import save_file
from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY, SUFFIX

from rlflow.engines.store.run_store import RunStore
from rlflow.engines.train.dcp_store import read_stored_tensor, safetensors_header


class Chunk(NamedTuple):
    """One saved slice of a key: its file (in the store), tensor name, global offset and shape, the key's global
    shape."""

    file: str
    name: str
    offset: list[int]
    shape: list[int]
    global_shape: list[int]


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


def _chunks(store: RunStore, folder: str) -> tuple[dict[str, list[Chunk]], dict[str, tuple[int, dict]]]:
    """key -> every saved chunk of it over the shard files of `folder` in `store`, and each file's header; only
    the files' headers are read (two ranged reads a file)."""
    files = [f"{folder}/{f}" for f in store.files(folder) if f.endswith(SUFFIX) and "/" not in f]
    if not files:
        raise FileNotFoundError(f"model shards {store.uri(folder)}: no *{SUFFIX} files")
    out: dict[str, list[Chunk]] = {}
    headers = {}
    for file in files:
        headers[file] = start, header = safetensors_header(store, file)
        meta = header.get("__metadata__") or {}
        if CUSTOM_METADATA_KEY not in meta:
            raise ValueError(f"model shards {store.uri(file)}: no '{CUSTOM_METADATA_KEY}' offsets in its metadata")
        offsets = json.loads(meta[CUSTOM_METADATA_KEY])
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            info = offsets[name]
            out.setdefault(info["key"], []).append(
                Chunk(file, name, info[SAVED_OFFSETS_KEY], list(entry["shape"]), info["global_shape"]))
    return out, headers


@torch.no_grad()
def load_shards(model: torch.nn.Module, store: RunStore, folder: str) -> None:
    """Fill every local tensor of `model` (any TP/PP/DP layout) from the overlapping chunks saved in `folder` of
    `store` (a local folder or object storage alike): of each chunk that overlaps this rank's slices, one ranged
    read fetches the overlapping rows (first dimension), the others are not read at all. Each element must be
    covered: a key or region missing from the checkpoint is an error naming it."""
    chunks, headers = _chunks(store, folder)
    where = store.uri(folder)
    for item in _local_tensors(model):
        if item.key not in chunks:
            raise KeyError(f"model shards {where}: no tensor '{item.key}' (saved from another model?)")
        target = _full_view(item)
        lo, hi = list(item.global_offset), [o + s for o, s in zip(item.global_offset, target.shape, strict=True)]
        covered = 0
        for chunk in chunks[item.key]:
            if list(chunk.global_shape) != list(item.global_shape):
                raise ValueError(
                    f"model shards {store.uri(chunk.file)}: '{item.key}' has global shape {chunk.global_shape}, "
                    f"this run {list(item.global_shape)}"
                )
            off, shape = chunk.offset, chunk.shape
            a = [max(x, o) for x, o in zip(lo, off, strict=True)]
            b = [min(y, o + s) for y, o, s in zip(hi, off, shape, strict=True)]
            if any(x >= y for x, y in zip(a, b, strict=True)):
                continue
            start, header = headers[chunk.file]
            if shape:  # only the overlapping rows (contiguous in the file); the other dimensions are sliced here
                saved = read_stored_tensor(store, chunk.file, start, header[chunk.name],
                                           (a[0] - off[0], b[0] - off[0]))
                off = [a[0], *off[1:]]  # where `saved` starts
            else:  # a scalar
                saved = read_stored_tensor(store, chunk.file, start, header[chunk.name])
            part = saved[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, off, strict=True))]
            target[tuple(slice(x - t, y - t) for x, y, t in zip(a, b, lo, strict=True))].copy_(part)
            covered += part.numel()
        if covered != target.numel():
            raise ValueError(
                f"model shards {where}: '{item.key}' covers {covered} of this rank's {target.numel()} elements"
            )
