"""Kernel-level timings of engines/train/megatron/fused_kernels.py against megatron-core's own fallbacks, at the
shapes of a Qwen2-1.5B step (4,096-token micro-batches), on one GPU:

- weight-gradient accumulation: a bf16 GEMM then `main_grad.add_` (megatron without apex), against one GEMM that
  takes bf16 inputs and adds into the fp32 main_grad in place (addmm's out_dtype), and against a bf16 GEMM into
  an fp32 output (mm's out_dtype) then add_;
- AdamW over the fp32 main weights: torch's foreach (megatron's default without apex) against torch's fused;
- the gradient norm and the main -> model weight copy: megatron's per-tensor loops against the foreach stand-ins.

    python -m bench.megatron.fused_kernels --out bench/results/fused_kernels_h100.json
"""

from __future__ import annotations

import argparse

import torch
from megatron.core import utils  # megatron's own fallbacks, the reference

from bench import harness
from rlflow.engines.train.megatron import fused_kernels

HIDDEN, FFN, KV, LAYERS = 1536, 8960, 256, 28  # Qwen2-1.5B
WEIGHTS = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)]  # qkv, proj, fc1, fc2
MAIN_WEIGHTS = [s for _ in range(LAYERS) for s in WEIGHTS] + [(151936, HIDDEN)]  # the layers and tied embedding


def wgrad(tokens: int, reps: int) -> dict[str, dict[str, float]]:
    """Seconds for one micro-batch's weight gradients of one layer, three ways."""
    dev = "cuda"
    cases = [(torch.randn(tokens, i, device=dev).bfloat16(), torch.randn(tokens, o, device=dev).bfloat16(),
              torch.zeros(o, i, device=dev)) for o, i in WEIGHTS]

    def unfused() -> None:  # megatron without apex: the bf16 gradient, then a second kernel adds it in
        for x, go, mg in cases:
            mg.add_(go.t().matmul(x))

    def fused_in_place() -> None:
        for x, go, mg in cases:
            fused_kernels.WgradAccumulation.wgrad_gemm_accum_fp32(x, go, mg)

    def fp32_out_then_add() -> None:
        for x, go, mg in cases:
            mg.add_(torch.mm(go.t(), x, out_dtype=torch.float32))

    flops = sum(2 * tokens * o * i for o, i in WEIGHTS)
    out = {}
    for name, fn in (("bf16_gemm_then_add", unfused), ("addmm_out_dtype_in_place", fused_in_place),
                     ("mm_out_dtype_then_add", fp32_out_then_add)):
        s = harness.mean_time(fn, reps, warmup=2, on="cuda")
        out[name] = {"seconds": s, "tflops": flops / s / 1e12}
        print(f"[wgrad] {name}: {s * 1e3:.3f} ms/layer, {flops / s / 1e12:.0f} TFLOP/s", flush=True)
    return out


def adamw(reps: int) -> dict[str, dict[str, float]]:
    """One AdamW step over a layer stack's fp32 main weights (plus the tied embedding), foreach and fused."""
    out = {}
    for name, kw in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in MAIN_WEIGHTS]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-5, **kw)
        s = harness.mean_time(opt.step, reps, warmup=2, on="cuda")
        out[name] = {"seconds": s, "params": sum(p.numel() for p in params)}
        print(f"[adamw] {name}: {s * 1e3:.1f} ms", flush=True)
        del opt, params
        torch.cuda.empty_cache()
    return out


def norm_and_copy(reps: int) -> dict[str, dict[str, float]]:
    grads = [torch.randn(s, device="cuda") for s in MAIN_WEIGHTS]
    model = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in MAIN_WEIGHTS]
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    out = {}
    for name, fn in (("norm_megatron", lambda: utils.local_multi_tensor_l2_norm(0, flag, [grads], False)),
                     ("norm_foreach", lambda: fused_kernels.l2_norm(0, flag, [grads], False)[0].item()),
                     ("copy_megatron", lambda: utils.local_multi_tensor_scale(0, flag, [grads, model], 1.0)),
                     ("copy_foreach", lambda: fused_kernels.scale(0, flag, [grads, model], 1.0))):
        s = harness.mean_time(fn, reps, warmup=2, on="cuda")
        out[name] = {"seconds": s}
        print(f"[{name}] {s * 1e3:.2f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    res = harness.report_header(__spec__.name, None) | {
        "tokens": a.tokens, "wgrad_per_layer": wgrad(a.tokens, a.reps), "adamw": adamw(max(3, a.reps // 4)),
        "norm_and_copy": norm_and_copy(max(3, a.reps // 4))}
    harness.write_json(a.out, res)


if __name__ == "__main__":
    main()
