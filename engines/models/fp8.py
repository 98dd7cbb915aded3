"""FP8 weights for the embedded engine (`rollout.precision: fp8`): the decoder's projections held in e4m3 with one
scale per output channel, multiplied by `torch._scaled_mm` against activations quantized per token.

Why this shape: decode is bound by the bytes of weights read per step, and e4m3 halves them; on Hopper the FP8
tensor cores also double the GEMM peak, which matters at batch 256 where a 7B step is near compute-bound.
Per-output-channel weight scales and per-token activation scales ("row-wise" scaling, which `_scaled_mm` takes
directly) keep one outlier channel or token from flattening the rest, with no block bookkeeping.

The weights are quantized on receipt: a weight update writes each HF-named bf16 tensor straight into its rows of
the e4m3 store (`Fp8Projections.write`), and the engine holds no bf16 copy of a quantized projection. q/k/v and
gate/up are one store each (rows in output order), so each runs as one GEMM, as the bf16 engine fuses them.
Embeddings, norms, the LM head, MoE routers and experts stay in the model's dtype: the head sets the log-probs
the trainer compares against, and the experts' grouped kernel is bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
_TINY = 1e-12  # the scale of an all-zero row: its values stay 0 and nothing divides by zero

# per layer, the projection groups quantized: (module, members in output order, name of the group)
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv"), ("self_attn", ("o_proj",), "o"),
          ("mlp", ("gate_proj", "up_proj"), "gate_up"), ("mlp", ("down_proj",), "down"))


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (e4m3 [rows, cols], fp32 scale [rows]) with w ~= q * scale[:, None]: each row's largest
    magnitude maps to e4m3's largest finite value (448)."""
    scale = (w.detach().abs().amax(dim=-1).float() / E4M3_MAX).clamp(min=_TINY)
    q = (w.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [..., in] (bf16) @ dequantized(weight [out, in], scale [out]).T + bias, in x's dtype: x quantized per
    token (row-wise scale), one `_scaled_mm` with fp32 accumulation. Nothing waits for the host (CUDA graphs)."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    x_scale = (flat.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp(min=_TINY)
    xq = (flat.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale[None], out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


@dataclass
class Fp8Projection:
    """One GEMM's weights: e4m3 rows, their scales, and the bias (model dtype) if the members have one."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, self.bias)


class Fp8Projections:
    """Every quantized projection of a decoder, by layer and group (`GROUPS`), and the HF names a weight update
    writes into them. Built from the model's current weights, whose quantized tensors it then frees."""

    def __init__(self, model: torch.nn.Module):
        layers = model.model.layers
        self.layers: list[dict[str, Fp8Projection]] = [{} for _ in layers]
        self._by_name: dict[str, tuple[Fp8Projection, int, int, str]] = {}  # name -> (projection, start, stop, kind)
        self._shapes: list[tuple[Fp8Projection, torch.Size, int | None]] = []
        for i, layer in enumerate(layers):
            for module_name, members, group in GROUPS:
                module = getattr(layer, module_name)
                if not all(isinstance(getattr(module, m, None), torch.nn.Linear) for m in members):
                    continue  # an MoE block's experts: not a dense projection
                linears = [getattr(module, m) for m in members]
                prefix = f"model.layers.{i}.{module_name}."
                self.layers[i][group] = self._quantize(prefix, members, linears)
        self.names = frozenset(self._by_name)  # HF names of the weights (and biases) held here; fixed from now on

    @torch.no_grad()
    def _quantize(self, prefix: str, members: tuple[str, ...], linears: list[torch.nn.Linear]) -> Fp8Projection:
        has_bias = [lin.bias is not None for lin in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError(f"rollout.precision fp8: {prefix}{members} mix projections with and without a bias")
        weight, scale = quantize_rows(torch.cat([lin.weight for lin in linears]))
        bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) and has_bias else None
        proj = Fp8Projection(weight, scale, bias)
        start = 0
        for member, lin in zip(members, linears, strict=True):
            stop = start + lin.out_features
            self._by_name[f"{prefix}{member}.weight"] = (proj, start, stop, "weight")
            if bias is not None:
                self._by_name[f"{prefix}{member}.bias"] = (proj, start, stop, "bias")
            start = stop
            lin.weight.data = torch.empty(0, dtype=lin.weight.dtype, device=lin.weight.device)  # no bf16 copy kept
            if lin.bias is not None:
                lin.bias.data = torch.empty(0, dtype=lin.bias.dtype, device=lin.bias.device)
        self._shapes.append((proj, weight.shape, None if bias is None else bias.shape[0]))
        return proj

    def shape_of(self, name: str) -> tuple[int, ...]:
        proj, start, stop, kind = self._by_name[name]
        return (stop - start, proj.weight.shape[1]) if kind == "weight" else (stop - start,)

    @torch.no_grad()
    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Quantize an HF-named weight (any float dtype, any device) into its rows; a bias is copied as is."""
        proj, start, stop, kind = self._by_name[name]
        expected = self.shape_of(name)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight update {name!r}: shape {tuple(tensor.shape)}, expected {expected}")
        if kind == "bias":
            proj.bias[start:stop].copy_(tensor)
            return
        q, scale = quantize_rows(tensor.to(proj.weight.device))
        proj.weight[start:stop].copy_(q)
        proj.scale[start:stop].copy_(scale)

    @torch.no_grad()
    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The weight (dequantized) or bias the engine computes with under `name`."""
        proj, start, stop, kind = self._by_name[name]
        if kind == "bias":
            return proj.bias[start:stop].to(dtype)
        return dequantize_rows(proj.weight[start:stop], proj.scale[start:stop], dtype)

    @torch.no_grad()
    def digest(self) -> float:
        """Sum of every dequantized weight and bias (a cheap fingerprint, as the backend's weights_digest)."""
        return float(sum(self.read(n, torch.float64).sum() for n in self._by_name))

    def nbytes(self) -> int:
        return sum(p.weight.nbytes + p.scale.nbytes + (0 if p.bias is None else p.bias.nbytes)
                   for layer in self.layers for p in layer.values())

    def release(self) -> None:
        """Give the memory back (colocated rollout between steps); `allocate` brings it back, contents undefined."""
        for proj, _, _ in self._shapes:
            proj.weight = proj.weight.new_empty(0)
            proj.scale = proj.scale.new_empty(0)
            if proj.bias is not None:
                proj.bias = proj.bias.new_empty(0)

    def allocate(self) -> None:
        for proj, shape, bias in self._shapes:
            if proj.weight.numel() == 0:
                proj.weight = proj.weight.new_empty(shape)
                proj.scale = proj.scale.new_empty(shape[0])
                if bias is not None:
                    proj.bias = proj.bias.new_empty(bias)

    def pointers(self) -> tuple[int, ...]:
        """Where the stores live (a captured CUDA graph holds these addresses)."""
        return tuple(t.data_ptr() for proj, _, _ in self._shapes
                     for t in (proj.weight, proj.scale, proj.bias) if t is not None)
