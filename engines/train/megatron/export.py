"""Megatron shards -> full HF-named tensors: on global rank 0 for weight sync (`gather`), or written by the ranks
that hold them into a sharded HF checkpoint (`save_hf`).

Each tensor is exported by one tensor-parallel group, its *owner*: of the groups holding it, the one in the first
data-parallel replica (for experts, the first expert-data-parallel replica; other replicas hold the same weights).
The owner all-gathers the parameter's TP shards and its TP rank 0 rebuilds the HF tensors. Pipeline stages and
expert-parallel ranks each own their layers and experts. For `gather` an owner other than rank 0 sends them to
global rank 0, and names are asked for in buckets, so at most one bucket of full tensors exists at a time; for
`save_hf` each owner writes its own files, so no rank ever holds more than one file's tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from rlflow.engines.train.megatron.hf_config import ModelSpec
from rlflow.engines.train.megatron.weights import Rule, hf_shapes, model_rules, to_hf


def is_expert(name: str) -> bool:
    """A routed expert's parameter (megatron name): split by expert parallelism, replicated over expert-data-parallel
    ranks."""
    return ".mlp.experts." in name


class WeightExporter:
    def __init__(self, spec: ModelSpec, params: dict[str, torch.nn.Parameter], fused_norms: bool):
        self.spec, self.params = spec, params
        self.rules = model_rules(spec, fused_norms)  # tied output weights are exported as the embedding
        self.rule_of = {name: r for r in self.rules for name in r.hf}
        self.shapes = hf_shapes(spec)
        first = next(iter(params.values()))
        self.dtype, self.device = first.dtype, first.device
        dense = parallel_state.get_data_parallel_rank() == 0
        experts = parallel_state.get_expert_data_parallel_rank() == 0
        # the rules this rank's TP group exports: held here, in the first (expert) data-parallel replica
        self.exports = {r.megatron for r in self.rules if r.megatron in params
                        and (experts if is_expert(r.megatron) else dense)}
        self.group_rank = parallel_state.get_tensor_model_parallel_src_rank()  # global rank of this group's TP 0
        self.owner = self._owners()

    def _owners(self) -> dict[str, int]:
        """The global rank of the TP rank 0 that exports each rule (one all-gather over every rank)."""
        first = parallel_state.get_tensor_model_parallel_rank() == 0
        mine = torch.tensor([first and r.megatron in self.exports for r in self.rules], dtype=torch.int8,
                            device=self.device)
        ranks = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(ranks, mine)
        held = torch.stack(ranks).cpu()
        missing = [r.megatron for i, r in enumerate(self.rules) if not held[:, i].any()]
        if missing:
            raise RuntimeError(f"no rank exports {missing[:3]}: the layout does not cover the model")
        return {r.megatron: int(held[:, i].nonzero()[0]) for i, r in enumerate(self.rules)}

    def names(self) -> list[str]:
        return list(self.shapes)

    def layout(self) -> list[tuple[str, int]]:
        """(HF name, bytes) of every exported tensor, known on every rank without communication."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return [(n, size * torch.Size(s).numel()) for n, s in self.shapes.items()]

    @torch.no_grad()
    def gather(self, names: list[str], dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
               ) -> list[tuple[str, torch.Tensor]]:
        """Full HF tensors of `names` (in `dtype` if given) on `device` at global rank 0 (in the order asked); []
        elsewhere. Collective."""
        unknown = [n for n in names if n not in self.rule_of]
        if unknown:
            raise KeyError(f"not exported by this model: {unknown[:5]}")
        rules = list({self.rule_of[n].megatron: self.rule_of[n] for n in names}.values())
        me = dist.get_rank()
        got: dict[str, torch.Tensor] = {}
        for rule in rules:
            owner = self.owner[rule.megatron]
            if rule.megatron in self.exports:
                tensors = self.to_hf(rule, self.params[rule.megatron].detach())
                if me == owner == 0:
                    got.update(zip(rule.hf, tensors, strict=True))
                elif me == owner:
                    for t in tensors:
                        dist.send(t.contiguous(), dst=0)
            elif me == 0:
                for name in rule.hf:
                    buf = torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)
                    dist.recv(buf, src=owner)
                    got[name] = buf
        if me != 0:
            return []
        return [(n, got[n].to(device, dtype)) for n in names]

    def file_plan(self, max_file_bytes: int) -> list[tuple[int, list[Rule]]]:
        """The files of a sharded HF export: (owner, rules) each, an owner's rules in model order, at most
        `max_file_bytes` a file (a larger tensor alone). The same on every rank, with no communication."""
        nbytes_of = dict(self.layout())
        plan: list[tuple[int, list[Rule]]] = []
        for owner in sorted(set(self.owner.values())):
            rules, nbytes = [], 0
            for rule in (r for r in self.rules if self.owner[r.megatron] == owner):
                more = sum(nbytes_of[n] for n in rule.hf)
                if rules and nbytes + more > max_file_bytes:
                    plan.append((owner, rules))
                    rules, nbytes = [], 0
                rules.append(rule)
                nbytes += more
            if rules:
                plan.append((owner, rules))
        return plan

    @torch.no_grad()
    def save_hf(self, folder: str | Path, max_file_bytes: int = 4 << 30) -> list[str]:
        """Write the model as a Hugging Face safetensors checkpoint into `folder` (shared by the ranks) without
        gathering it anywhere: each owner's TP rank 0 rebuilds and writes the tensors it owns, one file of at most
        `max_file_bytes` at a time; global rank 0 writes the index that names each tensor's file (transformers'
        layout: `model.safetensors` when one file holds all). Collective; returns the files' names."""
        plan = self.file_plan(max_file_bytes)
        files = ["model.safetensors"] if len(plan) == 1 else [
            f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
        folder = Path(folder)
        writer = parallel_state.get_tensor_model_parallel_rank() == 0
        for (owner, rules), name in zip(plan, files, strict=True):
            if owner != self.group_rank:  # another group's file
                continue
            tensors = {}
            for rule in rules:  # every tensor-parallel rank joins each all-gather; rank 0 keeps the result
                full = self.to_hf(rule, self.params[rule.megatron].detach())
                if writer:
                    tensors.update((n, t.cpu().contiguous()) for n, t in zip(rule.hf, full, strict=True))
            if writer:
                folder.mkdir(parents=True, exist_ok=True)
                save_file(tensors, str(folder / name), metadata={"format": "pt"})
            del tensors
        if dist.get_rank() == 0 and len(files) > 1:
            weight_map = {n: f for (_, rules), f in zip(plan, files, strict=True) for r in rules for n in r.hf}
            total = sum(nbytes for n, nbytes in self.layout() if n in weight_map)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        return files

    def to_hf(self, rule: Rule, local: torch.Tensor) -> list[torch.Tensor]:
        """The HF tensors of `rule` from this rank's TP shard `local` of its parameter (or of a tensor laid out like
        it: an optimizer state). Every rank of the tensor-parallel group (experts: megatron's expert
        tensor-parallel group, the same ranks here) calls it: the shards are all-gathered."""
        group = (parallel_state.get_expert_tensor_parallel_group() if is_expert(rule.megatron)
                 else parallel_state.get_tensor_model_parallel_group())
        tp = dist.get_world_size(group) if group is not None else 1
        if tp == 1 or rule.kind == "replicated":
            return to_hf(rule, [local], self.spec)
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local.contiguous(), group=group)
        return to_hf(rule, shards, self.spec)
