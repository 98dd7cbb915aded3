"""Flat weights: a model's weights in one buffer, in an order that both the weight transports and the
embedded engine's fused projections rely on.

On GPU both engines keep their weights in one flat buffer (`flatten_`). A run of consecutive weights is then one
slice of memory (`flat_span`), so a colocated sync is a single cast-copy kernel, an NCCL sender packs a bucket
with one kernel, and a receiver broadcasts straight into its weights with nothing to unpack. The order is HF's
parameter order with one change (`fusable_order`): each layer's q/k/v projection weights sit next to each other,
then their biases (Qwen2 interleaves them), so that q/k/v are one [q + k + v, hidden] matrix in memory, and
gate/up (already adjacent in HF's order) one [2 x intermediate, hidden] matrix. The decoder then runs one GEMM
for each group (`fused_linear`) over the very memory a sync writes: no fused copy to refresh after an update.
Weights not laid out that way (CPU, a layout from elsewhere) take the per-tensor path everywhere.
"""

from __future__ import annotations

import re

import torch

# the projections the decoder runs as one GEMM: {module: its members in output order}
FUSED_PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
_MEMBER = re.compile(rf"^(?P<base>.*\.(?P<module>{'|'.join(FUSED_PROJECTIONS)})\.)(?P<member>\w+)\.(weight|bias)$")


def fusable_order(names: list[str]) -> list[str]:
    """`names` (HF parameter names, HF's order) with each fused group's weights consecutive and in output
    order, followed by the group's biases: both ends of a sync and the flat buffer use this order."""
    present, out = set(names), {}  # a dict keeps the order and drops a group's later members
    for name in names:
        m = _MEMBER.match(name)
        if m is None or m["member"] not in FUSED_PROJECTIONS[m["module"]]:
            out[name] = None
            continue
        for kind in ("weight", "bias"):
            for member in FUSED_PROJECTIONS[m["module"]]:
                if (n := f"{m['base']}{member}.{kind}") in present:
                    out.setdefault(n)
    return list(out)


@torch.no_grad()
def flatten_(params: dict[str, torch.Tensor], shapes: dict[str, torch.Size] | None = None,
             into: torch.Tensor | None = None) -> torch.Tensor:
    """Move every tensor of `params` (one dtype, one device) into one contiguous buffer, in dict order, and
    return the buffer. Each tensor (an nn.Parameter stays the same object) becomes a view into it, so an
    optimizer or a tied weight still refers to the right memory. With `shapes`, only allocate tensors of
    those shapes (contents undefined): what re-allocating released weights needs. `into`: a 1-D buffer of
    exactly the right size to use (a shared-memory file's) instead of a new one."""
    dtypes, devices = {t.dtype for t in params.values()}, {t.device for t in params.values()}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(f"flatten_: weights must share one dtype and device, found {dtypes} on {devices}")
    shape_of = shapes or {n: t.shape for n, t in params.items()}
    numel, dtype, device = sum(shape_of[n].numel() for n in params), dtypes.pop(), devices.pop()
    if into is not None and (into.numel() != numel or into.dtype != dtype or into.device != device):
        raise ValueError(f"flatten_: the buffer given holds {into.numel()} {into.dtype} on {into.device}; the "
                         f"weights need {numel} {dtype} on {device}")
    flat = into if into is not None else torch.empty(numel, dtype=dtype, device=device)
    offset = 0
    for name, t in params.items():
        numel = shape_of[name].numel()
        view = flat[offset : offset + numel].view(shape_of[name])
        if shapes is None:
            view.copy_(t.data)
        t.data = view
        offset += numel
    return flat


def flat_span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D slice of memory that `tensors` fill when they are consecutive contiguous tensors of one dtype
    inside the first one's storage, in this order (as `flatten_` lays them out); None otherwise. Only
    pointers are compared, so it costs about a microsecond a tensor."""
    first = tensors[0]
    size, start = first.element_size(), first.data_ptr()
    ptr = start
    for t in tensors:
        if t.dtype != first.dtype or t.data_ptr() != ptr or not t.is_contiguous():
            return None
        ptr += t.numel() * size
    numel = (ptr - start) // size
    if first.storage_offset() + numel > first.untyped_storage().nbytes() // size:
        return None  # adjacent by chance, but not one allocation
    return first.detach().as_strided((numel,), (1,), first.storage_offset())


def views_of(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the start of a 1-D buffer shaped like `tensors`, one after the other: where a bucket of them is
    packed to travel (the nccl transport's broadcast buffer)."""
    sizes = [t.numel() for t in tensors]
    return [v.view(t.shape) for v, t in zip(flat[: sum(sizes)].split(sizes), tensors, strict=True)]


def fused_linear(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weight [sum of out_features, in_features] and bias of `linears` run as one GEMM, as views of their
    own memory when they are consecutive in a flat buffer (`fusable_order`); None when they are not (or only
    some have a bias), and the caller runs them one by one."""
    weight = flat_span([lin.weight for lin in linears])
    if weight is None:
        return None
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        bias = None
    elif any(b is None for b in biases) or (bias := flat_span(biases)) is None:
        return None
    return weight.view(-1, linears[0].in_features), bias
