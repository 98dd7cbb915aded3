"""FSDP2 for the native trainer: how the torch backend's model is sharded, gathered and checkpointed.

Why FSDP2 (`torch.distributed.fsdp.fully_shard`) on every rank count, one included:
- parameters, gradients and optimizer state are sharded over the data-parallel ranks, so the memory per rank
  falls as ranks are added (a 7B model's fp32 master weights and Adam state no longer sit whole on each GPU);
- its mixed-precision policy keeps the sharded fp32 master weights and makes one bf16 compute copy of a layer
  when the layer is gathered, so the whole forward and backward run in bf16 without autocast, and gradients
  are reduce-scattered in fp32;
- its CPU offload policy (train.cpu_offload) keeps the shards on the host and steps the optimizer there;
- one code path serves one rank and many (the reduce-scatter replaces a hand-written all-reduce).

Each decoder layer is one FSDP unit and the PackedLM root holds the rest (embeddings, final norm, head), the
layout torchtitan uses; a vision-language model's vision blocks are units of their own, and its vision tower's
remaining modules (patch embedding, merger) one more. Gradients are summed, not averaged, over ranks: the losses
are already normalised by the global token or sequence count of the mini-batch (engines/train/torch_backend.py).

Checkpoints go through torch.distributed.checkpoint with its Hugging Face storage: every rank writes its own
shards as safetensors (offsets in the file's metadata, no pickle anywhere), the model's shards are
consolidated into a plain HF checkpoint (`model/`, loadable by transformers and the rollout engines), and a
checkpoint loads onto any number of ranks, each reading the slices of its new shards. The same files go either
into a local folder (torch's HF storage) or straight into a run store folder on any fsspec filesystem, S3
included (engines/train/dcp_store.py: every rank uploads its own shards, readers fetch byte ranges). With
checkpoint.async_save a rank copies its state to host memory and a thread writes the same files while the rank
trains on (BackgroundSave; docs/operations.md, "Writing checkpoints in the background").
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _coalescing_manager
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from rlflow.engines.models.packed import PackedLM
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.train.dcp_store import StoreReader, StoreWriter

NamedTensors = list[tuple[str, torch.Tensor]]


def init_process_group(device: str, rank: int, world_size: int, dist_url: str | None,
                       timeout_s: float = 1800) -> None:
    """The default process group FSDP2 shards over: NCCL for CUDA tensors and gloo for CPU ones on GPUs (the
    step's small counters are CPU tensors, and offloaded shards live on the host), gloo on CPUs. One rank needs
    no rendezvous (an in-memory store); workers in one process (cluster.use_ray: false) share that group.
    A collective that waits longer than `timeout_s` for a peer (dead, hung, on a lost node) raises."""
    backend = "cuda:nccl,cpu:gloo" if device == "cuda" else "gloo"
    if dist.is_initialized():
        if dist.get_world_size() != world_size or (device == "cuda") != ("nccl" in dist.get_backend()):
            raise RuntimeError(f"torch.distributed is already up ({dist.get_world_size()} ranks, "
                               f"{dist.get_backend()}), not {world_size} ranks on {device}")
        return
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # Ray shows each actor its one GPU
    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, init_method=dist_url, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))


def shard(lm: PackedLM, param_dtype: torch.dtype | None, cpu_offload: bool = False,
          reshard_after_forward: bool = True, mesh: DeviceMesh | None = None,
          ignored_params: set[torch.nn.Parameter] | None = None) -> PackedLM:
    """Shard `lm` in place: each decoder layer is an FSDP unit, the root takes embeddings, norm and head.

    param_dtype: the dtype the layers compute in (bf16: fp32 shards, bf16 gathered copies); None: the
    parameters' own dtype. Gradients are reduced in fp32. reshard_after_forward False keeps each layer's
    gathered weights from its forward to its backward (FSDP2 keeps the root's anyway). `mesh`: the ranks' mesh
    (default: FSDP2's own over every rank); `ignored_params`: parameters sharded otherwise (expert parallelism's
    expert shards, engines/train/expert_parallel.py), which FSDP2 leaves alone."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=_cap_pinned_rounding()) if cpu_offload else OffloadPolicy()
    # only when given: without expert parallelism the calls are what they were (ignored_params is torch >= 2.7's)
    given = {k: v for k, v in (("mesh", mesh), ("ignored_params", ignored_params)) if v is not None}
    for unit in [*vision_units(lm), *lm.body.layers]:
        fully_shard(unit, mp_policy=policy, offload_policy=offload, reshard_after_forward=reshard_after_forward,
                    **given)
    fully_shard(lm, mp_policy=policy, offload_policy=offload, **given)
    for module in lm.modules():
        if isinstance(module, FSDPModule):  # the setters act on one unit, not its children
            module.set_gradient_divide_factor(1.0)  # a sum: the losses carry the global normalisation
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return lm


def vision_units(lm: PackedLM) -> list[torch.nn.Module]:
    """A vision-language model's vision tower as FSDP units: each block, then the tower itself (its patch embedding
    and merger). Each unit's parameters are all frozen or all trained (train.freeze_vision freezes the whole tower),
    so no unit mixes frozen and trained parameters, and the root keeps the language model's embeddings and head."""
    if lm.visual is None:
        return []
    return [*lm.visual.blocks, lm.visual]


# pinned blocks above this size are allocated at their size, not rounded up to a power of two
PIN_ROUNDING_LIMIT_MB = 32
PIN_ROUNDING_KEY = "pinned_max_round_threshold_mb"


@functools.cache
def _cap_pinned_rounding() -> bool:
    """Cap the rounding of pinned blocks, and say whether offloaded shards may be pinned. torch's host allocator
    rounds every pinned block up to a power of two (a 272 MB MLP shard of a 7B takes 512 MB), which took a 7B's
    offloaded weights and gradients past a 128 GiB host beside its Adam state. Where this torch knows the
    allocator setting that caps it (2.13 does, 2.11 does not), it is added to the process's allocator settings and
    the shards are pinned (fast copies); otherwise they stay in pageable memory (slower copies, exact size).
    Setting the allocator's options re-reads the whole string and resets the ones it lacks, so the current
    settings are kept in it, and put back if this torch refuses the key."""
    if not torch.cuda.is_available():
        return True
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if get is None or put is None:
        return False
    before = get()
    if PIN_ROUNDING_KEY in before:  # the user's own cap (PYTORCH_ALLOC_CONF)
        return True
    try:
        put(",".join(filter(None, [before, f"{PIN_ROUNDING_KEY}:{PIN_ROUNDING_LIMIT_MB}"])))
    except (RuntimeError, ValueError):  # torch 2.11: "Unrecognized key", after resetting the others
        put(before)
        return False
    return True


def reshard(lm: torch.nn.Module) -> None:
    """Free every unit's gathered parameters (an eval forward leaves the root's gathered), so the module's
    registered parameters are the sharded ones."""
    for module in lm.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (the whole parameter on one rank)."""
    return t.to_local() if isinstance(t, DTensor) else t


def gather(params: dict[str, torch.Tensor], names: list[str], keep: bool, dtype: torch.dtype | None = None,
           device: torch.device | str = "cpu") -> NamedTensors:
    """Full copies of these parameters on `device`, gathered one at a time (collective: every rank calls it);
    only a rank with `keep` holds them, so no rank ever holds more than one full tensor it does not keep. With
    `dtype` each shard is cast before the gather, so the wire carries the dtype sent (bf16 for a bf16 rollout
    engine). A GPU sender gathers onto its GPU: a round trip through host memory made a 7B sync take 33 s
    (docs/benchmarks.md)."""
    out = []
    for name in names:
        p = params[name].detach()
        if dtype is not None:
            p = p.to(dtype)
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if keep:
            out.append((name, full.to(device)))
    return out


@torch.no_grad()
def gather_into(pairs: list[tuple[torch.Tensor, torch.Tensor]], group_bytes: int = 1 << 30) -> None:
    """Write each (parameter, out) pair's full parameter into `out`, cast to its dtype (collective: every rank
    passes the same list). FSDP2's layout, dim 0 sharded over one mesh dimension, is all-gathered straight into
    `out` when the ranks divide that dim (each shard cast first, so the wire carries `out`'s dtype); anything else
    is gathered whole and copied. On a GPU the all-gathers go `group_bytes` of output at a time as one NCCL group:
    a 7B model has 339 weights, and one launch each made its 2-rank sync 0.053 s instead of 0.043 s."""
    pending: list[tuple[torch.Tensor, torch.Tensor, dist.ProcessGroup]] = []
    for param, out in pairs:
        p = param.detach()
        if tuple(out.shape) != tuple(p.shape):
            raise ValueError(f"gather_into: a parameter of shape {tuple(p.shape)} into a tensor of {tuple(out.shape)}")
        if isinstance(p, DTensor) and _tiles_dim0(p, out):
            pending.append((out, p.to_local().to(out.dtype).contiguous(), p.device_mesh.get_group()))
            if sum(o.nbytes for o, _, _ in pending) >= group_bytes:
                _all_gather(pending)
            continue
        _all_gather(pending)  # in order: every rank issues the same collectives
        out.copy_(p.to(out.dtype).full_tensor() if isinstance(p, DTensor) else p)
    _all_gather(pending)


def _tiles_dim0(p: DTensor, out: torch.Tensor) -> bool:
    """Whether the shards, one after the other, are `out`: dim 0 sharded evenly over a 1-D mesh, on out's device."""
    mesh = p.device_mesh
    return (mesh.ndim == 1 and p.placements == (Shard(0),) and p.shape[0] % mesh.size() == 0
            and p.to_local().device == out.device and out.is_contiguous())


def _all_gather(pending: list[tuple[torch.Tensor, torch.Tensor, dist.ProcessGroup]]) -> None:
    """Each (out, shard, group) all-gathered, done on return; on a GPU as one NCCL group (gloo, the CPU's, has no
    coalesced all-gather). Empties the list."""
    if pending and pending[0][0].is_cuda:
        with _coalescing_manager(group=pending[0][2], device=pending[0][0].device, async_ops=True) as work:
            for out, shard, g in pending:
                dist.all_gather_into_tensor(out, shard, group=g)
        work.wait()
    else:
        for out, shard, g in pending:
            dist.all_gather_into_tensor(out, shard, group=g)
    pending.clear()


def grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the (sharded) gradients to `max_norm` together; returns the total norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# ---- checkpoints --------------------------------------------------------------------------------------------

# train.lora: only the trainable parameters (the adapters) are saved and loaded; the frozen base comes from the
# run's model. Not strict: the frozen parameters are absent on purpose.
TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)
ADAPTER_SHARDS = "lora"  # the adapters' sharded state in a LoRA checkpoint (model/ holds the merged weights)
LORA_RESUME_HINT = " (train.lora: a LoRA run resumes from a LoRA run's checkpoint)"


def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path,
                    trainable_only: bool = False) -> None:
    """Every rank writes its shards: the model into `path/model` (then consolidated there into an HF
    checkpoint, the shards removed) and the optimizer state into `path/optimizer` (none before the first
    step: an empty state is what a resumed run must start from). Collective. `trainable_only` (LoRA): the
    adapters' shards go to `path/lora` as they are; the caller writes model/."""
    model_dir = path / (ADAPTER_SHARDS if trainable_only else "model")
    if dist.get_rank() == 0:  # a folder saved into before keeps no shards of another rank count
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.rmtree(path / "optimizer", ignore_errors=True)
    dist.barrier()
    model_state, optim_state = _state_to_save(model, optimizer, trainable_only)
    dcp.save(model_state, storage_writer=dcp.HuggingFaceStorageWriter(
        str(model_dir), save_distributed=True, enable_consolidation=not trainable_only))
    if optim_state is not None:
        dcp.save(optim_state, storage_writer=dcp.HuggingFaceStorageWriter(
            str(path / "optimizer"), save_distributed=True))
    if dist.get_rank() == 0 and not trainable_only:
        _save_configs(model, path / "model")
        shutil.rmtree(path / "model" / "sharded", ignore_errors=True)  # consolidated into model/ above
        _single_file_name(path / "model")
    dist.barrier()


def save_checkpoint_to_store(model: torch.nn.Module, optimizer: torch.optim.Optimizer, store: RunStore,
                             trainable_only: bool = False) -> None:
    """save_checkpoint straight into a run store folder (`RunStore.at(storage, checkpoint URI)`, S3 or local):
    every rank puts its own shards there through fsspec, nothing is staged on a local disk but rank 0's HF
    export (the model shards consolidated into `model/`). Collective; the caller commits afterwards."""
    if dist.get_rank() == 0:
        store.remove(ADAPTER_SHARDS if trainable_only else "model")
        store.remove("optimizer")
    dist.barrier()
    model_state, optim_state = _state_to_save(model, optimizer, trainable_only)
    dcp.save(model_state, storage_writer=StoreWriter(store, ADAPTER_SHARDS if trainable_only else "model/sharded"))
    if optim_state is not None:
        dcp.save(optim_state, storage_writer=StoreWriter(store, "optimizer"))
    if dist.get_rank() == 0 and not trainable_only:
        _export_from_store(model, store, list(model_state))
    dist.barrier()


class BackgroundSave:
    """A checkpoint that a thread of this rank writes from a host copy of its state, while the rank trains on
    (checkpoint.async_save). The thread runs DCP's saves over `group`, a gloo group of their own, so their
    collectives never interleave with training's, then `finish` (rank 0's HF export), then leaves a marker beside
    the shards: `written_rank<r>.json` ({"seconds": ...}), or `failed_rank<r>.json` ({"error": ...}). The driver
    commits the checkpoint once every rank's `written` marker is there (tasks/run_context.py); a rank that dies
    leaves none, so the checkpoint is never committed. The host copy (the stager's) is released when the write
    ends: the stager keeps its copies as long as it lives."""

    def __init__(self, writes: list[tuple[dict, StorageWriter]], group: dist.ProcessGroup, stager: DefaultStager,
                 finish: Callable[[], None], put: Callable[[str, dict], None]):
        self.writes, self.group, self.stager, self.finish, self.put = writes, group, stager, finish, put
        self.rank = dist.get_rank()
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="rlflow-checkpoint-write", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for state, writer in self.writes:
                dcp.save(state, storage_writer=writer, process_group=self.group)
            self._release()
            self.finish()
            self.put(f"written_rank{self.rank}.json", {"seconds": time.perf_counter() - self.started})
        except BaseException as exc:  # reported to the driver through the marker, by state() and by wait()
            self.error = exc
            self._release()
            with contextlib.suppress(Exception):  # the driver also asks state() while it waits
                self.put(f"failed_rank{self.rank}.json", {"error": f"{type(exc).__name__}: {exc}"})

    def _release(self) -> None:
        self.writes = []
        self.stager.close()

    def state(self) -> str:
        """'writing', 'written', or 'failed: <error>'."""
        if self.thread.is_alive():
            return "writing"
        return "written" if self.error is None else f"failed: {type(self.error).__name__}: {self.error}"

    def wait(self) -> None:
        """Block until the write ended; raise if it failed."""
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"checkpoint write of rank {self.rank} failed: {self.error}") from self.error


def background_save_group(timeout_s: float) -> dist.ProcessGroup:
    """For checkpoint.async_save: a gloo group of every rank for the writing threads' collectives, whose waits for
    a peer end after `timeout_s` as training's do. Made once, at the first background save. Collective."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def save_checkpoint_in_background(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Path | RunStore,
                                  group: dist.ProcessGroup) -> BackgroundSave:
    """What save_checkpoint (a local folder) or save_checkpoint_to_store (a run store) writes, written by a thread
    from host copies made before this returns (the caller then trains on). Pageable memory, a fresh copy each
    save, freed when it is written: pinned buffers would copy faster but stay allocated between checkpoints, and
    the copy is short beside the write. The folder is a fresh checkpoint folder (the driver's): nothing of an
    earlier save is cleared first. Collective."""
    model_state, optim_state = _state_to_save(model, optimizer)
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=False))
    # blocking copies: when this returns the next optimizer step may change the parameters
    staged = [stager.stage(model_state)] + ([] if optim_state is None else [stager.stage(optim_state)])
    local = isinstance(target, Path)
    writers = [dcp.HuggingFaceStorageWriter(str(target / "model"), save_distributed=True, enable_consolidation=True)
               if local else StoreWriter(target, "model/sharded")]
    if optim_state is not None:
        writers.append(dcp.HuggingFaceStorageWriter(str(target / "optimizer"), save_distributed=True) if local
                       else StoreWriter(target, "optimizer"))
    names = list(model_state)

    def finish() -> None:  # rank 0, after its saves: every rank's shards are written (DCP's finish gathers them)
        if dist.get_rank() != 0:
            return
        if local:
            _save_configs(model, target / "model")
            shutil.rmtree(target / "model" / "sharded", ignore_errors=True)
            _single_file_name(target / "model")
        else:
            _export_from_store(model, target, names)

    def put(name: str, body: dict) -> None:  # whole or not at all: the driver may read it at any moment
        if local:
            part = target / f".{name}.part"
            part.write_text(json.dumps(body))
            part.replace(target / name)
        else:
            target.write_json(body, name)  # one object put

    return BackgroundSave(list(zip(staged, writers, strict=True)), group, stager, finish, put)


def _state_to_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
                   ) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """The model's sharded state dict and the optimizer's as flat tensors (None before the first step), each
    tensor once (`unaliased`)."""
    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINABLE_ONLY if trainable_only else None)
    if fresh:  # get_state_dict stepped the empty optimizer at lr 0 to make its state: undo that
        optimizer.state.clear()
        return unaliased(model_state), None
    return unaliased(model_state), unaliased(_flat_optimizer_state(optim_state))


def unaliased(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the later names of a tensor it holds under several: tied embeddings (Qwen2-0.5B/1.5B,
    Llama-3.2) are one parameter that the state dict lists as both model.embed_tokens.weight and lm_head.weight,
    and safetensors refuses to write two names for the same memory. The first name stays (the embedding's, as
    transformers' save_pretrained keeps it); loading into it fills the other name's tensor too, which is the same."""
    out, seen = {}, set()
    for name, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        # by memory: the state dict detaches each name separately. A rank's empty shard of an FSDP2 parameter is
        # still a view of that parameter's storage; only a tensor with no storage at all is told apart by object
        ptr = local.untyped_storage().data_ptr() if torch.is_tensor(local) else 0
        key = (ptr, local.storage_offset(), tuple(local.shape), local.stride()) if ptr else (id(value),)
        if key not in seen:
            seen.add(key)
            out[name] = value
    return out


def _save_configs(model: torch.nn.Module, folder: Path) -> None:
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def _export_from_store(model: torch.nn.Module, store: RunStore, names: list[str]) -> None:
    """Rank 0: the model's shards in `model/sharded` consolidated by torch's HF consolidation on a local scratch
    folder (it writes by seeking into local files), the result uploaded to `model/`, the shards removed."""
    with tempfile.TemporaryDirectory(prefix="rlflow-export-") as tmp:
        shards, out = Path(tmp) / "sharded", Path(tmp) / "model"
        shards.mkdir()
        out.mkdir()
        for f in store.files("model/sharded"):
            (shards / f).write_bytes(store.read_bytes("model/sharded", f))
        consolidate_safetensors_files(str(shards), str(out), dict.fromkeys(names, 1))
        _save_configs(model, out)
        _single_file_name(out)
        for f in sorted(out.iterdir()):
            store.upload_file(f, "model", f.name)
    store.remove("model/sharded")


def _single_file_name(folder: Path) -> None:
    """One consolidated file takes the name transformers gives an unsplit checkpoint, model.safetensors (its
    index is then redundant), so readers that expect it find it."""
    files = sorted(folder.glob("model-*-of-*.safetensors"))
    if len(files) == 1:
        files[0].rename(folder / "model.safetensors")
        (folder / "model.safetensors.index.json").unlink(missing_ok=True)


def load_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path,
                    trainable_only: bool = False) -> None:
    """Load save_checkpoint's files onto this run's ranks (any number: each reads its shards' slices)."""
    model_dir = path / (ADAPTER_SHARDS if trainable_only else "model")
    if not any(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"checkpoint {path}: no model shards (*.safetensors) in {model_dir}"
                                + (LORA_RESUME_HINT if trainable_only else ""))
    optimizer_saved = any((path / "optimizer").glob("*.safetensors"))
    _load(model, optimizer, dcp.HuggingFaceStorageReader(str(model_dir)),
          dcp.HuggingFaceStorageReader(str(path / "optimizer")) if optimizer_saved else None, trainable_only)


def load_checkpoint_from_store(model: torch.nn.Module, optimizer: torch.optim.Optimizer, store: RunStore,
                               trainable_only: bool = False) -> None:
    """load_checkpoint straight from a run store folder: each rank reads, by byte ranges, only the slices of
    its own shards (any rank count)."""
    model_dir = ADAPTER_SHARDS if trainable_only else "model"
    if not any(f.endswith(".safetensors") and "/" not in f for f in store.files(model_dir)):
        raise FileNotFoundError(f"checkpoint {store.uri()}: no model shards (*.safetensors) in {store.uri(model_dir)}"
                                + (LORA_RESUME_HINT if trainable_only else ""))
    optimizer_saved = any(f.endswith(".safetensors") for f in store.files("optimizer"))
    _load(model, optimizer, StoreReader(store, model_dir),
          StoreReader(store, "optimizer") if optimizer_saved else None, trainable_only)


def _load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_reader: StorageReader,
          optimizer_reader: StorageReader | None, trainable_only: bool = False) -> None:
    """The model's and the optimizer's state from their readers; no optimizer reader: saved before the first
    optimizer step, so the optimizer starts empty."""
    options = TRAINABLE_ONLY if trainable_only else None
    model_state, optim_state = get_state_dict(model, optimizer, options=options)  # templates: this run's shards
    dcp.load(unaliased(model_state), storage_reader=model_reader)  # in place: a tied name's tensor is filled too
    if optimizer_reader is None:
        set_model_state_dict(model, model_state, options=options)
        optimizer.state.clear()
        return
    flat = _flat_optimizer_state(optim_state)
    dcp.load(unaliased(flat), storage_reader=optimizer_reader)
    for fqn, state in optim_state["state"].items():
        for key in state:
            state[key] = flat[f"{fqn}.{key}"]
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options)


def _flat_optimizer_state(optim_state: dict) -> dict[str, torch.Tensor]:
    """Adam's per-parameter tensors as one flat dict, `<param>.<exp_avg|exp_avg_sq|step>`: the form the
    safetensors storage holds (hyper-parameters come from the recipe, the schedule from trainer state)."""
    return {f"{fqn}.{key}": value for fqn, state in optim_state["state"].items() for key, value in state.items()}
