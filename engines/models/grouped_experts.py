"""Mixture-of-experts compute with grouped matmuls: the one expert function of the trainers and the engine.

A MoE layer sends each token to its top-k experts. The plain way (transformers' eager experts, Megatron's
SequentialMLP) loops over the experts in Python: a small GEMM per expert, and a host sync to find each expert's
tokens. Here the (token, slot) pairs are sorted by expert on the device, so each expert's rows are contiguous,
and two grouped matmuls compute every expert at once: gate/up, then down. `torch.nn.functional.grouped_mm`
(torch >= 2.10: a CUDA kernel for bf16 on SM80+, and a CPU kernel) takes the cumulative row counts per expert as
its offsets; they are computed and kept on the device, so the forward never waits for the host. The rows go back
to token order and each token's k rows are summed with their routing weights in one batched matmul: no atomics,
so the forward gives the same result every time (the engine's and the trainer's log-probs must agree).

Why torch's grouped matmul and not a Triton kernel of our own: it is the kernel torchtitan's MoE uses (CUTLASS on
Hopper), it has a backward, and the sort/scatter around it are plain torch ops that compile. Where it does not
apply (fp32 on CUDA, shapes whose rows are not 16-byte aligned) a reference loop over the experts computes the
same thing, with a host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType

import torch
import torch.nn.functional as F

GROUPED_MM = getattr(F, "grouped_mm", None)  # torch >= 2.10
CUDA_DTYPES = (torch.bfloat16,)  # what the CUDA kernel computes in


def route_order(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs sorted by expert, as positions into `top_k_index.reshape(-1)`, and the cumulative
    pair count per expert (int32, [num_experts]: expert e's rows end at offsets[e]). No host sync: the counts
    come from a scatter, not bincount (whose output size needs the largest id on the host)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    return order, torch.cumsum(counts, 0).to(torch.int32)


def kernel_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's kernel takes rows of 16-byte multiples at 16-byte aligned addresses (weights inside a flat buffer,
    engines/models/flat_weights.py, may sit anywhere); on CUDA in bf16, on CPU in fp32. Under torch.compile the
    addresses are not read (dynamo cannot trace `data_ptr`, and fell back to eager for the whole decode step): a
    compiled caller runs only where an eager check passed (the engine's `graph_safe`), and a flat buffer keeps its
    offsets when it moves. The CPU kernel has no rule for compile's fake tensors: compiled, CPU takes the loop."""
    if GROUPED_MM is None or x.dtype != w.dtype:
        return False
    if not all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], w.shape[-1])):
        return False
    if torch.compiler.is_compiling():
        if not x.is_cuda:
            return False
    elif x.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    return x.dtype in CUDA_DTYPES if x.is_cuda else x.dtype == torch.float32


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows [offsets[e-1], offsets[e]) of x [N, d_in] times w[e] [d_in, d_out], for every expert e: [N, d_out]."""
    if kernel_applies(x, w):
        return GROUPED_MM(x, w, offs=offsets)
    ends = offsets.tolist()  # the reference path: a host sync, a GEMM per expert
    starts = [0, *ends[:-1]]
    return torch.cat([x[s:e] @ w[j] for j, (s, e) in enumerate(zip(starts, ends, strict=True))])


def experts_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """The MoE experts of one layer, in transformers 5's layout: hidden [T, h]; top_k_index, top_k_weights [T, k];
    gate_up_proj [E, 2f, h] (each expert's gate rows, then its up rows); down_proj [E, h, f]. Returns [T, h]:
    sum over a token's k experts of weight * down(act(gate(x)) * up(x))."""
    tokens, k = top_k_index.shape
    order, offsets = route_order(top_k_index, gate_up_proj.shape[0])
    rows = order // k  # the token of each sorted (token, slot) pair
    x = hidden[rows]
    gate, up = grouped_mm(x, gate_up_proj.transpose(1, 2), offsets).chunk(2, dim=-1)
    y = grouped_mm(act(gate) * up, down_proj.transpose(1, 2), offsets)
    # back to (token, slot) order, each row written once, then each token's k rows weighted and summed in one
    # batched GEMM (fp32 accumulation): the same sum on every call. An index_add of the sorted rows into the
    # tokens (atomics on CUDA) summed a token's k rows in bf16 in whatever order they landed, so two identical
    # forwards differed (4e-2 in a tiny model's logits on an H200).
    rows_in_order = torch.empty_like(y).index_copy_(0, order, y).view(tokens, k, y.shape[-1])
    return torch.bmm(top_k_weights.to(y.dtype).unsqueeze(1), rows_in_order).squeeze(1).to(hidden.dtype)


def _grouped_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    return experts_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self.act_fn)


def use_grouped_experts(model: torch.nn.Module) -> int:
    """Run every MoE experts module of a transformers 5 model (stacked gate_up_proj [E, 2f, h] and down_proj
    [E, h, f], called with hidden states, top-k ids and weights) through experts_forward. The weights stay where
    they are, under their names (weight sync, checkpoints, FSDP2 see no change). Returns how many it replaced."""
    replaced = 0
    for module in model.modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 and hasattr(
                module, "act_fn"):
            module.forward = MethodType(_grouped_forward, module)
            replaced += 1
    return replaced
