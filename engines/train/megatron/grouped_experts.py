"""Megatron's MoE experts as two grouped matmuls, without Transformer Engine or the grouped_gemm package.

megatron-core's local spec computes experts with SequentialMLP: a Python loop of one small GEMM pair per expert,
after a host sync for the token counts (`tokens_per_expert.tolist()`). Its grouped paths need Transformer Engine
(TEGroupedMLP) or the grouped_gemm package (GroupedMLP), neither of which the GPU machines here have.
`GroupedSequentialMLP` keeps SequentialMLP's modules and parameters (one MLP per expert: the same names, weight
mapping, checkpoints and expert-parallel sharding) and replaces only its forward: the experts' fc1 and fc2 weights
stacked, and torch's grouped matmul (engines/models/grouped_experts.py, the native trainer's and the engine's
function) over the tokens megatron's dispatcher already sorted by expert, with the counts' running sum as offsets
on the device.

Stacking copies the local experts' weights once per forward (and their gradients back once per backward): a few
milliseconds a layer at 30B-A3B's size, against a loop of 2 x experts GEMMs and a host sync. Where the grouped form
does not reproduce megatron's MLP exactly (an activation other than SwiGLU, biases, a clamp or offset on the GLU,
FP8, expert tensor parallelism, probabilities applied on the input) the module runs SequentialMLP's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from rlflow.engines.models.grouped_experts import grouped_mm


class GroupedSequentialMLP(SequentialMLP):
    """SequentialMLP's experts, computed as grouped matmuls where that is exact (module docstring)."""

    def grouped(self) -> bool:
        c = self.config
        return (c.gated_linear_unit and c.activation_func is F.silu and not c.add_bias_linear
                and getattr(c, "activation_func_clamp_value", None) is None
                and not getattr(c, "glu_linear_offset", 0.0) and not (c.fp8 or getattr(c, "fp4", None))
                and not c.moe_apply_probs_on_input and self.tp_group.size() == 1)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        if not self.grouped():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2f: gate then up, h]
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, h, f]
        offsets = torch.cumsum(torch.as_tensor(tokens_per_expert).to(x.device), 0).to(torch.int32)
        gate, up = grouped_mm(x, fc1.transpose(1, 2), offsets).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        hidden = (hidden * permuted_probs.unsqueeze(-1)).to(hidden.dtype)  # megatron's per-token scale, then cast
        return grouped_mm(hidden, fc2.transpose(1, 2), offsets), None
