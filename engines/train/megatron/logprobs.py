"""Per-token logprobs and entropy from vocab-parallel logits: each TP rank holds V/tp columns of the vocabulary.

Logprobs come from megatron's vocab_parallel_cross_entropy (= -log p(target)); the entropy reduces its three
partial sums over the TP group. At TP=1 both equal rlflow.engines.core.algorithms.token_logprobs / entropy_from_logits
(tested); losses are computed from them by rlflow.engines.core.algorithms, like every backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from rlflow.engines.core.sampling import scaled_logits


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [..] of softmax over the vocabulary split across TP ranks (logits [.., V/tp], float32).

    H = log S - sum(e * z) / S with z = logits - max, e = exp(z), S = sum(e). The sums are reduced with
    megatron's reduce_from_tensor_model_parallel_region, whose backward passes gradients through unchanged,
    which is right because every rank computes the same loss from the reduced values.
    """
    top = logits.detach().max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    z = logits - top
    e = z.exp()
    total = tensor_parallel.reduce_from_tensor_model_parallel_region(e.sum(-1))
    e_z = e * z if torch.is_grad_enabled() else e.mul_(z)  # a metric needs no graph: reuse e's memory
    weighted = tensor_parallel.reduce_from_tensor_model_parallel_region(e_z.sum(-1))
    return total.log() - weighted / total


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, entropy: str = "none"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [B, L] aligned with input_ids (column t: log p(x_t | x_<t), column 0 is 0), and optionally the
    entropy of each next-token distribution, aligned the same way.

    logits are [B, L, V/tp] from the model, overwritten here. entropy: "none", "metric" (no gradient) or "loss"
    (with gradient).
    """
    # float32 logits of the distribution the rollout sampled from (dividing by a temperature of 1 would only copy)
    z = logits.float() if temperature in (0.0, 1.0) else scaled_logits(logits, temperature)
    ent = None
    if entropy != "none":
        with torch.set_grad_enabled(entropy == "loss" and torch.is_grad_enabled()):
            ent = _shift(vocab_parallel_entropy(z))
    # vocab_parallel_cross_entropy overwrites its input: the logits are consumed here (no backward needs them: the
    # output layer's saves its input and weight, the entropy's graph exp(z - max) and z - max)
    target = torch.roll(input_ids, shifts=-1, dims=1)  # position t predicts x_{t+1}; the last one is dropped
    logp = -tensor_parallel.vocab_parallel_cross_entropy(z, target)
    return _shift(logp), ent


def _shift(per_position: torch.Tensor) -> torch.Tensor:
    """[B, L] values of 'predict the next token' moved one column right, so column t belongs to token t."""
    out = torch.zeros_like(per_position)
    out[:, 1:] = per_position[:, :-1]
    return out
