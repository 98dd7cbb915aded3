"""Per-token logprobs and entropy from vocab-parallel logits: each TP rank holds V/tp columns of the vocabulary.

Logprobs come from megatron's vocab_parallel_cross_entropy (= -log p(target)); the entropy reduces its three
partial sums over the TP group. At TP=1 the whole vocabulary is on the rank, and the native trainer's head math
runs instead (fused kernels on CUDA). Both equal rlflow.engines.core.algorithms.token_logprobs /
entropy_from_logits (tested); losses are computed from them by rlflow.engines.core.algorithms, like every backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from torch.utils.checkpoint import checkpoint

from rlflow.engines.core.sampling import scaled_logits
from rlflow.engines.models.packed import ChunkedLogitsLogprobs


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
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, entropy: str = "none", chunk_tokens: int = 4096,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [B, L] aligned with input_ids (column t: log p(x_t | x_<t), column 0 is 0), and optionally the
    entropy of each next-token distribution, aligned the same way.

    logits are [B, L, V/tp] from the model. entropy: "none", "metric" (no gradient) or "loss" (with gradient).
    The fp32 work runs `chunk_tokens` positions at a time, and with a gradient each chunk is recomputed in the
    backward pass: the fp32 logits and softmax of the whole micro-batch never exist at once (at 16,384 tokens
    of Qwen2's vocabulary they were 2 x 10 GB beside the bf16 logits), only one chunk's. With the whole
    vocabulary on this rank (tensor parallel 1) the native trainer's head math does it instead
    (engines/models/head_math.py through ChunkedLogitsLogprobs; `fused`: its compiled kernels, train.fused_head).
    """
    target = torch.roll(input_ids, shifts=-1, dims=1)  # position t predicts x_{t+1}; the last one is dropped
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return _whole_vocabulary(logits, target, temperature, entropy, chunk_tokens, fused)
    width = logits.shape[1]
    step = max(1, chunk_tokens // max(1, logits.shape[0]))  # positions per chunk: chunk_tokens over the rows
    recompute = torch.is_grad_enabled() and logits.requires_grad
    logps, ents = [], []
    for a in range(0, width, step):
        chunk, chunk_target = logits[:, a:a + step], target[:, a:a + step]
        if not recompute:
            logp, ent = _chunk_logprobs(chunk, chunk_target, temperature, entropy)
        elif entropy == "metric":  # a metric needs no graph: computed once here, not again in the recompute
            logp, _ = checkpoint(_chunk_logprobs, chunk, chunk_target, temperature, "none", use_reentrant=False)
            with torch.no_grad():
                ent = vocab_parallel_entropy(_fp32(chunk, temperature))
        else:
            logp, ent = checkpoint(_chunk_logprobs, chunk, chunk_target, temperature, entropy, use_reentrant=False)
        logps.append(logp)
        ents.append(ent)
    logp = _shift(torch.cat(logps, dim=1))
    return logp, None if entropy == "none" else _shift(torch.cat(ents, dim=1))


def _whole_vocabulary(logits: torch.Tensor, target: torch.Tensor, temperature: float, entropy: str, chunk_tokens: int,
                      fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs when this rank holds every vocabulary column: one pass over the [B * L, V] logits in
    chunks of `chunk_tokens` tokens, the entropy only when asked and with a gradient only for "loss"."""
    rows, width, vocab = logits.shape
    logp, ent = ChunkedLogitsLogprobs.apply(logits.reshape(rows * width, vocab), target.reshape(-1, 1),
                                            temperature, chunk_tokens, entropy != "none", fused)
    logp = _shift(logp.view(rows, width))
    if entropy == "none":
        return logp, None
    return logp, _shift((ent if entropy == "loss" else ent.detach()).view(rows, width))


def _chunk_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float, entropy: str
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-cross-entropy of the targets and (if asked) entropy, unshifted, for one chunk of positions."""
    z = _fp32(logits, temperature)
    ent = None
    if entropy != "none":
        with torch.set_grad_enabled(entropy == "loss" and torch.is_grad_enabled()):
            ent = vocab_parallel_entropy(z)
    # vocab_parallel_cross_entropy overwrites its input z, the chunk's own fp32 copy (the entropy's graph keeps
    # exp(z - max) and z - max, not z)
    return -tensor_parallel.vocab_parallel_cross_entropy(z, target), ent


def _fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits of the distribution the rollout sampled from (dividing by a temperature of 1 would only
    copy); always a copy, since the cross-entropy overwrites it and a checkpointed chunk's input must stay intact."""
    return logits.to(torch.float32, copy=True) if temperature in (0.0, 1.0) else scaled_logits(logits, temperature)


def _shift(per_position: torch.Tensor) -> torch.Tensor:
    """[B, L] values of 'predict the next token' moved one column right, so column t belongs to token t."""
    out = torch.zeros_like(per_position)
    out[:, 1:] = per_position[:, :-1]
    return out
