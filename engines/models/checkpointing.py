"""Activation checkpointing of the decoder layers (train.activation_checkpointing): "full" or "selective".

Why selective: "full" recomputes each layer's whole forward in the backward pass, attention included. At long
samples causal attention is most of a layer's FLOPs (about two thirds at 64k tokens), so running its kernel again
costs about a fifth of the step. "selective" still recomputes the layer (projections, norms, rotary, MLP) but keeps
the attention kernel's outputs from the forward (its output and log-sum-exp: about T x hidden per layer, 5.6 GB
over the 28 layers of a 1.5B model at 64k tokens): torch's selective checkpointing caches the outputs of the ops
`attention_policy` marks MUST_SAVE, and the recompute reads them instead of running the kernel. An attention that
reaches none of ATTENTION_OPS (rollout.true_on_policy's exact one) is recomputed as with "full".

Context parallelism (ulysses.py): the all-to-alls around attention are recomputed like any other op. Every rank
recomputes the same layers in the same order in its backward (as with "full"), so the collectives still pair up;
saving their outputs would keep another T/N x hidden per layer to spare one exchange each way.
"""

from __future__ import annotations

from contextlib import suppress
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

with suppress(ImportError):  # torch >= 2.9: registers torch.ops.torch_attn._varlen_attn (packed.py's CUDA attention)
    import torch.nn.attention.varlen  # noqa: F401

# (namespace, op): the attention kernels PackedLM's attention reaches. CUDA: varlen flash attention, a custom op
# (its inner aten._flash_attention_forward runs beneath it, unseen); CPU: SDPA's fused CPU kernel; the other SDPA
# kernels and flash's own forward in case another path is taken. An op this torch lacks is left out.
_ATTENTION_OPS = (("torch_attn", "_varlen_attn"), ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
                  ("aten", "_scaled_dot_product_flash_attention"), ("aten", "_scaled_dot_product_efficient_attention"),
                  ("aten", "_scaled_dot_product_cudnn_attention"), ("aten", "_flash_attention_forward"),
                  ("aten", "_efficient_attention_forward"))


def _ops(names) -> frozenset:
    found = []
    for namespace, name in names:
        try:
            found.append(getattr(getattr(torch.ops, namespace), name))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


ATTENTION_OPS = _ops(_ATTENTION_OPS)  # op packets: a call's overload (.default) is matched by its packet


def attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the attention kernels' outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if getattr(op, "overloadpacket", op) in ATTENTION_OPS \
        else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(mode: str) -> dict:
    """torch.utils.checkpoint.checkpoint's keyword arguments for `mode` (HF passes them on for every layer);
    context_fn makes a fresh cache per checkpointed call."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing {mode!r}: expected 'full' or 'selective'")
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, attention_policy)
    return kwargs
