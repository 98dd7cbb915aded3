"""Fused kernels for the HF decoder layers the native trainer runs (train.kernels).

HF's Llama/Qwen modules run RMSNorm, rotary embedding and SwiGLU as chains of small elementwise kernels, each a
round trip through GPU memory, forward and backward: on an H100 they were about half of a 1.5B training step's
GPU time (docs/benchmarks.md). liger-kernel (pure Triton, on PyPI) has fused replacements for exactly these
modules and patches a loaded model in place; we use it rather than write our own. Its fused linear cross-entropy
is not used: the trainer needs per-token log-probs and entropy, which engines/models/packed.py's chunked head
computes.
"""

from __future__ import annotations

import torch

# model_type -> liger-kernel's patch function for it
LIGER_PATCHES = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2",
                 "qwen3": "apply_liger_kernel_to_qwen3"}


def apply_kernels(model: torch.nn.Module, kernels: str) -> None:
    """Swap `model`'s RMSNorm, rotary and SwiGLU for fused kernels when `kernels` is "liger" ("torch": as loaded).

    liger's rotary patch replaces the function in the HF modeling module, so it holds for every model of that
    type in this process (the reference model too); the math is the same."""
    if kernels == "torch":
        return
    model_type = model.config.model_type
    if model_type not in LIGER_PATCHES:
        raise ValueError(f"train.kernels: liger is wired for model_type {sorted(LIGER_PATCHES)}; the model is "
                         f"{model_type!r} (use train.kernels: torch)")
    try:  # an optional extra: Triton kernels, GPU machines only
        import liger_kernel.transformers as liger
    except ImportError as exc:
        raise RuntimeError("train.kernels: liger needs the liger-kernel package and Triton on a CUDA machine "
                           "(pip install 'rlflow[liger]')") from exc
    getattr(liger, LIGER_PATCHES[model_type])(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                              fused_linear_cross_entropy=False, model=model)
