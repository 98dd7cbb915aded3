"""The optimizer's fp32 main weights and Adam moments in Hugging Face space: a checkpoint that resumes on any
TP / PP / DP / EP layout.

Whatever wrapper megatron builds (fp32, mixed precision, distributed, chained for experts), each model parameter
has an fp32 main copy and two Adam moments over the part of the flattened parameter this rank updates: all of it,
or with the distributed optimizer one data-parallel rank's contiguous range (`param_states`). Saving all-reduces
each parameter's ranges over its data-parallel group into the whole local shard, then the parameter's *owner*
(the tensor-parallel group that exports it, `WeightExporter`) rebuilds the HF tensors of each state with the same
rules as the weights (engines/train/megatron/weights.py) and its TP rank 0 writes them, named `<hf name>:<state>`.
Loading is the weight import run on state tensors: every rank rebuilds its TP shard of each state from the HF
tensors and copies in its range. No positions, bucket layouts or parallel sizes are stored, so nothing ties a
checkpoint to the layout that wrote it; megatron's own layout-free path (`sharded_param_state_fs_model_space`)
needs dist_checkpointing, whose metadata is pickled.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from rlflow.engines.store.run_store import RunStore
from rlflow.engines.train.dcp_store import read_stored_tensor, safetensors_header
from rlflow.engines.train.megatron.export import WeightExporter, is_expert
from rlflow.engines.train.megatron.hf_config import ModelSpec
from rlflow.engines.train.megatron.weights import Rule, to_megatron

STATES = ("param", "exp_avg", "exp_avg_sq")  # the fp32 main weight and Adam's two moments
SUFFIX = ".safetensors"


@dataclass
class ParamState:
    """What the optimizer keeps for one model parameter on this rank."""

    flat: slice  # the part of the flattened (local, TP-sharded) parameter this rank updates
    main: torch.Tensor  # the fp32 main copy the inner torch optimizer steps (its state's key)
    optimizer: torch.optim.Optimizer  # that inner optimizer

    def tensor(self, state: str) -> torch.Tensor | None:
        """1-D view of `state` over `flat`; None for a moment before the first step (torch creates them lazily)."""
        t = self.main if state == "param" else self.optimizer.state.get(self.main, {}).get(state)
        return None if t is None else t.view(-1)

    def set_step(self, step: float) -> None:
        """Adam's state at `step`: none before the first step (torch creates it then); otherwise the step count,
        with moments (zero until loaded) created if the optimizer has not stepped in this process."""
        if step == 0:
            self.optimizer.state.pop(self.main, None)
            return
        state = self.optimizer.state.setdefault(self.main, {})
        if "exp_avg" not in state:
            state |= {"exp_avg": torch.zeros_like(self.main), "exp_avg_sq": torch.zeros_like(self.main)}
        state["step"] = torch.tensor(float(step))


def param_states(optimizer: Any) -> dict[torch.nn.Parameter, ParamState]:
    """model parameter -> its ParamState, for every parameter this rank updates a part of."""
    out: dict[torch.nn.Parameter, ParamState] = {}
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None:  # a rank holding no parameters of this chain
            continue
        if hasattr(part, "model_param_gbuf_map"):  # DistributedOptimizer: a data-parallel rank's range of each
            for p in part.model_param_gbuf_map:
                r = part._get_model_param_range_map(p)["param"]
                group, order = part.model_param_group_index_map[p]
                out[p] = ParamState(slice(r.start, r.end), inner.param_groups[group]["params"][order], inner)
        elif hasattr(part, "float16_groups"):  # bf16 weights, each with an fp32 main copy
            for model, main in zip(part.float16_groups, part.fp32_from_float16_groups, strict=True):
                out |= {p: ParamState(slice(0, p.numel()), m, inner) for p, m in zip(model, main, strict=True)}
            for group in part.fp32_from_fp32_groups:
                out |= {p: ParamState(slice(0, p.numel()), p, inner) for p in group}
        else:  # fp32: the optimizer steps the model's own parameters
            for group in inner.param_groups:
                out |= {p: ParamState(slice(0, p.numel()), p, inner) for p in group["params"]}
    return out


def adam_step(states: dict[torch.nn.Parameter, ParamState]) -> float:
    """Adam's step count, the same for every parameter (0 before the first step). Collective (a rank may update
    no parameter at all)."""
    local = max((float(s.optimizer.state.get(s.main, {}).get("step", 0)) for s in states.values()), default=0.0)
    step = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    return float(step)


def _split_over(name: str, distributed: bool) -> Any:
    """The process group whose ranks each update a range of the parameter: the distributed optimizer's
    (expert) data-parallel group; None when every rank updates all of it."""
    if not distributed:
        return None
    return (parallel_state.get_expert_data_parallel_group() if is_expert(name)
            else parallel_state.get_data_parallel_group(with_context_parallel=True))


@torch.no_grad()
def save_optimizer(optimizer: Any, exporter: WeightExporter, folder: Path, rank: int, distributed: bool) -> float:
    """Write this rank's part of the optimizer state in HF space to `folder/optimizer-<rank>.safetensors` (only
    owners' TP rank 0 write). Collective; returns Adam's step count, which the caller stores."""
    states = param_states(optimizer)
    step = adam_step(states)
    kinds = STATES if step > 0 else STATES[:1]
    writer = parallel_state.get_tensor_model_parallel_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for rule, p in _held(exporter.rules, exporter.params):
        state, group = states.get(p), _split_over(rule.megatron, distributed)
        for kind in kinds:
            whole = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if state is not None:
                whole[state.flat] = state.tensor(kind)
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(whole, group=group)  # the ranks' ranges are disjoint: the sum is the whole shard
            if rule.megatron not in exporter.exports:
                continue
            full = exporter.to_hf(rule, whole.view(p.shape))
            if writer:
                out |= {f"{name}:{kind}": t.cpu().contiguous() for name, t in zip(rule.hf, full, strict=True)}
    folder.mkdir(parents=True, exist_ok=True)
    if out:
        save_file(out, str(folder / f"optimizer-{rank}{SUFFIX}"))
    return step


@torch.no_grad()
def load_optimizer(optimizer: Any, rules: list[Rule], params: dict[str, torch.nn.Parameter], spec: ModelSpec,
                   store: RunStore, folder: str, step: float) -> None:
    """Fill this rank's part of the optimizer state from `folder` of `store` (written by save_optimizer on any
    layout): each parameter's TP shard of every state is rebuilt from its HF tensors, as the weights are, and
    this rank's range copied in. `rules` are this rank's (with a tied output layer's copy of the embedding)."""
    where = _index(store, folder)
    states = param_states(optimizer)
    for rule, p in _held(rules, params):
        state = states.get(p)
        if state is None:  # the distributed optimizer gave this rank no range of p
            continue
        tp, rank = _tensor_parallel(rule.megatron)
        state.set_step(step)
        for kind in STATES if step > 0 else STATES[:1]:
            missing = [f"{n}:{kind}" for n in rule.hf if f"{n}:{kind}" not in where]
            if missing:
                raise KeyError(f"optimizer state {store.uri(folder)}: no '{missing[0]}' (saved from another model?)")
            hf = [read_stored_tensor(store, *where[f"{n}:{kind}"]) for n in rule.hf]
            value = to_megatron(rule, hf, spec, tp, rank).reshape(-1)[state.flat]
            target = state.tensor(kind)
            if target.numel() != value.numel():
                raise ValueError(f"optimizer state {store.uri(folder)}: '{rule.megatron}' {kind} has "
                                 f"{value.numel()} elements for this rank's {target.numel()}")
            target.copy_(value.to(target.dtype))


def _held(rules: list[Rule], params: dict[str, torch.nn.Parameter]) -> Iterator[tuple[Rule, torch.nn.Parameter]]:
    """(rule, parameter) for the rules whose parameter this rank holds, in model order."""
    for rule in rules:
        if rule.megatron in params:
            yield rule, params[rule.megatron]


def _tensor_parallel(name: str) -> tuple[int, int]:
    if is_expert(name):
        return (parallel_state.get_expert_tensor_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_rank())
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _index(store: RunStore, folder: str) -> dict[str, tuple[str, int, dict]]:
    """`<hf name>:<state>` -> (file, data start, header entry) over the files of `folder`: headers only."""
    files = [f"{folder}/{f}" for f in store.files(folder) if f.endswith(SUFFIX) and "/" not in f]
    if not files:
        raise FileNotFoundError(f"optimizer state {store.uri(folder)}: no *{SUFFIX} files")
    out = {}
    for file in files:
        start, header = safetensors_header(store, file)
        out |= {name: (file, start, info) for name, info in header.items() if name != "__metadata__"}
    return out
