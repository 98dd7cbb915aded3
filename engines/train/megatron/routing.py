"""Routing replay on megatron-core's MoE routers (docs/algorithms.md, `algorithm.routing_replay`).

megatron-core gives each router a `RouterReplay` when `moe_enable_routing_replay` is set: it records the top-k
indices of the last forward, or replays given ones (gathering the router's scores at them, so the weights stay
live and the router keeps its gradient). Two things are ours: the record's layout, and rows without a record.

- Layout: a batch carries ROUTED_EXPERTS [rows, width, layers x k] (engines/core/batch.py). A router sees the
  micro-batch's tokens in megatron's order, [sequence, batch] flattened: the packed stream (THD, one row) in order,
  then its sequence-parallel pad; padded rows position by position, the rows of one position together.
- Rows of -1 (a sample's last token, padding, a record shorter than its sample) route live: megatron's replay
  would gather at -1, so each replay here takes the live top-k first and keeps it on those rows.

Only one micro-batch is in flight at a time (pipeline_parallel 1, checked by the config): a micro-batch's target
stays set through its backward, where activation recomputation runs the forward again.
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from rlflow.engines.core.batch import ROUTED_EXPERTS
from rlflow.engines.models.routing import ROUTING_DTYPE, per_layer
from rlflow.engines.train.megatron.microbatch import Micro


def _replay_topk(self: RouterReplay, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                 default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's RouterReplay.get_replay_topk, with a row of -1 in the target routed live."""
    if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD and self.target_topk_idx is not None:
        _, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target_topk_idx.to(device=scores.device, dtype=live.dtype)
        if target.shape != live.shape:
            raise ValueError(f"routing replay: a record of {target.shape[0]} tokens for a forward over "
                             f"{live.shape[0]}")
        ids = torch.where((target < 0).any(-1, keepdim=True), live, target)
        return scores.gather(1, ids), ids
    return RouterReplay.get_replay_topk(self, scores, topk, num_groups, group_topk, default_compute_topk)


class MegatronRouting:
    """The routers of one model (this pipeline stage's MoE layers, in order) and what they replay or record."""

    def __init__(self, model: torch.nn.Module, top_k: int):
        self.replays = [m.router_replay for m in model.modules()
                        if getattr(m, "router_replay", None) is not None]
        if not self.replays:
            raise ValueError("routing replay: the megatron model has no MoE routers (moe_enable_routing_replay)")
        for r in self.replays:
            r.get_replay_topk = MethodType(_replay_topk, r)
        self.top_k = top_k

    @property
    def width(self) -> int:
        return len(self.replays) * self.top_k

    def before_forward(self, micro: Micro, pad: int, record: bool = False) -> None:
        """Set the routers for the micro-batch's forward: record their choice, replay its ROUTED_EXPERTS, or route
        live (no record, or a filler micro-batch)."""
        for r in self.replays:
            r.clear_indices()
        if record:
            self._action(RouterReplayAction.RECORD)
            return
        ids = micro.batch.get(ROUTED_EXPERTS)
        if ids is None or not micro.rows:
            self._action(None)
            return
        tokens = per_layer(to_megatron_order(micro, ids, pad), len(self.replays), self.top_k)
        for n, r in enumerate(self.replays):
            r.set_target_indices(tokens[:, n])
        self._action(RouterReplayAction.REPLAY_FORWARD)

    def recorded(self, micro: Micro) -> torch.Tensor:
        """The last forward's choice (RECORD), as the micro-batch's rows [rows, width, layers x k] int16."""
        ids = torch.stack([r.get_recorded_indices() for r in self.replays], dim=1)
        return from_megatron_order(micro, ids.reshape(ids.shape[0], -1).to(ROUTING_DTYPE))

    def _action(self, action: RouterReplayAction | None) -> None:
        for r in self.replays:
            if action is None:
                r.clear_router_replay_action()
            else:
                r.set_router_replay_action(action)


def to_megatron_order(micro: Micro, record: torch.Tensor, pad: int) -> torch.Tensor:
    """A micro-batch's records [rows, width, W] in the order its routers see the tokens: [tokens, W]."""
    if micro.packed is not None:
        p = micro.packed
        ids = record[p.rows.to(record.device), p.cols.to(record.device)]
        return F.pad(ids, (0, 0, 0, pad), value=-1)
    width = micro.batch["input_ids"].shape[1]
    return record[:, :width].transpose(0, 1).reshape(-1, record.shape[-1])


def from_megatron_order(micro: Micro, ids: torch.Tensor) -> torch.Tensor:
    """`to_megatron_order`'s inverse: [tokens, W] back into the micro-batch's rows [rows, width, W]."""
    rows, width = micro.batch["input_ids"].shape
    if micro.packed is not None:
        return micro.packed.unpack(ids[:len(micro.packed.input_ids)])
    return ids.view(width, rows, -1).transpose(0, 1)
