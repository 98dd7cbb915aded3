"""Expert routing of mixture-of-experts layers, recorded and replayed (routing replay, R2/R3).

A MoE router picks each token's top-k experts from its logits. The rollout engine and the trainer compute those
logits with different kernels and batch shapes, so near-ties break differently: a token routed to other experts
at training time than when it was sampled has a log-probability the sampler never used, the largest source of
train/inference mismatch in MoE RL. Routing replay records which experts were chosen in one forward and forces
the same choice in a later one:

- r3 (rollout routing replay): the rollout engine records every token's experts; the trainer replays them in all
  its forwards over the sample (old log-probs and training).
- r2: the trainer records its own routing in a forward before the update (the old policy's) and replays it in
  the training forwards of the step, so the update sees the routing of the policy it is clipped against.

Only the choice is replayed: the routing weights are the live router's softmax probabilities at the replayed
experts (renormalised where the model renormalises), so the gradient still reaches the router. Rows of -1 mean
"no record" (a sample's last token, padding): those tokens route live.

`select_experts` is the one routing function: the engine (engines/models/decoder.py) and the trainer's HF
modules (through `use_routing_replay`) both call it.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from types import MethodType

import numpy as np
import torch
import torch.nn.functional as F

from rlflow.engines.models import invariant

ROUTING_DTYPE = torch.int16  # expert ids as stored and shipped: 128-256 experts fit, at a quarter of int64's bytes
NO_RECORD = -1


def select_experts(logits: torch.Tensor, top_k: int, normalize: bool, replay: torch.Tensor | None = None,
                   exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) from router logits [T, E], as transformers' Qwen3-MoE and
    Mixtral routers compute them (softmax in fp32, top-k, renormalised if `normalize`). `replay` [T, k] (any
    integer dtype): the experts to use instead of the top-k, row by row; a row of -1 keeps the live choice.
    `exact` (rollout.true_on_policy): the sums through invariant.py's trees, so a row's bits do not depend on T."""
    probs = invariant.softmax(logits) if exact else F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if replay is not None:
        replay = replay.to(device=ids.device, dtype=torch.int64)
        live = (replay < 0).any(-1, keepdim=True)
        ids = torch.where(live, ids, replay)
        weights = probs.gather(-1, ids)
    if normalize:
        weights = weights / (invariant.tree_sum(weights, -1, keepdim=True) if exact else
                             weights.sum(dim=-1, keepdim=True))
    return weights, ids


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of a transformers 5 MoE model (Qwen3-MoE, Mixtral: a `gate` with a weight [E, h] and top_k
    beside its block's `experts`), in layer order: index i is the i-th MoE layer of a recorded routing."""
    return [m.gate for m in model.modules()
            if hasattr(m, "experts") and isinstance(getattr(getattr(m, "gate", None), "weight", None), torch.Tensor)
            and hasattr(m.gate, "top_k")]


def router_normalizes(router: torch.nn.Module) -> bool:
    """Whether the router renormalises its top-k weights (Mixtral always; Qwen3-MoE per norm_topk_prob)."""
    return bool(getattr(router, "norm_topk_prob", True))


def _router_forward(self: torch.nn.Module, hidden_states: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' router contract, (logits, weights, ids), through select_experts: replaying
    `self.replay_ids` if set, appending the choice to `self.recorded` if that is a list."""
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    logits = invariant.linear(hidden_states, self.weight) if self.exact else F.linear(hidden_states, self.weight)
    replay = self.replay_ids
    if replay is not None and replay.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"routing replay: {replay.shape[0]} recorded tokens for a forward over "
                         f"{hidden_states.shape[0]}")
    weights, ids = select_experts(logits, self.top_k, router_normalizes(self), replay, self.exact)
    if self.recorded is not None:
        self.recorded.append(ids.to(ROUTING_DTYPE))
    return logits, weights.to(logits.dtype), ids


def use_routing_replay(model: torch.nn.Module) -> int:
    """Route every MoE layer of a transformers 5 model through select_experts, so routing can be recorded and
    replayed (`recording`, `replaying`); live routing is unchanged. Returns the number of routers."""
    routers = moe_routers(model)
    for r in routers:
        r.replay_ids, r.recorded, r.exact = None, None, False  # exact: invariant.make_invariant sets it
        r.forward = MethodType(_router_forward, r)
    return len(routers)


def routing_shape(model: torch.nn.Module) -> tuple[int, int] | None:
    """(MoE layers, experts per token) of a model, None for a dense one."""
    routers = moe_routers(model)
    return (len(routers), int(routers[0].top_k)) if routers else None


def per_layer(record: torch.Tensor, layers: int, k: int) -> torch.Tensor:
    """Records of tokens [tokens, layers x k] (ROUTED_EXPERTS' trailing layout) as [tokens, layers, k]; records of
    another model's width are refused, naming both."""
    if record.shape[-1] != layers * k:
        raise ValueError(f"routing replay: the batch's records hold {record.shape[-1]} expert ids a token; this "
                         f"model routes {layers} MoE layers x {k} experts = {layers * k}")
    return record.view(-1, layers, k)


def set_replay(model: torch.nn.Module, ids: torch.Tensor | None) -> None:
    """Replay `ids` [T, layers, k] in the model's next forwards (and their recomputation under activation
    checkpointing, in the backward), or route live again (None)."""
    routers = moe_routers(model)
    if ids is not None and ids.shape[1] != len(routers):
        raise ValueError(f"routing replay: the record has {ids.shape[1]} MoE layers, the model {len(routers)}")
    for i, r in enumerate(routers):
        r.replay_ids = None if ids is None else ids[:, i]


@contextmanager
def recording(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the routing of the forwards inside: yields a list that holds, after a forward over T tokens, one
    [T, layers, k] int16 tensor (`stack_recorded`)."""
    routers = moe_routers(model)
    per_layer: list[list[torch.Tensor]] = [[] for _ in routers]
    for r, store in zip(routers, per_layer, strict=True):
        r.recorded = store
    out: list[torch.Tensor] = []
    try:
        yield out
    finally:
        for r in routers:
            r.recorded = None
        if per_layer and per_layer[0]:
            out.extend(torch.stack(calls, dim=1) for calls in zip(*per_layer, strict=True))


def routing_to_text(ids: np.ndarray) -> str:
    """A record [tokens, layers, k] as SGLang's /generate returns it in meta_info.routed_experts: the int32 ids,
    flat, base64."""
    return base64.b64encode(np.ascontiguousarray(ids, dtype=np.int32).tobytes()).decode("ascii")


def routing_from_text(text: str, where: str = "meta_info.routed_experts") -> np.ndarray:
    """SGLang's meta_info.routed_experts back to flat int16 expert ids (the shape, [tokens, layers, k], is the
    model's: `RolloutBatch` reshapes with the layers and k the rollout stage recorded)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: expected base64 of int32 expert ids, got {str(text)[:40]!r}") from exc
    if len(raw) % 4:
        raise ValueError(f"{where}: {len(raw)} bytes is not a whole number of int32 ids")
    ids = np.frombuffer(raw, dtype=np.int32)
    if ids.size and (ids.min() < -1 or ids.max() > np.iinfo(np.int16).max):
        raise ValueError(f"{where}: expert ids outside [-1, {np.iinfo(np.int16).max}]")
    return ids.astype(np.int16)
