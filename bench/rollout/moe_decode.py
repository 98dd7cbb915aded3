"""MoE decode in the embedded engine, side by side in one run: CUDA graphs off and on, torch.compile, and the cost
of recording every token's experts (routing replay r3), at several batch sizes, each as a fraction of the
bandwidth limit (bench/rollout/gpu.py's `decode_limit`: the weights a step reads, the experts its tokens reach
under uniform routing, plus the live KV cache, at the measured copy bandwidth).

    PYTHONUNBUFFERED=1 python -m bench.rollout.moe_decode --size 30B-A3B-12L --batches 64,256 --out moe_decode.json

First a check: with graphs on and off, the same seeds give the same tokens, log-probs and expert records (the
graph replays the eager kernels), and the records are each token's own (the engine's first prompt's record
against a plain forward over the whole sequence with the same routing code).

`--smoke` runs the tiny MoE on the CPU (no graphs there: the check and timings still run the code paths).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench import harness
from bench.rollout.gpu import SHAPES, build_model, copy_bandwidth, decode_limit, kv_settings
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models.routing import recording
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend

VARIANTS = {  # name: TorchRolloutBackend settings
    "eager": dict(cuda_graphs=False),
    "graphs": dict(),
    "graphs_compile": dict(compile=True),
    "graphs_record_routing": dict(record_routing=True),
}


def engine(path: Path, batch: int, context: int, device: str, args, **settings) -> TorchRolloutBackend:
    return TorchRolloutBackend(str(path), device=device, dtype=torch.bfloat16, batch_size=batch, context_len=context,
                               kv_cache=kv_settings(args), **settings)


def check(path: Path, device: str, args, vocab: int) -> dict:
    """Graphs on and off agree exactly; the record of a sequence is what a forward over it routes to."""
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, vocab, (8, 32), generator=g).tolist()
    params = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        e = engine(path, 8, 64 + 16, device, args, record_routing=True, cuda_graphs=graphs)
        runs[graphs] = e.generate(prompts, params, seed=11)
        captured = len(e.engine._runner.graphs)
        if graphs:
            seq = runs[True][0]
            ids = torch.tensor([seq.prompt_ids + seq.output_ids[:-1]], device=device)
            with torch.no_grad(), recording(e.model) as rec:
                e.model(ids)
            forward = rec[0].cpu().numpy()
        e.close()
    eager, graphed = runs[False], runs[True]
    same_tokens = all(a.output_ids == b.output_ids for a, b in zip(eager, graphed, strict=True))
    logprob_diff = max(float(np.abs(np.array(a.output_logprobs) - np.array(b.output_logprobs)).max())
                       for a, b in zip(eager, graphed, strict=True))
    same_routing = all(np.array_equal(a.routed_experts, b.routed_experts) for a, b in zip(eager, graphed, strict=True))
    record = graphed[0].routed_experts
    agree = float((np.sort(record, -1) == np.sort(forward, -1)).all(-1).mean())
    return {"graphs_captured": captured, "same_tokens": same_tokens, "max_logprob_diff": logprob_diff,
            "same_routing_records": same_routing, "record_shape": list(record.shape),
            "record_vs_full_forward_agreement": agree}


def time_variant(path: Path, prompts: list[list[int]], new_tokens: int, repeats: int, device: str, args,
                 settings: dict) -> dict:
    e = engine(path, len(prompts), len(prompts[0]) + new_tokens + 16, device, args, **settings)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    t0 = time.perf_counter()
    e.generate(prompts, params, seed=0)  # warm-up: cache, graph capture, compilation
    harness.sync(device)
    warmup_s = time.perf_counter() - t0
    times = harness.timed(lambda: e.generate(prompts, params, seed=1), repeats, on=device)
    out = {"warmup_s": warmup_s, "seconds": times, "tokens_per_s": len(prompts) * new_tokens / statistics.median(times),
           "cuda_graphs": len(e.engine._runner.graphs) if e.engine._runner else 0, "kv": e.engine.stats()}
    e.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="30B-A3B-12L", choices=sorted(k for k in SHAPES if "moe" in k or "A3B" in k))
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-fraction", type=float, default=0.85)
    ap.add_argument("--out", default="moe_decode.json")
    harness.add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.size, args.batches, args.new_tokens, args.prompt_len, args.repeats = "smoke-moe", "2,4", 8, 8, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = build_model(args.size, Path(tempfile.mkdtemp(prefix="rlflow-moe-")) / "model", device)
    vocab = SHAPES[args.size]["vocab_size"]
    result: dict = harness.report_header(__spec__.name, None) | {
        "size": args.size, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats}
    result["check"] = check(path, device, args, vocab)
    print(f"check: {result['check']}", flush=True)
    harness.write_json(args.out, result)
    gbps = copy_bandwidth() if device == "cuda" else None
    result["copy_gb_per_s"] = gbps
    model = None
    if gbps:  # the limit needs the parameters' sizes only
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    result["points"] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=g).tolist()
        limit = decode_limit(model, batch, args.prompt_len, args.new_tokens, gbps) if model is not None else None
        point: dict = {"batch": batch, "limit": limit}
        for name in args.variants.split(","):
            r = time_variant(path, prompts, args.new_tokens, args.repeats, device, args, VARIANTS[name])
            if limit:
                r["fraction_of_limit"] = r["tokens_per_s"] / limit["tokens_per_s"]
            point[name] = r
            print(f"batch {batch} {name}: {r['tokens_per_s']:.0f} tokens/s"
                  + (f", {r['fraction_of_limit']:.1%} of the bandwidth limit" if limit else ""), flush=True)
            harness.write_json(args.out, result | {"points": result["points"] + [point]})
        result["points"].append(point)
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
