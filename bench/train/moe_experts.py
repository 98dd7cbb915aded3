"""One MoE layer's experts, forward and backward, side by side: transformers' eager loop over experts (Megatron's
SequentialMLP works the same way), transformers' own grouped_mm path (its default where torch has the kernel), the
grouped-matmul function of the trainers and the engine (engines/models/grouped_experts.py), and that function under
torch.compile. Reports TFLOP/s and the fraction of the GPU's dense bf16 peak.

    python -m bench.train.moe_experts [--tokens 16384] [--out bench/results/moe_experts_<gpu>_<date>.json]
    python -m bench.train.moe_experts --smoke          # toy sizes on the CPU: the script runs, its numbers mean nothing

Default shape: a Qwen3-30B-A3B layer (hidden 2048, expert width 768, 128 experts, top-8), bf16, routing from a
random router's softmax (near balanced; real routers are less so). FLOPs counted: 6 * hidden * width per routed
(token, expert) pair forward (gate and up, 2 * h * 2f; down, 2 * f * h), three times that forward + backward.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

import torch

from bench.harness import (
    PEAK_BF16_TFLOPS,
    add_smoke,
    by_device,
    device,
    device_name,
    mean_time,
    peak_gib,
    report_header,
    say,
    write_json,
)
from rlflow.engines.models.grouped_experts import experts_forward


def transformers_experts(implementation: str, gate_up: torch.Tensor, down: torch.Tensor):
    """transformers' own Qwen3-MoE experts module over these weights (no copy), run by its `implementation`
    ("eager": its loop over experts; "grouped_mm": its own grouped path, the default of transformers >= 5.x where
    torch has the kernel); None where this transformers has no such implementation."""
    from transformers import Qwen3MoeConfig  # the bench's reference only: the function measured needs no transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=gate_up.shape[2], moe_intermediate_size=down.shape[2],
                         num_experts=gate_up.shape[0], num_experts_per_tok=1)
    cfg._experts_implementation = implementation
    try:
        module = Qwen3MoeExperts(cfg).to(device=gate_up.device, dtype=gate_up.dtype)
        module.gate_up_proj, module.down_proj = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
    except (ValueError, KeyError, AttributeError):
        return None
    return lambda hidden, index, weights, _gate_up, _down: module(hidden, index, weights)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=None)
    add_smoke(ap)
    args = ap.parse_args(argv)
    on = device()
    if args.smoke:
        args.tokens, args.hidden, args.width, args.experts, args.top_k, args.repeats = 64, 64, 32, 8, 2, 1
    dtype = torch.bfloat16 if on == "cuda" else torch.float32
    gpu = device_name()
    out = args.out or (f"bench/results/moe_experts_{gpu.split()[1].lower() if on == 'cuda' else 'cpu'}_"
                       f"{dt.date.today()}.json")
    report = report_header("bench.train.moe_experts", argv if argv is not None else sys.argv[1:]) | {
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "width": args.width, "experts": args.experts,
                  "top_k": args.top_k, "dtype": str(dtype)}, "results": {}}
    g = torch.Generator(device=on).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=on, dtype=dtype, generator=g)
    gate_up = (torch.randn(args.experts, 2 * args.width, args.hidden, device=on, dtype=dtype, generator=g) * 0.02)
    down = (torch.randn(args.experts, args.hidden, args.width, device=on, dtype=dtype, generator=g) * 0.02)
    logits = torch.randn(args.tokens, args.experts, device=on, generator=g)
    weights, index = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    grad_out = torch.randn_like(hidden)
    gate_up.requires_grad_()
    down.requires_grad_()
    flops = 3 * 6 * args.hidden * args.width * args.tokens * args.top_k
    peak = by_device(PEAK_BF16_TFLOPS, gpu) if on == "cuda" else None

    ways = {"transformers_eager": transformers_experts("eager", gate_up, down),
            "transformers_grouped_mm": transformers_experts("grouped_mm", gate_up, down),
            "rlflow_grouped_mm": experts_forward,
            "rlflow_grouped_mm_compiled": None if on != "cuda" or args.no_compile else torch.compile(experts_forward)}
    ways = {k: v for k, v in ways.items() if v is not None}
    params = [gate_up, down]
    reference = None
    for name, fn in ways.items():
        def step(fn=fn):
            for p in params:
                p.grad = None
            y = fn(hidden, index, weights, gate_up, down)
            y.backward(grad_out)
            return y

        say(f"{name}: warming up")
        y = step().detach().float()
        if reference is None:
            reference = y
        seconds = mean_time(step, repeats=args.repeats, warmup=2, on=on)
        tflops = flops / seconds / 1e12
        report["results"][name] = {
            "seconds_fwd_bwd": seconds, "tflops": tflops, "mfu": tflops / peak if peak else None,
            "max_abs_diff_vs_transformers_eager": (y - reference).abs().max().item(),
            "rel_diff_vs_transformers_eager": ((y - reference).abs().mean() / reference.abs().mean()).item(),
            "peak_gib": peak_gib()}
        say(f"{name}: {seconds * 1e3:.1f} ms fwd+bwd, {tflops:.1f} TFLOP/s"
            + (f", {100 * tflops / peak:.1f}% of peak" if peak else ""))
        write_json(out, report)
    base = report["results"]["transformers_eager"]["seconds_fwd_bwd"]
    report["speedup_vs_transformers_eager"] = {k: base / v["seconds_fwd_bwd"] for k, v in report["results"].items()}
    write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
