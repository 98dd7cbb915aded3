"""torch stand-ins for the fused kernels megatron-core takes from apex or Transformer Engine.

Without either (the lent GPUs can install neither), megatron-core falls back to per-tensor Python loops: the
gradient norm is one torch.norm per parameter, each read back to the host; the fp32 -> bf16 copy of the main
weights goes through an fp32 temporary per tensor; each weight-gradient GEMM writes a bf16 gradient that a
second kernel adds into the fp32 main_grad; and the optimizer is torch's foreach AdamW. torch has what the fused
versions need: foreach norms and copies, a fused AdamW, and GEMMs that take bf16 inputs and accumulate in place
into an fp32 output (addmm's out_dtype, on CUDA), which is what apex's fused_weight_gradient_mlp_cuda does.

MegatronConfig.torch_fused_kernels (on by default) turns these on; with apex or Transformer Engine installed,
megatron's own fused kernels are kept.
"""

from __future__ import annotations

from typing import Any

import torch


class WgradAccumulation:
    """apex's fused_weight_gradient_mlp_cuda in torch: main_grad += grad_output^T @ input, the GEMM's epilogue
    adding into main_grad (no bf16 gradient in between). megatron passes both as 2-D [tokens, features]."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        a, b = grad_output.t(), total_input
        if main_grad.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
            torch.addmm(main_grad, a, b, out_dtype=torch.float32, out=main_grad)
        else:  # fp32 weights, or CPU (no mixed-dtype GEMM there): the product in fp32
            main_grad.addmm_(a.float(), b.float())

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t(), total_input)  # gradients kept in bf16/fp16: same dtype throughout


def l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
            *args: Any) -> tuple[torch.Tensor, None]:
    """amp_C.multi_tensor_l2norm's signature: the L2 norm of all the tensors together, on their device."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], factor: float) -> None:
    """amp_C.multi_tensor_scale's signature: tensor_lists[1][i] = tensor_lists[0][i] * factor (in place when the
    lists are the same; a copy, with a cast, when factor is 1)."""
    src, dst = tensor_lists
    if src is dst or all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, factor)
    elif factor == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def install() -> None:
    """Put the stand-ins where megatron-core looks its kernels up, where it fell back to its own loops (neither
    apex nor Transformer Engine imported). Idempotent."""
    from megatron.core import utils  # megatron-core is an extra: imported when a Megatron backend is built
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import layers

    if clip_grads.multi_tensor_applier is utils.local_multi_tensor_applier:
        clip_grads.l2_norm_impl = l2_norm
        clip_grads.multi_tensor_scale_impl = scale
    if optimizer.multi_tensor_applier is utils.local_multi_tensor_applier:
        optimizer.multi_tensor_scale_impl = scale
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = WgradAccumulation
        layers._grad_accum_fusion_available = True


def fuse_adam(optimizer: Any) -> None:
    """Switch the torch Adam/AdamW inside megatron's optimizer (whatever wraps it) to torch's fused kernel: one
    launch for all parameters instead of foreach's dozen. Before the first step (its state is created to suit)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):  # apex/TE FusedAdam: fused already
            continue
        for group in inner.param_groups:
            if all(p.device.type in ("cuda", "cpu") for p in group["params"]):
                group["fused"], group["foreach"] = True, None
