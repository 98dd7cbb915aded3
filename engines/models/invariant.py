"""Batch-invariant ops: the one implementation of each reduction that the rollout engine and the native trainer
both run under `rollout.true_on_policy`, so a token's log-prob is the same bits on both sides (docs/rollout.md,
"True on-policy").

Why: a result may depend on how many rows are computed together, not on the row alone. A GEMM library picks
another kernel (another order of the sum over K) for another number of rows; a reduction kernel splits its sum
over more threads when it has fewer rows to do (torch's CUDA reduce does for one row, so RMSNorm of a single
decode row rounds differently than in a batch of 64); torch 2.13's CPU `F.silu` computes a buffer's scalar tail
with another exp than its vectorised body. Two rules make every op here independent of its batch:
  - **GEMMs have one shape.** `linear` runs [ROWS, K] @ [K, N] products only, the rows zero-padded to a
    multiple of ROWS, every chunk's operands at aligned addresses: one shape is one kernel, whose sum over K for a row
    does not depend on the other rows of its chunk (checked in tests/test_true_on_policy.py on the CPU; on a GPU,
    cuBLAS picks one algorithm per shape and alignment). MKL's and cuBLAS's products also depend on the weight's
    alignment, so a weight inside a flat buffer (FSDP2's gathered parameters) is copied to aligned memory first.
  - **Every other sum is a fixed tree of elementwise adds** (`tree_sum`: halves added, the odd element carried),
    whose order depends on the summed length alone. Elementwise ops round each element by itself, on any
    device. RMSNorm's mean, the log-softmax's logsumexp, a MoE router's softmax and top-k renormalisation, a
    token's sum over its experts and attention's two sums go through it.
`attention` splits keys into blocks at fixed positions 0, KEY_BLOCK, 2 KEY_BLOCK, ... of the sequence: a query
sums each block with `tree_sum` (its scores over D, its output over the block's keys) and folds the blocks in
order with an online softmax, so a query's bits depend on its own prefix only: alone in a decode step, in a
prefill or in the trainer's packed forward. Keys past its prefix count exactly 0 (a block wholly past it leaves
the running sums unchanged, bit for bit), so how many blocks the batch needs does not matter either.

The backward passes are plain GEMMs and SDPA: only the forward's bits must match the rollout engine's. The mode
costs what padding, per-chunk launches and fp32 elementwise attention cost (docs/benchmarks.md): it is opt-in.
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F

ROWS = 64  # rows of every GEMM `linear` runs
KEY_BLOCK = 64  # keys per attention block
CHUNK_ELEMENTS = 1 << 25  # attention's largest fp32 temporary ([.., queries, KEY_BLOCK, D]): 128 MiB
CHUNK_ELEMENTS_CUDA = 1 << 28  # 1 GiB on a GPU: fewer, larger launches (a decode step or a trainer's queries)
ALIGN = {"cpu": 64, "cuda": 256}  # bytes: a weight at another address is copied for the product (`linear`)


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """The sum over `dim` as a fixed tree of elementwise adds: the first half plus the second, the odd element
    carried, until one is left. Its order depends on the length of `dim` only."""
    dim %= x.ndim
    if x.shape[dim] == 0:
        return x.sum(dim, keepdim=keepdim)
    while (n := x.shape[dim]) > 1:
        half = n // 2
        summed = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
        x = summed if n % 2 == 0 else torch.cat([summed, x.narrow(dim, n - 1, 1)], dim)
    return x if keepdim else x.squeeze(dim)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias), each row's bits independent of the other rows (GEMMs of ROWS rows only)."""
    rows = x.reshape(-1, x.shape[-1])
    out = _ChunkedLinear.apply(rows, weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class _ChunkedLinear(torch.autograd.Function):
    """rows [M, K] @ weight.T as [ROWS, K] products at aligned addresses (one shape, one alignment: a weight
    elsewhere, a view into a flat buffer, is copied for the product only). The backward is plain GEMMs."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        align = ALIGN.get(rows.device.type, 256)
        if weight.data_ptr() % align or not weight.is_contiguous():
            weight = weight.clone(memory_format=torch.contiguous_format)
        (m, k), n, size = rows.shape, weight.shape[0], rows.element_size()
        padded = rows.new_zeros(-(-m // ROWS) * ROWS, k)
        padded[:m] = rows
        out = rows.new_empty(padded.shape[0], n)
        aligned = (k * size) % align == 0 and (n * size) % align == 0  # every chunk's operands start aligned
        w = weight.t()
        for a in range(0, padded.shape[0], ROWS):
            if aligned:
                torch.matmul(padded[a:a + ROWS], w, out=out[a:a + ROWS])
            else:
                out[a:a + ROWS] = torch.matmul(padded[a:a + ROWS].clone(), w)
        return out[:m]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        rows, weight = ctx.saved_tensors
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
        return grad_rows, grad_weight


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU whose every element takes the same (vectorised) exp, wherever it lies in the tensor."""
    return x / (1 + torch.exp(-x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Qwen compute it (fp32, cast back, then scaled), its mean a `tree_sum`."""
    dtype = x.dtype
    x = x.float()
    variance = tree_sum(x * x, -1, keepdim=True) / x.shape[-1]
    return weight * (x * torch.rsqrt(variance + eps)).to(dtype)


def logsumexp(z: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(z))) over the last dim: the max, then a `tree_sum` of the shifted exps."""
    top = z.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return torch.log(tree_sum(torch.exp(z - top), -1)) + top[..., 0]


def softmax(z: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim, in fp32, its denominator a `tree_sum` (a MoE router's probabilities)."""
    z = z.float()
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return e / tree_sum(e, -1, keepdim=True)


def experts(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
            down_proj: torch.Tensor) -> torch.Tensor:
    """A MoE layer's experts (grouped_experts.experts_forward's math and weight layout: gate_up_proj [E, 2f, h],
    down_proj [E, h, f], SiLU) with this module's ops: each expert's rows through `linear`, a token's k outputs
    weighted and summed by a tree in fp32. A Python loop over the experts the batch reaches (a host sync)."""
    tokens, k = ids.shape
    flat = ids.reshape(-1)
    rows = hidden.new_zeros(tokens * k, down_proj.shape[1])
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero()[:, 0]
        gate, up = linear(hidden[pairs // k], gate_up_proj[e]).chunk(2, dim=-1)
        rows[pairs] = linear(silu(gate) * up, down_proj[e])
    weighted = weights.to(rows.dtype).float()[..., None] * rows.view(tokens, k, -1).float()
    return tree_sum(weighted, 1).to(hidden.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float
              ) -> torch.Tensor:
    """q [B, H, n, D] against k/v [B, KV, L, D] (KV divides H: grouped-query heads), query (b, i) seeing keys
    0..visible[b, i] - 1 of row b (visible [B, n], at least 1; None: causal, query i sees keys 0..i, n == L);
    returns [B, H, n, D] in q's dtype, each query's bits a function of its own prefix only. Differentiable: the
    backward is SDPA's under the same mask (causal: `is_causal`, no mask tensor)."""
    if visible is not None:
        visible = visible.clamp(min=1)
    return _ExactAttention.apply(q, k, v, visible, scale)


class _ExactAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale):
        ctx.save_for_backward(q, k, v, visible)
        ctx.scale = scale
        batch, heads, n, d = q.shape
        per_query = batch * heads * KEY_BLOCK * d
        step = max(1, (CHUNK_ELEMENTS_CUDA if q.is_cuda else CHUNK_ELEMENTS) // per_query)
        out = torch.empty_like(q)
        for a in range(0, n, step):
            b = min(a + step, n)
            if visible is None:  # causal: queries a..b-1 see keys 0..b-1 at most (no device read)
                seen = torch.arange(a + 1, b + 1, device=q.device).expand(batch, b - a)
                blocks = -(-b // KEY_BLOCK)
            else:  # every block of k (no device read: a decode step stays capturable); those past a query count 0
                seen = visible[:, a:b]
                blocks = -(-k.shape[2] // KEY_BLOCK)
            out[:, :, a:b] = _attention_chunk(q[:, :, a:b], k, v, seen, scale, blocks)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, visible = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(need) for t, need in zip((q, k, v), needs, strict=True))
            if visible is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=ctx.scale, enable_gqa=True)
            else:
                mask = torch.arange(k.shape[2], device=q.device) < visible[..., None]  # [B, n, L]
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=ctx.scale,
                                                     enable_gqa=True)
            grads = iter(torch.autograd.grad(out, [t for t in (q, k, v) if t.requires_grad], grad))
        return (*(next(grads) if need else None for need in needs), None, None)


def _attention_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                     blocks: int) -> torch.Tensor:
    """`attention` for a few queries: key blocks 0..blocks-1 (enough for the longest prefix) folded in order with
    an online softmax, in fp32."""
    batch, heads, n, d = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    qf = q.float().reshape(batch, kv_heads, heads // kv_heads, n, 1, d)
    seen_by = visible[:, None, None, :, None]  # [B, 1, 1, n, 1]
    row_keys = visible.amax(1)[:, None, None]  # [B, 1, 1]: a row's keys past this are never seen (may be garbage)
    offsets = torch.arange(KEY_BLOCK, device=q.device)
    top = total = acc = None
    for j in range(blocks):
        lo = j * KEY_BLOCK
        keys, values = _key_block(k, lo, length), _key_block(v, lo, length)  # [B, KV, KEY_BLOCK, D] fp32
        values = torch.where((lo + offsets[:, None] < row_keys)[:, None], values, 0.0)
        scores = tree_sum(qf * keys[:, :, None, None], -1) * scale  # [B, KV, G, n, KEY_BLOCK]
        scores = torch.where(lo + offsets < seen_by, scores, float("-inf"))
        new_top = scores.amax(-1) if top is None else torch.maximum(top, scores.amax(-1))
        p = torch.exp(scores - new_top[..., None])
        weighted = tree_sum(p[..., None] * values[:, :, None, None], -2)  # [B, KV, G, n, D]
        if top is None:  # block 0 holds key 0, which every query sees: `new_top` is finite from here on
            total, acc = tree_sum(p, -1), weighted
        else:
            rescale = torch.exp(top - new_top)
            total = total * rescale + tree_sum(p, -1)
            acc = acc * rescale[..., None] + weighted
        top = new_top
    return (acc / total[..., None]).reshape(batch, heads, n, d).to(q.dtype)


def _key_block(x: torch.Tensor, lo: int, length: int) -> torch.Tensor:
    """Keys or values lo..lo + KEY_BLOCK - 1 of every row, in fp32, zero past the end."""
    block = x[:, :, lo:lo + KEY_BLOCK].float()
    if block.shape[2] < KEY_BLOCK:
        block = F.pad(block, (0, 0, 0, KEY_BLOCK - block.shape[2]))
    return block


class InvariantLinear(torch.nn.Linear):
    """nn.Linear through `linear`: what `make_invariant` turns a model's projections into (the class changes, the
    parameters and their names stay, so checkpoints and weight syncs see the same model)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class InvariantRMSNorm(torch.nn.Module):
    """A Llama/Qwen RMSNorm module (weight, variance_epsilon) through `rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


class InvariantSiLU(torch.nn.Module):
    """The MLP activation as `silu`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    return experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def make_invariant(model: torch.nn.Module) -> torch.nn.Module:
    """Turn a loaded HF causal LM's projections (attention, MLP, LM head) into InvariantLinear, its RMSNorms into
    InvariantRMSNorm and its MLP activations into InvariantSiLU, in place; a MoE block's router (routing.py's
    forward, as engines/models/hf.load_model installs it) computes with `linear` and `softmax`, its experts with
    `experts`. The trainer's and the engine's forwards then run the same ops. Refuses what this module has no
    batch-invariant form of (another activation or norm, a router load_model did not replace, jitter noise)."""
    if getattr(model.config, "hidden_act", "silu") != "silu":
        raise ValueError(f"rollout.true_on_policy: model config hidden_act {model.config.hidden_act!r}; expected silu")
    if getattr(model.config, "router_jitter_noise", 0.0):
        raise ValueError("rollout.true_on_policy: model config router_jitter_noise must be 0 (random noise on the "
                         "router's input in training)")
    for layer in model.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            if not hasattr(mlp.gate, "replay_ids") or not hasattr(mlp.experts, "gate_up_proj"):
                raise ValueError(f"rollout.true_on_policy: {type(mlp).__name__} has no batch-invariant form (Qwen3-MoE "
                                 "and Mixtral blocks loaded through engines/models/hf.load_model only)")
            mlp.gate.exact = True
            mlp.experts.forward = MethodType(_experts_forward, mlp.experts)
        else:
            mlp.act_fn = InvariantSiLU()
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = InvariantLinear
        elif type(module).__name__ in RMS_NORMS:
            module.__class__ = InvariantRMSNorm
        elif "Norm" in type(module).__name__ and not isinstance(module, InvariantRMSNorm):
            raise ValueError(f"rollout.true_on_policy: no batch-invariant form of {type(module).__name__} (Llama / "
                             "Qwen2 / Qwen3 / Qwen3-MoE / Mixtral RMSNorm only)")
    return model


RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm",
                       "MixtralRMSNorm"})

__all__ = ["InvariantLinear", "InvariantRMSNorm", "InvariantSiLU", "attention", "experts", "linear", "logsumexp",
           "make_invariant", "rms_norm", "silu", "softmax", "tree_sum"]
