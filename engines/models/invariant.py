"""Batch-invariant ops: the one implementation of each reduction that the rollout engine and the native trainer
both run under `rollout.true_on_policy`, so a token's log-prob is the same bits on both sides (docs/rollout.md,
"True on-policy").

Why each op: a result may depend on how many rows are computed together, not on the row alone. Measured with
torch 2.13 on CPU (fp32, AVX512): `F.linear` gives other bits for a row computed alone (M=1 takes a GEMV), in a
batch of 2-3 and in a batch of 5+ (other GEMM kernels), and `F.silu` computes the last elements of a buffer
(its scalar tail) with another exp than the vectorised body, so a row's SiLU depends on where it lies in the
batch. RMSNorm's mean, softmax, logsumexp, gather and the rotary tables are per row already (the end-to-end
equality in tests/test_true_on_policy.py holds them to it). So:
  - `linear`: every row is its own [1, K] @ [K, N] product (a batched matmul of single rows), whatever the number
    of rows: its reduction over K never depends on the other rows. MKL's product also depends on the weight's
    alignment (4 of 16 float offsets give the same bits), so a weight that is not 64-byte aligned (a view into
    FSDP2's gathered buffer) is copied first.
  - `silu`: x / (1 + exp(-x)), whose exp runs the vectorised path on every element, tail included.
  - `attention_one`: one query against exactly its own prefix of keys, with fixed-shape contiguous operands: the
    engine's decode of a token, its prefill of a prompt, and the trainer's forward of a whole sequence all call it
    per query, so the sum over keys has the same length and order everywhere (no padding, no split over keys).
These cost what per-row work costs (a GEMV per row instead of one GEMM, a call per query): the mode is opt-in.
On a GPU the same contract needs kernels with a fixed reduction order (no split-K, one KV split per query), as
Thinking Machines' batch_invariant_ops and SGLang's deterministic attention provide; this module is the place
they go.
"""

from __future__ import annotations

import torch

ALIGN = 64  # bytes: torch's CPU allocations are aligned so; a weight elsewhere is copied (`linear`)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias), each row computed on its own (its bits do not depend on the other rows). MKL's
    product depends on the weight's alignment too, so a weight inside a flat buffer (FSDP2's gathered parameters)
    is copied to fresh, aligned memory first."""
    rows = x.reshape(-1, x.shape[-1])
    if weight.data_ptr() % ALIGN or not weight.is_contiguous():
        weight = weight.clone(memory_format=torch.contiguous_format)
    out = _RowwiseLinear.apply(rows, weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class _RowwiseLinear(torch.autograd.Function):
    """rows [M, K] @ weight.T, each row its own [1, K] @ [K, N] product (a batched matmul of single rows). The
    backward pass is plain GEMMs: only the forward's bits must match the rollout engine's, and the batched GEMV's
    own gradient would materialise [M, K, N]."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        w = weight.t()
        return torch.bmm(rows[:, None, :], w.expand(rows.shape[0], *w.shape))[:, 0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        rows, weight = ctx.saved_tensors
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
        return grad_rows, grad_weight


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU whose every element takes the same (vectorised) exp, wherever it lies in the tensor."""
    return x / (1 + torch.exp(-x))


def attention_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query's attention over its prefix: q [H, D], k/v [KV, L, D] (the query's own key included, nothing
    after it); returns [H, D]. The heads sharing a KV head are its query rows (grouped-query attention)."""
    kv, length, d = k.shape
    grouped = q.reshape(kv, q.shape[0] // kv, d).contiguous()
    scores = torch.matmul(grouped, k.transpose(1, 2).contiguous()) * scale  # [KV, G, L]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.contiguous()).reshape(q.shape)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int = 0
                     ) -> torch.Tensor:
    """Causal attention of one sequence's queries at positions start..start+n-1: q [H, n, D]; k/v [KV, S, D] hold
    the sequence's keys from position 0 (S >= start + n); returns [H, n, D], query i over keys 0..start+i."""
    return torch.stack([attention_one(q[:, i], k[:, :start + i + 1], v[:, :start + i + 1], scale)
                        for i in range(q.shape[1])], dim=1)


class InvariantLinear(torch.nn.Linear):
    """nn.Linear through `linear`: what `make_invariant` turns a model's projections into (the class changes, the
    parameters and their names stay, so checkpoints and weight syncs see the same model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class InvariantSiLU(torch.nn.Module):
    """The MLP activation as `silu`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)


def make_invariant(model: torch.nn.Module) -> torch.nn.Module:
    """Turn a loaded HF causal LM's projections (attention, MLP, LM head) into InvariantLinear and its MLP
    activations into InvariantSiLU, in place; the trainer's and the engine's forwards then run the same ops.
    Refuses what this module has no batch-invariant form of (an MoE block, another activation)."""
    if getattr(model.config, "hidden_act", "silu") != "silu":
        raise ValueError(f"rollout.true_on_policy: model config hidden_act {model.config.hidden_act!r}; expected silu")
    if any(hasattr(layer.mlp, "experts") for layer in model.model.layers):
        raise ValueError("rollout.true_on_policy: MoE layers have no batch-invariant form yet (dense Llama / Qwen2 / "
                         "Qwen3 models only)")
    for layer in model.model.layers:
        layer.mlp.act_fn = InvariantSiLU()
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = InvariantLinear
    return model


__all__ = ["InvariantLinear", "InvariantSiLU", "attention_one", "causal_attention", "linear", "make_invariant", "silu"]
