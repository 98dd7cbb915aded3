"""FP8 against bf16 decode in the embedded engine, side by side in one run (rollout.precision fp8 vs bf16): output
tokens/s at each batch size, with and without torch.compile, each as a fraction of its own bandwidth limit, and the
log-prob mismatch each precision brings against a bf16 trainer's forward of the same sequences. Each batch is also
run to one token (the prefill): `decode_tokens_per_s` counts the decode steps alone, the full run less that.

    PYTHONUNBUFFERED=1 python -m bench.rollout.fp8_decode --sizes 1.5B,7B --batches 64,256 --out fp8_decode.json

One engine per (size, variant) serves every batch size (graphs are captured per row bucket). The mismatch: the
sequences the first batch size generated at temperature 1 are scored by the HF model in bf16 with the original
weights (what the native trainer computes in bf16); per generated token |logp_train - logp_rollout|, its mean,
quantiles and max, and the k3 KL estimate, for the bf16 and the fp8 engine. First a kernel check: `fp8_linear`
against the dequantized product on the GPU.

`--smoke` runs a tiny model on the CPU, where the engine refuses fp8: it checks the script, bf16 only.
"""

from __future__ import annotations

import argparse
import gc
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
from rlflow.engines.models.fp8 import GROUPS, dequantize_rows, fp8_linear, quantize_rows
from rlflow.engines.models.hf import load_model
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend

VARIANTS = {"bf16": {}, "fp8": {"fp8": True}, "bf16_compile": {"compile": True}, "fp8_compile": {"fp8": True,
                                                                                                  "compile": True}}
PROJECTIONS = tuple(f".{m}.weight" for _, members, _ in GROUPS for m in members)


def kernel_check(device: str) -> dict:
    """fp8_linear against x_q @ w_q.T in fp32 (both dequantized), and against the bf16 product, at decode shapes."""
    out = {}
    for m in (1, 64, 256):
        g = torch.Generator(device=device).manual_seed(m)
        x = torch.randn(m, 3584, device=device, generator=g).to(torch.bfloat16)
        w = (torch.randn(4608, 3584, device=device, generator=g) * 0.02).to(torch.bfloat16)
        q, s = quantize_rows(w)
        xq, xs = quantize_rows(x)
        ref = dequantize_rows(xq, xs) @ dequantize_rows(q, s).T
        got = fp8_linear(x, q, s).float()
        exact = x.float() @ w.float().T
        out[f"m{m}"] = {"vs_dequantized_max_rel": float((got - ref).abs().max() / ref.abs().max()),
                        "vs_bf16_max_rel": float((got - exact).abs().max() / exact.abs().max())}
    return out


SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def _time_us(fn) -> float:
    """Median microseconds of `fn` on the GPU over 50 calls after 10 warm-ups."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _gemm_row(m: int, n: int, k: int, device: str) -> dict:
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
    q, s = quantize_rows(w)
    xq, xs = quantize_rows(x)
    row = {"bf16": _time_us(lambda: torch.nn.functional.linear(x, w))}
    for fast in (False, True):
        tag = "_fast" if fast else ""
        row[f"fp8{tag}"] = _time_us(lambda f=fast: torch._scaled_mm(
            xq, q.t(), scale_a=xs[:, None], scale_b=s[None], out_dtype=torch.bfloat16, use_fast_accum=f))
        row[f"fp8_swapped{tag}"] = _time_us(lambda f=fast: torch._scaled_mm(
            q, xq.t(), scale_a=s[:, None], scale_b=xs[None], out_dtype=torch.bfloat16, use_fast_accum=f))
    row["quantize_activation"] = _time_us(lambda: quantize_rows(x))
    return row


def gemm_timing(device: str, rows: tuple[int, ...] = (64, 256)) -> dict:
    """Each 7B projection's GEMM alone: bf16 F.linear against `_scaled_mm` row-wise on e4m3 (the activation's
    quantization timed apart), with fast accumulation off/on and with the operands swapped (W @ x.T, so that the
    weight's rows fill the kernel's M tiles at small batch). Microseconds."""
    out = {}
    for m in rows:
        for name, (n, k) in SHAPES_7B.items():
            out[f"m{m}_{name}"] = row = _gemm_row(m, n, k, device)
            print(f"gemm m={m} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    return out


def limit_for(model: torch.nn.Module, fp8: bool, batch: int, args, gbps: float) -> dict:
    """decode_limit with the weights counted as the variant stores them: e4m3 projections (1 byte, plus a 4-byte
    scale per row) for fp8."""
    limit = decode_limit(model, batch, args.prompt_len, args.new_tokens, gbps)
    if not fp8:
        return limit
    saved = sum(p.numel() * p.element_size() - (p.numel() + 4 * p.shape[0]) for n, p in model.named_parameters()
                if n.endswith(PROJECTIONS))
    steps = max(args.new_tokens - 1, 1)
    weight_bytes = limit["weight_bytes"] - saved
    seconds = limit["seconds"] - steps * saved / (gbps * 1e9)
    return limit | {"weight_bytes": weight_bytes, "bytes_per_step": limit["bytes_per_step"] - saved,
                    "seconds": seconds, "tokens_per_s": batch * steps / seconds}


def time_variant(path: Path, batches: list[int], vocab: int, device: str, args, settings: dict) -> tuple[dict, list]:
    e = TorchRolloutBackend(str(path), device=device, dtype=torch.bfloat16, batch_size=max(batches),
                            context_len=args.prompt_len + args.new_tokens + 16, kv_cache=kv_settings(args), **settings)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    out, sample = {"weight_bytes": e.weight_bytes()}, []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=g).tolist()
        t0 = time.perf_counter()
        e.generate(prompts, params, seed=0)  # warm-up: cache, graph capture, compilation
        harness.sync(device)
        warmup_s = time.perf_counter() - t0
        runs: list = []
        times = harness.timed(lambda p=prompts, r=runs: r.append(e.generate(p, params, seed=1)), args.repeats,
                              on=device)
        if not sample:
            sample = [(g.prompt_ids, g.output_ids, g.output_logprobs) for g in runs[-1][: args.mismatch_sequences]]
        # the same prompts to one token: the prefill (and the first token); what the full run takes beyond it is
        # the decode steps alone, which fp8 is for (the 32k-token prefill of a 256 x 128 batch is a fifth of a run)
        first = params.model_copy(update={"max_new_tokens": 1})
        prefill = harness.timed(lambda p=prompts, f=first: e.generate(p, f, seed=1), args.repeats, on=device)
        decode_s = statistics.median(times) - statistics.median(prefill)
        out[str(batch)] = {"warmup_s": warmup_s, "seconds": times, "prefill_seconds": prefill,
                           "tokens_per_s": batch * args.new_tokens / statistics.median(times),
                           "decode_tokens_per_s": batch * (args.new_tokens - 1) / decode_s if decode_s > 0 else None}
        if args.profile and device == "cuda" and batch == max(batches):
            short = params.model_copy(update={"max_new_tokens": args.profile_tokens})
            prof = harness.kernel_profile(lambda p=prompts, q=short: e.generate(p, q, seed=2))
            prof.pop("table", None)
            out[str(batch)]["profile"] = prof | {"new_tokens": args.profile_tokens}
    e.close()
    return out, sample


@torch.no_grad()
def mismatch(path: Path, samples: dict[str, list], device: str) -> dict:
    """Per precision: |logp_trainer - logp_rollout| over every generated token, the trainer being the HF model in
    bf16 on the original weights."""
    model = load_model(str(path), dtype=torch.bfloat16, device=device).eval()
    out = {}
    for name, seqs in samples.items():
        diffs, k3 = [], []
        for prompt, output, logps in seqs:
            ids = torch.tensor([prompt + output], device=device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            train = torch.log_softmax(logits, -1).gather(-1, torch.tensor(output, device=device)[:, None])[:, 0]
            rollout = torch.tensor(logps, device=device)
            diffs.append((train - rollout).abs().cpu())
            log_ratio = rollout - train  # log p_rollout / p_train
            k3.append((torch.exp(log_ratio) - 1 - log_ratio).cpu())
        d = torch.cat(diffs).numpy()
        out[name] = {"tokens": int(d.size), "mean": float(d.mean()), "p50": float(np.quantile(d, 0.5)),
                     "p90": float(np.quantile(d, 0.9)), "p99": float(np.quantile(d, 0.99)), "max": float(d.max()),
                     "k3_kl_mean": float(torch.cat(k3).mean())}
    del model
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1.5B,7B")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--mismatch-sequences", type=int, default=32)
    ap.add_argument("--skip-mismatch", action="store_true")
    ap.add_argument("--gemm-timing", action="store_true", help="also time the 7B projections' GEMMs alone")
    ap.add_argument("--profile", action="store_true", help="also record the GPU kernels at the largest batch")
    ap.add_argument("--profile-tokens", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-fraction", type=float, default=0.5, help="of free memory (the trainer's model loads after)")
    ap.add_argument("--out", default="fp8_decode.json")
    harness.add_smoke(ap)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.sizes, args.batches, args.new_tokens, args.prompt_len, args.repeats = "smoke", "2,4", 8, 8, 1
        args.variants = "bf16"  # the engine refuses fp8 on the CPU
    result: dict = harness.report_header(__spec__.name, None) | {
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats}
    if device == "cuda":
        result["kernel_check"] = kernel_check(device)
        print(f"kernel check: {result['kernel_check']}", flush=True)
        if args.gemm_timing:
            result["gemm_us"] = gemm_timing(device)
            harness.write_json(args.out, result)
    gbps = copy_bandwidth() if device == "cuda" else None
    result["copy_gb_per_s"] = gbps
    batches = [int(b) for b in args.batches.split(",")]
    result["sizes"] = {}
    for size in args.sizes.split(","):
        path = build_model(size, Path(tempfile.mkdtemp(prefix="rlflow-fp8-")) / "model", device)
        vocab = SHAPES[size]["vocab_size"]
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        point: dict = {}
        samples = {}
        for name in args.variants.split(","):
            r, sample = time_variant(path, batches, vocab, device, args, VARIANTS[name])
            gc.collect()  # the engine's weights and cache, before the next one loads
            if device == "cuda":
                torch.cuda.empty_cache()
            samples.setdefault(name.removesuffix("_compile"), sample)
            for batch in batches:
                if gbps:
                    limit = limit_for(meta, "fp8" in name, batch, args, gbps)
                    r[str(batch)]["fraction_of_limit"] = r[str(batch)]["tokens_per_s"] / limit["tokens_per_s"]
                    r[str(batch)]["limit_tokens_per_s"] = limit["tokens_per_s"]
                print(f"{size} {name} batch {batch}: {r[str(batch)]['tokens_per_s']:.0f} tokens/s"
                      + (f", {r[str(batch)]['fraction_of_limit']:.1%} of its limit" if gbps else ""), flush=True)
            point[name] = r
            result["sizes"][size] = point
            harness.write_json(args.out, result)
        for batch in batches:
            for mode in ("", "_compile"):
                if f"bf16{mode}" in point and f"fp8{mode}" in point:
                    fp8, bf16 = point[f"fp8{mode}"][str(batch)], point[f"bf16{mode}"][str(batch)]
                    point.setdefault("speedup", {})[f"{batch}{mode}"] = fp8["tokens_per_s"] / bf16["tokens_per_s"]
                    if fp8["decode_tokens_per_s"] and bf16["decode_tokens_per_s"]:
                        point.setdefault("decode_speedup", {})[f"{batch}{mode}"] = (
                            fp8["decode_tokens_per_s"] / bf16["decode_tokens_per_s"])
        print(f"{size} fp8/bf16: {point.get('speedup')}; decode steps alone: {point.get('decode_speedup')}",
              flush=True)
        if args.skip_mismatch:
            continue
        point["mismatch_vs_bf16_trainer"] = mismatch(path, samples, device)
        print(f"{size} mismatch: {point['mismatch_vs_bf16_trainer']}", flush=True)
        harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
