"""The LM head's math on one chunk of logits: log-probs of target tokens, entropy, and their gradient.

Why a file of its own: this is where an RL train step spends its memory traffic. A chunk of logits is
[tokens, vocab] (4,096 x 151,936 for Qwen2), and the eager ops read and write it a dozen times in fp32 (cast,
temperature, log-softmax, exp, entropy, the gradient's terms, the cast back). Written as two pure functions of
the bf16 logits, torch.compile turns each into one or two generated kernels that read the logits once or twice
and, in the backward, write the gradient once: `compiled(fn)` on CUDA (`train.fused_head`), the same functions
eagerly elsewhere, so the CPU tests check the math the GPU runs.

The formulas are algorithms.token_logprobs / entropy_from_logits' (the rollout engine's), differentiated by
hand: with z the scaled logits, lse = logsumexp(z) and log p = z - lse,
    d log p_t / dz = onehot_t - p,    d H / dz = -p (log p + H).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from rlflow.engines.core.algorithms import entropy_from_logprobs
from rlflow.engines.core.sampling import scaled_logits
from rlflow.engines.models import invariant


def head_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                  exact: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, V] (the head's matmul dtype), targets [n, M] -> (log p of each target [n, M], lse [n], entropy
    [n] or zeros), all fp32. lse is what the backward needs to rebuild p without another reduction. `exact`
    (rollout.true_on_policy): the logsumexp is invariant.logsumexp, whose bits do not depend on n."""
    z = scaled_logits(logits, temperature)
    lse = invariant.logsumexp(z) if exact else torch.logsumexp(z, dim=-1)
    logp = z - lse[:, None]
    entropy = entropy_from_logprobs(logp) if with_entropy else torch.zeros_like(lse)
    return logp.gather(-1, targets), lse, entropy


def head_logits_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                     grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None, temperature: float
                     ) -> torch.Tensor:
    """The gradient with respect to the raw logits [n, V], in their dtype, of sum(grad_logprobs * log p(targets))
    + sum(grad_entropy * H). One target's one-hot term is a comparison with the column index (one pointwise
    kernel once compiled; a scatter would write the fp32 gradient out and read it back); several (top-k
    distillation's) are one scatter, not a pass over [n, V] each."""
    logp = scaled_logits(logits, temperature) - lse[:, None]
    p = logp.exp()
    dz = -p * grad_logprobs.sum(-1, keepdim=True)
    if grad_entropy is not None:  # -p (log p + H) dH, with 0 * -inf read as 0 where p = 0
        finite = torch.where(logp.isfinite(), logp, 0.0)
        dz = dz - p * (finite + entropy[:, None]) * grad_entropy[:, None]
    if targets.shape[1] == 1:
        column = torch.arange(logits.shape[-1], device=logits.device)
        dz = dz + torch.where(column == targets, grad_logprobs, 0.0)
    else:
        dz = dz.scatter_add(-1, targets, grad_logprobs)
    scale = 1.0 / temperature if temperature > 0 else 1.0  # d(scaled logits) / d(logits)
    return (dz * scale).to(logits.dtype)


@cache
def compiled(fn: Callable) -> Callable:
    """`fn` through torch.compile (one wrapper per process; dynamo compiles a graph per kind of call: with or
    without entropy, one target or several, a one-token chunk); dynamic: the chunk's token count changes."""
    return torch.compile(fn, dynamic=True)
