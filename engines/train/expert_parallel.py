"""Expert parallelism for the native trainer (`train.expert_parallel`): each rank holds 1/EP of every MoE layer's
experts and computes them for the tokens of every rank, which an all-to-all brings to it and takes back.

The layout follows torchtitan's expert-parallel design (our own code): the stacked expert weights (transformers 5:
gate_up_proj [E, 2f, h], down_proj [E, h, f]) become DTensors sharded on dim 0 over the ranks' mesh, left out of
FSDP2 (which shards the rest of the model as before). A DTensor keeps the global shape, so weight sync gathers
the full tensors, and a checkpoint (torch.distributed.checkpoint) resumes on another EP size or world size.

A MoE layer's forward on one rank (`ep_experts_forward`):
1. its (token, slot) pairs sorted by expert (route_order), hence by the rank that holds the expert;
2. the per-expert counts exchanged (all-to-all, read on the host: they size the next exchange);
3. the rows sent to their experts' ranks (all-to-all with autograd), regrouped by local expert, computed with the
   grouped matmuls of engines/models/grouped_experts.py, and sent back the same way;
4. each token's k rows summed with its routing weights, as experts_forward does.
The gradient of every expert shard is the sum over all ranks' tokens (the all-to-all's backward brings them), the
same sum FSDP2's reduce-scatter gives the other weights. EP is 1 or every rank of the trainer (train.num_workers):
expert groups smaller than the world, whose shards would also need a reduction across groups, are not supported.
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from rlflow.engines.models.grouped_experts import grouped_mm, route_order

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The stacked-experts modules of a transformers 5 MoE model, in order."""
    return [m for m in model.modules() if all(isinstance(getattr(m, n, None), torch.Tensor) and getattr(m, n).dim() == 3
                                              for n in EXPERT_WEIGHTS) and hasattr(m, "act_fn")]


def check_expert_parallel(model: torch.nn.Module, ep: int, world_size: int, model_path: str) -> None:
    """A named error for an EP size this model and trainer cannot take."""
    if ep == 1:
        return
    experts = experts_modules(model)
    if not experts:
        raise ValueError(f"train.expert_parallel {ep}: the model at {model_path} has no experts (a dense model)")
    count = experts[0].gate_up_proj.shape[0]
    if count % ep:
        raise ValueError(f"train.expert_parallel {ep} does not divide the model's {count} experts ({model_path})")
    if ep != world_size:
        raise ValueError(f"train.expert_parallel {ep}: must be 1 or the trainer's ranks (train.num_workers, "
                         f"{world_size} here); expert groups smaller than the world are not supported")


def shard_experts(model: torch.nn.Module, mesh: DeviceMesh) -> set[torch.nn.Parameter]:
    """Split every experts module's weights over `mesh` (dim 0: rank r holds experts r*E/EP ..), route its forward
    through the all-to-all, and return the new parameters (FSDP2 leaves them alone: `ignored_params`)."""
    group = mesh.get_group()
    params: set[torch.nn.Parameter] = set()
    for module in experts_modules(model):
        for name in EXPERT_WEIGHTS:
            full = getattr(module, name)
            shard = torch.nn.Parameter(distribute_tensor(full.detach(), mesh, [Shard(0)]),
                                       requires_grad=full.requires_grad)
            setattr(module, name, shard)
            params.add(shard)
        module.ep_group = group
        module.forward = MethodType(_ep_forward, module)
    return params


def _ep_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
    gate_up, down = self.gate_up_proj, self.down_proj
    return ep_experts_forward(hidden_states, top_k_index, top_k_weights, gate_up.to_local(), down.to_local(),
                              gate_up.shape[0], self.ep_group, self.act_fn)


def ep_experts_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       gate_up_local: torch.Tensor, down_local: torch.Tensor, num_experts: int,
                       group: dist.ProcessGroup, act=F.silu) -> torch.Tensor:
    """experts_forward (engines/models/grouped_experts.py) with the experts split over `group`: this rank holds
    experts [rank * L, (rank + 1) * L) as gate_up_local [L, 2f, h] and down_local [L, h, f]. Collective: every
    rank of the group calls it for each MoE layer of each forward."""
    ep = dist.get_world_size(group)
    tokens, k = top_k_index.shape
    local = num_experts // ep
    order, offsets = route_order(top_k_index, num_experts)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()  # [E], per expert, grouped by rank
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [ep * L]: from each rank, its rows for my experts
    sent_per_rank = counts.view(ep, local).sum(1).tolist()  # host sync: the exchange's sizes
    recv_per_rank = received.view(ep, local).sum(1).tolist()
    rows = all_to_all_single_autograd(hidden[order // k].contiguous(), recv_per_rank, sent_per_rank, group)
    # rows arrive by source rank, each source's rows by local expert: regroup them by local expert
    expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
        received.to(rows.device))
    by_expert = torch.argsort(expert_of_row, stable=True)
    local_offsets = torch.cumsum(received.view(ep, local).sum(0), 0).to(torch.int32).to(rows.device)
    x = rows[by_expert]
    gate, up = grouped_mm(x, gate_up_local.to(x.dtype).transpose(1, 2), local_offsets).chunk(2, dim=-1)
    y = grouped_mm(act(gate) * up, down_local.to(x.dtype).transpose(1, 2), local_offsets)
    y = torch.empty_like(y).index_copy_(0, by_expert, y)  # back to the order they arrived in
    back = all_to_all_single_autograd(y, sent_per_rank, recv_per_rank, group)  # my rows, sorted by expert
    in_order = torch.empty_like(back).index_copy_(0, order, back).view(tokens, k, back.shape[-1])
    return torch.bmm(top_k_weights.to(back.dtype).unsqueeze(1), in_order).squeeze(1).to(hidden.dtype)

