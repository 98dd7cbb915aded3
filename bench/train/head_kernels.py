"""The LM head's log-probs on one GPU: our chunked head (fused and eager) against full logits and liger-kernel's
fused linear cross-entropy (FLCE), issue 25 item 4. One command:

    python -m bench.train.head_kernels --out bench/results/head_kernels.json

Workload: the Qwen2-1.5B head (vocab 151,936, hidden 1,536, bf16) on `--tokens` packed tokens with random hidden
states and targets. The upstream gradient of the per-token log-probs is random (an RL loss weighs every token by
its advantage and ratio, so it is not the uniform gradient of a mean cross-entropy). Each variant: forward and
backward of sum(w * log p(target)), median time of `--steps` after a warm-up, peak memory above the inputs, and
the differences of its log-probs and of its input and weight gradients from an fp32 reference.

- `chunked-fused`: engines/models/packed.py's ChunkedHeadLogprobs with train.fused_head (what the trainer runs);
- `chunked-fused-entropy`: the same with the entropy (the trainer's default: it logs it);
- `chunked-eager`: the same math as eager ops (`fused_head: false`);
- `full-logits`: [tokens, vocab] fp32 logits and log_softmax (what a plain loop does);
- `liger-flce`: liger's LigerFusedLinearCrossEntropyLoss(reduction="none"), -loss as the log-probs. It computes
  its gradients inside the forward pass, for a loss it assumes; the gradient check says whether that holds for a
  non-uniform upstream gradient.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench import harness
from rlflow.engines.models.packed import ChunkedHeadLogprobs


def variants(chunk: int) -> dict:
    def chunked(fused: bool, entropy: bool):
        def run(hidden, weight, targets):
            return ChunkedHeadLogprobs.apply(hidden, weight, targets, 1.0, chunk, entropy, fused)[0]
        return run

    def full_logits(hidden, weight, targets):
        logits = (hidden @ weight.T).float()
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]

    def liger(hidden, weight, targets):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # optional extra, GPU only

        return -LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, hidden, targets)

    return {"chunked-fused": chunked(True, False), "chunked-fused-entropy": chunked(True, True),
            "chunked-eager": chunked(False, False), "full-logits": full_logits, "liger-flce": liger}


def measure(run, hidden, weight, targets, upstream, reference, steps: int) -> dict:
    base = torch.cuda.memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    last: dict = {}

    def step() -> None:
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        logp = run(h, w, targets)
        (logp.float() * upstream).sum().backward()
        last.update(h=h, w=w, logp=logp)

    timed = harness.timed(step, steps, warmup=1, on="cuda")
    h, w, logp = last["h"], last["w"], last["logp"]
    ref_logp, ref_grad, ref_wgrad = reference
    return {"step_s": timed, "median_s": harness.median(timed),
            "peak_extra_gib": harness.peak_gib() - base,
            "logprob_max_diff": float((logp.detach().float() - ref_logp).abs().max()),
            "grad_hidden_rel_diff": float((h.grad.float() - ref_grad).norm() / ref_grad.norm()),
            "grad_weight_rel_diff": float((w.grad.float() - ref_wgrad).norm() / ref_wgrad.norm())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", default="chunked-fused,chunked-fused-entropy,chunked-eager,full-logits,liger-flce")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g) * 0.02).bfloat16()
    targets = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)
    upstream = torch.randn(args.tokens, device="cuda", generator=g)
    h32 = hidden.float().requires_grad_()  # the fp32 reference, a chunk at a time (full fp32 logits do not fit)
    w32 = weight.float().requires_grad_()
    ref_logp = torch.empty(args.tokens, device="cuda")
    for a in range(0, args.tokens, args.chunk):
        logp = torch.log_softmax(h32[a:a + args.chunk] @ w32.T, -1)
        logp = logp.gather(-1, targets[a:a + args.chunk, None])[:, 0]
        (logp * upstream[a:a + args.chunk]).sum().backward()
        ref_logp[a:a + args.chunk] = logp.detach()
    reference = (ref_logp, h32.grad.detach(), w32.grad.detach())
    report = harness.report_header(__spec__.name, None) | {
        "tokens": args.tokens, "chunk": args.chunk, "vocab": args.vocab, "hidden": args.hidden, "variants": {}}
    for name, run in variants(args.chunk).items():
        if name not in args.variants.split(","):
            continue
        try:
            result = measure(run, hidden, weight, targets, upstream, reference, args.steps)
            result["tokens_per_s"] = args.tokens / result["median_s"]
        except (ImportError, torch.OutOfMemoryError) as e:
            result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        report["variants"][name] = result
        print(name, json.dumps({k: v for k, v in result.items() if k != "step_s"}), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        harness.write_json(args.out, report)


if __name__ == "__main__":
    main()
