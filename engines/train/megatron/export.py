"""Megatron shards -> full HF-named tensors on global rank 0: what weight sync sends and checkpoints store.

Every rank of the first data-parallel replica takes part (other replicas hold the same weights and return at
once): a tensor-parallel group all-gathers each parameter's shards and rank 0 of that group rebuilds the HF
tensors; a later pipeline stage sends them to the first stage's rank 0. Names are asked for in buckets, so at
most one bucket of full tensors exists at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

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
    def gather(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """Full HF tensors of `names` on CPU at global rank 0 (in the order asked); [] elsewhere. Collective."""
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
        return [(n, got[n].cpu()) for n in names]

    def _tp_shards(self, rule: Rule) -> list[torch.Tensor]:
        local = self.params[rule.megatron].detach()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp == 1 or rule.kind == "replicated":
            return [local]
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        return shards
