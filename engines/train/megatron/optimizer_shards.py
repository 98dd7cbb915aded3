"""The optimizer's fp32 main weights and Adam moments in Hugging Face space: a checkpoint that resumes on any
TP / PP / DP / EP layout.

Whatever wrapper megatron builds (fp32, mixed precision, distributed, chained for experts), each model parameter
has an fp32 main copy and two Adam moments over the part of the flattened parameter this rank updates: all of it,
or with the distributed optimizer one data-parallel rank's contiguous range (`OptimizerView`). Saving all-reduces
each parameter's ranges over the distributed optimizer's group into the whole local shard, then the parameter's
*owner* (the tensor-parallel group that exports it, `WeightExporter`) rebuilds the HF tensors of each state with
the same rules as the weights (engines/train/megatron/weights.py) and its TP rank 0 writes them, named
`<hf name>:<state>`, in files of at most 4 GiB. Adam's step is one number for the run (torch's Adam keeps it per
parameter, TE's and apex's FusedAdam per group: both are read and restored).
Loading is the weight import run on state tensors: every rank rebuilds its TP shard of each state from the HF
tensors and copies in its range. No positions, bucket layouts or parallel sizes are stored, so nothing ties a
checkpoint to the layout that wrote it; megatron's own layout-free path (`sharded_param_state_fs_model_space`)
needs dist_checkpointing, whose metadata is pickled.
"""

from __future__ import annotations

import re
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
MAX_FILE_BYTES = 4 << 30  # a rank's state goes out in files of at most this size: it is never all in memory


@dataclass
class ParamState:
    """What the optimizer keeps for one model parameter on this rank."""

    flat: slice  # the part of the flattened (local, TP-sharded) parameter this rank updates
    main: torch.Tensor  # the fp32 main copy the inner torch optimizer steps (its state's key)
    optimizer: torch.optim.Optimizer  # that inner optimizer
    group: dict  # main's param group: TE's and apex's FusedAdam count steps there, torch's Adam per parameter

    def tensor(self, state: str) -> torch.Tensor | None:
        """1-D view of `state` over `flat`; None for a moment before the first step (optimizers create them
        lazily)."""
        t = self.main if state == "param" else self.optimizer.state.get(self.main, {}).get(state)
        return None if t is None else t.view(-1)

    def step(self) -> float:
        return float(self.optimizer.state.get(self.main, {}).get("step", self.group.get("step", 0)))

    def set_step(self, step: float) -> None:
        """Adam's state at `step`: none before the first step; otherwise the step count, with moments (zero until
        loaded) created if the optimizer has not stepped in this process."""
        if "step" in self.group:  # FusedAdam: one count for the group
            self.group["step"] = int(step)
        if step == 0:
            self.optimizer.state.pop(self.main, None)
            return
        state = self.optimizer.state.setdefault(self.main, {})
        if "exp_avg" not in state:
            state |= {"exp_avg": torch.zeros_like(self.main), "exp_avg_sq": torch.zeros_like(self.main)}
        if "step" not in self.group:  # torch's fused (or capturable) Adam keeps it on the parameter's device
            on_device = self.group.get("fused") or self.group.get("capturable")
            state["step"] = (torch.tensor(float(step), device=self.main.device) if on_device
                             else torch.tensor(float(step)))


class OptimizerView:
    """megatron's optimizer, whatever it wraps (fp32, mixed precision, distributed, chained for experts), seen per
    model parameter: `states` for the parameters this rank updates a part of, and `split`, for every parameter
    of a distributed optimizer, the data-parallel group whose ranks each update a range of it."""

    def __init__(self, optimizer: Any):
        self.states: dict[torch.nn.Parameter, ParamState] = {}
        self.split: dict[torch.nn.Parameter, Any] = {}
        for part in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = getattr(part, "optimizer", None)
            if inner is None:  # a rank holding no parameters of this chain
                continue
            config = getattr(part, "config", None)
            if getattr(config, "use_precision_aware_optimizer", False) or getattr(config, "optimizer_cpu_offload",
                                                                                   False):
                raise ValueError("megatron.optimizer: use_precision_aware_optimizer / optimizer_cpu_offload keep "
                                 "scaled or host copies of the optimizer state that rlflow's checkpoints do not "
                                 "read; turn them off")
            if hasattr(part, "model_param_gbuf_map"):  # DistributedOptimizer: a data-parallel range of each
                self.split |= {p: part.data_parallel_group for buf in part.buffers for p in buf.params}
                for p in part.model_param_gbuf_map:
                    r = part._get_model_param_range_map(p)["param"]
                    g, order = part.model_param_group_index_map[p]
                    group = inner.param_groups[g]
                    self.states[p] = ParamState(slice(r.start, r.end), group["params"][order], inner, group)
            elif hasattr(part, "float16_groups"):  # bf16 weights, each with an fp32 main copy
                for g, (model, main) in enumerate(zip(part.float16_groups, part.fp32_from_float16_groups,
                                                      strict=True)):
                    self._whole(model, main, inner, inner.param_groups[g])
                    self._whole(part.fp32_from_fp32_groups[g], part.fp32_from_fp32_groups[g], inner,
                                inner.param_groups[g])
            else:  # fp32: the optimizer steps the model's own parameters
                for group in inner.param_groups:
                    self._whole(group["params"], group["params"], inner, group)

    def _whole(self, model: list, main: list, inner: torch.optim.Optimizer, group: dict) -> None:
        self.states |= {p: ParamState(slice(0, p.numel()), m, inner, group) for p, m in zip(model, main, strict=True)}

    def step(self) -> float:
        """Adam's step count, the same for every parameter (0 before the first step). Collective: a rank may
        update no parameter at all."""
        local = max((s.step() for s in self.states.values()), default=0.0)
        step = torch.tensor(local, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        return float(step)


def param_states(optimizer: Any) -> dict[torch.nn.Parameter, ParamState]:
    """model parameter -> its ParamState, for every parameter this rank updates a part of."""
    return OptimizerView(optimizer).states


@torch.no_grad()
def save_optimizer(optimizer: Any, exporter: WeightExporter, folder: Path, rank: int) -> float:
    """Write this rank's part of the optimizer state in HF space to `folder/optimizer-<rank>-<k>.safetensors`
    (only owners' TP rank 0 write). Collective; returns Adam's step count, which the caller stores."""
    view = OptimizerView(optimizer)
    step = view.step()
    kinds = STATES if step > 0 else STATES[:1]
    writer = parallel_state.get_tensor_model_parallel_rank() == 0
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"optimizer-{rank}-*{SUFFIX}"):  # an earlier save's files into the same folder
        old.unlink()
    out: dict[str, torch.Tensor] = {}
    files, nbytes = 0, 0
    for rule, p in _held(exporter.rules, exporter.params):
        state, group = view.states.get(p), view.split.get(p)
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
                nbytes += sum(t.numel() * t.element_size() for t in full)
        if nbytes >= MAX_FILE_BYTES:
            save_file(out, str(folder / f"optimizer-{rank}-{files}{SUFFIX}"))
            out, files, nbytes = {}, files + 1, 0
    if out:
        save_file(out, str(folder / f"optimizer-{rank}-{files}{SUFFIX}"))
    return step


@torch.no_grad()
def load_optimizer(optimizer: Any, rules: list[Rule], params: dict[str, torch.nn.Parameter], spec: ModelSpec,
                   store: RunStore, folder: str, step: float, saved_ranks: int) -> None:
    """Fill this rank's part of the optimizer state from `folder` of `store` (written by save_optimizer on any
    layout, by `saved_ranks` ranks): each parameter's TP shard of every state is rebuilt from its HF tensors, as
    the weights are, and this rank's range copied in. `rules` are this rank's (with a tied output layer's copy
    of the embedding)."""
    where = _index(store, folder, saved_ranks)
    states = OptimizerView(optimizer).states
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


def _index(store: RunStore, folder: str, saved_ranks: int) -> dict[str, tuple[str, int, dict]]:
    """`<hf name>:<state>` -> (file, data start, header entry) over the files the `saved_ranks` ranks of the
    save wrote into `folder` (a larger layout's leftovers are not read): headers only."""
    name = re.compile(rf"^optimizer-(\d+)-\d+{re.escape(SUFFIX)}$")
    files = [f"{folder}/{f}" for f in store.files(folder) if (m := name.match(f)) and int(m.group(1)) < saved_ranks]
    if not files:
        raise FileNotFoundError(f"optimizer state {store.uri(folder)}: no optimizer-<rank>-<k>{SUFFIX} files")
    out = {}
    for file in files:
        start, header = safetensors_header(store, file)
        out |= {name: (file, start, info) for name, info in header.items() if name != "__metadata__"}
    return out
