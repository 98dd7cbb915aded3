"""Megatron shards -> full HF-named tensors: on global rank 0 for weight sync (`gather`), or written by each
pipeline stage into a sharded HF checkpoint (`save_hf`).

Every rank of the first data-parallel replica takes part (other replicas hold the same weights and return at
once): a tensor-parallel group all-gathers each parameter's shards and rank 0 of that group rebuilds the HF
tensors. For `gather` a later pipeline stage sends them to the first stage's rank 0, and names are asked for in
buckets, so at most one bucket of full tensors exists at a time; for `save_hf` each stage writes its own files,
so no rank ever holds more than one file's tensors.
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


class WeightExporter:
    def __init__(self, spec: ModelSpec, params: dict[str, torch.nn.Parameter], fused_norms: bool):
        self.spec, self.params = spec, params
        self.rules = model_rules(spec, fused_norms)  # tied output weights are exported as the embedding
        self.rule_of = {name: r for r in self.rules for name in r.hf}
        self.shapes = hf_shapes(spec)
        first = next(iter(params.values()))
        self.dtype, self.device = first.dtype, first.device
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.owner = self._owners()

    def _owners(self) -> dict[str, int]:
        """The pipeline stage holding each rule's parameter (stages may hold unequal layer counts)."""
        mine = torch.tensor([r.megatron in self.params for r in self.rules], dtype=torch.int32, device=self.device)
        stages = [torch.zeros_like(mine) for _ in self.pp_ranks]
        dist.all_gather(stages, mine, group=self.pp_group)
        held = torch.stack(stages).cpu()
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
        if parallel_state.get_data_parallel_rank() != 0:
            return []
        unknown = [n for n in names if n not in self.rule_of]
        if unknown:
            raise KeyError(f"not exported by this model: {unknown[:5]}")
        rules = list({self.rule_of[n].megatron: self.rule_of[n] for n in names}.values())
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        got: dict[str, torch.Tensor] = {}
        for rule in rules:
            stage = self.owner[rule.megatron]
            if stage == self.stage:
                tensors = to_hf(rule, self._tp_shards(rule), self.spec)
                if tp_rank == 0 and stage == 0:
                    got.update(zip(rule.hf, tensors, strict=True))
                elif tp_rank == 0:
                    for t in tensors:
                        dist.send(t.contiguous(), dst=self.pp_ranks[0])
            elif self.stage == 0 and tp_rank == 0:
                for name in rule.hf:
                    buf = torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)
                    dist.recv(buf, src=self.pp_ranks[stage])
                    got[name] = buf
        if dist.get_rank() != 0:
            return []
        return [(n, got[n].to(device, dtype)) for n in names]

    def file_plan(self, max_file_bytes: int) -> list[tuple[int, list[Rule]]]:
        """The files of a sharded HF export: (pipeline stage, rules) each, a stage's rules in model order, at most
        `max_file_bytes` a file (a larger tensor alone). The same on every rank, with no communication."""
        nbytes_of = dict(self.layout())
        plan: list[tuple[int, list[Rule]]] = []
        for stage in range(len(self.pp_ranks)):
            rules, nbytes = [], 0
            for rule in (r for r in self.rules if self.owner[r.megatron] == stage):
                more = sum(nbytes_of[n] for n in rule.hf)
                if rules and nbytes + more > max_file_bytes:
                    plan.append((stage, rules))
                    rules, nbytes = [], 0
                rules.append(rule)
                nbytes += more
            if rules:
                plan.append((stage, rules))
        return plan

    @torch.no_grad()
    def save_hf(self, folder: str | Path, max_file_bytes: int = 4 << 30) -> list[str]:
        """Write the model as a Hugging Face safetensors checkpoint into `folder` (shared by the ranks) without
        gathering it anywhere: tensor-parallel rank 0 of each pipeline stage rebuilds and writes its stage's
        tensors, one file of at most `max_file_bytes` at a time; global rank 0 writes the index that names each
        tensor's file (transformers' layout: `model.safetensors` when one file holds all). Collective; returns
        the files' names."""
        plan = self.file_plan(max_file_bytes)
        files = ["model.safetensors"] if len(plan) == 1 else [
            f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
        if parallel_state.get_data_parallel_rank() != 0:
            return files
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        writer = parallel_state.get_tensor_model_parallel_rank() == 0
        for (stage, rules), name in zip(plan, files, strict=True):
            if stage != self.stage:
                continue
            tensors = {}
            for rule in rules:  # every tensor-parallel rank joins each all-gather; rank 0 keeps the result
                full = to_hf(rule, self._tp_shards(rule), self.spec)
                if writer:
                    tensors.update((n, t.cpu().contiguous()) for n, t in zip(rule.hf, full, strict=True))
            if writer:
                save_file(tensors, str(folder / name), metadata={"format": "pt"})
            del tensors
        if dist.get_rank() == 0 and len(files) > 1:
            weight_map = {n: f for (_, rules), f in zip(plan, files, strict=True) for r in rules for n in r.hf}
            total = sum(nbytes for n, nbytes in self.layout() if n in weight_map)
            (folder / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        return files

    def _tp_shards(self, rule: Rule) -> list[torch.Tensor]:
        local = self.params[rule.megatron].detach()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp == 1 or rule.kind == "replicated":
            return [local]
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        return shards
