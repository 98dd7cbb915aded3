"""Ulysses context parallelism for packed micro-batches: a micro-batch's token stream split over a CP group.

Why Ulysses (all-to-all over heads) and not ring attention (torch's `context_parallel`): our attention is one
variable-length call over a packed stream of many samples (engines/models/packed.py). Ulysses keeps that call as it
is: around it, an all-to-all turns each rank's [tokens/cp, heads, dim] into [tokens, heads/cp, dim], so every rank
attends over the whole stream for its share of the heads, with the samples' own cu_seqlens, on flash varlen (CUDA)
or the exact SDPA fallback (CPU), and a second all-to-all turns the output back. torch's ring attention wraps SDPA
over one padded sequence with a causal mask, which knows nothing of packed samples, and its CPU/gloo path is not
what it targets. The cost: heads must split over the group (see `exchange_heads` for grouped-query attention).

Each rank runs every other module (embeddings, norms, MLPs, the chunked LM head) on its own contiguous slice of
the stream; positions stay each sample's own (PackedRows.position_ids, sliced). The stream is padded at its end to
a multiple of cp with a dummy sample whose outputs are dropped. Per-token results (log-probs, entropy, values) are
gathered over the group; the gather's backward hands each rank its own slice of the gradient, which is exact
because every rank of the group computes the same loss from the same gathered tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd


@dataclass
class ContextSplit:
    """This rank's part of a packed micro-batch split over a CP group: the `rank`-th of `size` equal, contiguous
    slices of the stream padded to a multiple of `size`."""

    group: dist.ProcessGroup
    size: int
    rank: int
    tokens: int  # the stream's real tokens (the padded stream has a multiple of `size`)

    @property
    def local_tokens(self) -> int:
        return -(-self.tokens // self.size)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice (dim 0) of a tensor over the padded stream."""
        n = self.local_tokens
        return x[self.rank * n:(self.rank + 1) * n]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of a per-token result, in order: the padded stream's [T_pad, ...]; its backward
        keeps this rank's slice of the gradient (every rank's loss is the same function of the gathered values)."""
        return _GatherSlices.apply(x, self)


class _GatherSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, split: ContextSplit) -> torch.Tensor:
        ctx.split = split
        x = x.contiguous()
        out = x.new_empty((split.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=split.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.split.local(grad), None


def split_stream(input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                 group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, ContextSplit]:
    """A packed stream padded to a multiple of the group's size: the padding is one more sample at the end
    (token 0, positions from 0), so no real token attends to it. Returns the padded (input_ids, position_ids,
    cu_seqlens, max_len) and the split."""
    size, tokens = dist.get_world_size(group), input_ids.shape[0]
    pad = -(-tokens // size) * size - tokens
    split = ContextSplit(group, size, dist.get_rank(group), tokens)
    if not pad:
        return input_ids, position_ids, cu_seqlens, max_len, split
    ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
    pos = torch.cat([position_ids, torch.arange(pad, dtype=position_ids.dtype, device=position_ids.device)])
    cu = torch.cat([cu_seqlens, cu_seqlens[-1:] + pad])
    return ids, pos, cu, max(max_len, pad), split


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How many times each key/value head is repeated so the heads split over cp ranks: 1 when cp divides them,
    else up to lcm(kv_heads, cp) heads (each rank then holds the kv heads its query heads read)."""
    return 1 if kv_heads % cp == 0 else cp // math.gcd(kv_heads, cp)


@torch.compiler.disable  # under train.compile: a graph break around the collectives, the layer's math stays compiled
def exchange_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: ContextSplit
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T/cp, H, D], k/v [T/cp, KV, D] on each rank -> q [T, H/cp, D], k/v [T, KV'/cp, D]: the whole stream,
    this rank's heads. Grouped-query attention: with KV divisible by cp the kv heads split as they are (rank r's
    query heads read exactly rank r's kv heads); otherwise each kv head is repeated (`kv_repeats`) first, which
    keeps the query-to-kv-head mapping and sends the repeats over the wire (H must divide by cp either way)."""
    r = kv_repeats(k.shape[1], split.size)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    return tuple(_heads_to_tokens(x, split) for x in (q, k, v))


@torch.compiler.disable
def exchange_tokens(out: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """The attention output [T, H/cp, D] back to this rank's tokens with every head: [T/cp, H, D]."""
    cp = split.size
    recv = all_to_all_single_autograd(out.contiguous(), None, None, split.group)  # [cp * T/cp, H/cp, D] by rank
    n, h, d = recv.shape[0] // cp, recv.shape[1], recv.shape[2]
    return recv.view(cp, n, h, d).transpose(0, 1).reshape(n, cp * h, d)


def _heads_to_tokens(x: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    n, h, d = x.shape
    cp = split.size
    blocks = x.reshape(n, cp, h // cp, d).transpose(0, 1).reshape(cp * n, h // cp, d)  # block j: rank j's heads
    return all_to_all_single_autograd(blocks, None, None, split.group)  # block j: rank j's tokens, my heads

