"""Sampling a token per row of logits in one pass over the vocabulary, as a Triton kernel (the embedded engine on
CUDA).

The torch path (`ContinuousBatchEngine._sample`) draws by inverse CDF: log-softmax, exp and a float64 cumulative
sum over the whole vocabulary, about 0.8 ms a step at batch 256 x 151,936 on an H100 (docs/benchmarks.md), more
than a fused decode step's attention. Here each row streams its logits once and keeps three running values: the
log-sum-exp (for the sampled token's log-probability), and the best score of an exponential race, z_i - log(E_i)
with E_i = -log(u_i) (the Gumbel-max trick: the winner is distributed exactly as softmax(z)). The uniforms u_i come
from Philox keyed by the row's seed and the token id, and the seed is drawn from the request's own generator for
each token, so a request's tokens depend on its seed alone, never on its batch-mates (as on the torch path; the two
paths draw from the same distribution but not the same tokens for a seed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _race_kernel(LOGITS, TEMPERATURE, SEEDS, TOKENS, LOGPROBS, stride, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(TEMPERATURE + row)
    inv_t = tl.where(t > 0, 1.0 / t, 1.0)  # greedy rows report the T=1 distribution, as scaled_logits does
    seed = tl.load(SEEDS + row)
    cols = tl.arange(0, BLOCK)
    top = -float("inf")
    total = 0.0
    best = -float("inf")
    best_z = 0.0
    best_i = 0
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        ok = idx < vocab
        z = tl.load(LOGITS + row * stride + idx, mask=ok, other=-float("inf")).to(tl.float32) * inv_t
        top_new = tl.maximum(top, tl.max(z, 0))
        total = total * tl.exp(top - top_new) + tl.sum(tl.where(ok, tl.exp(z - top_new), 0.0), 0)
        top = top_new
        u = tl.rand(seed, idx)
        score = tl.where(t > 0, z - tl.log(-tl.log(u)), z)
        score = tl.where(ok, score, -float("inf"))
        block_best = tl.max(score, 0)
        block_i = tl.argmax(score, 0)
        block_z = tl.sum(tl.where(cols == block_i, z, 0.0), 0)
        better = block_best > best
        best = tl.where(better, block_best, best)
        best_z = tl.where(better, block_z, best_z)
        best_i = tl.where(better, start + block_i, best_i)
    tl.store(TOKENS + row, best_i.to(tl.int64))
    tl.store(LOGPROBS + row, best_z - top - tl.log(total))


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [B, V] (any float dtype) and its log-probability under the temperature-scaled
    distribution. temperature [B] (0: greedy), seeds int64 [B] (one per row and token). Returns (tokens int64 [B],
    logprobs float32 [B])."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _race_kernel[(rows,)](logits, temperature.float().contiguous(), seeds.contiguous(), tokens, logprobs,
                          logits.stride(0), vocab, BLOCK=4096, num_warps=8)
    return tokens, logprobs
