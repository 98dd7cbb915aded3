"""What rollout.true_on_policy costs: the embedded engine's decode and the native trainer's train step with the
batch-invariant ops (engines/models/invariant.py) against the default ops, side by side in one run, and the largest
|train - rollout| log-prob difference of each (0 with the mode).

    PYTHONUNBUFFERED=1 python -m bench.rollout.true_on_policy --size 1.5B --batch 256 --new-tokens 256 \
        --out true_on_policy.json

Per mode: one engine generates `batch` sequences of `new-tokens` tokens (ignore_eos) from short prompts (output
tokens/s over the whole generate, the faster of two), then two train steps (forward + backward + optimizer step,
packed micro-batches) on those sequences: the first gives the log-prob difference, the second's tokens/s counts.
Compute dtype: bf16 on a GPU, fp32 on the CPU, the same on both sides. First, `op_checks`: each invariant op's rows
alone against in a batch, on this device (which op breaks, if the end-to-end difference is not 0).

`--smoke` runs a toy Qwen2 on the CPU: it checks the script, and on 2 cores gives the CPU ratio docs/rollout.md
quotes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench import harness
from bench.rollout.gpu import build_model
from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.train.torch_backend import TorchTrainBackend


def op_checks(dev: str, dtype: torch.dtype, hidden: int = 1536, vocab: int = 151936) -> dict:
    """Each invariant op on this device and dtype: does a row give the same bits alone, at another place in
    another batch, and in the full batch? (What the end-to-end 0 rests on, op by op: if the end-to-end difference
    is not 0, this says which op to look at.)"""
    from rlflow.engines.models import invariant

    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev, dtype)

    def rows_agree(fn, x: torch.Tensor) -> bool:
        full = fn(x)
        return all(torch.equal(fn(x[i:i + 1].clone())[0], full[i]) for i in (0, 1, 63, 64, x.shape[0] - 1)) and \
            torch.equal(fn(x[37:].clone()), full[37:])

    w, norm_w = rand(4 * hidden, hidden), rand(hidden)
    checks = {"linear": rows_agree(lambda x: invariant.linear(x, w), rand(300, hidden)),
              "rms_norm": rows_agree(lambda x: invariant.rms_norm(x, norm_w, 1e-6), rand(300, hidden)),
              "logsumexp": rows_agree(invariant.logsumexp, rand(300, vocab).float())}
    heads, kv, d, length = 12, 2, 128, 300
    q, k, v = rand(1, heads, length, d), rand(1, kv, length, d), rand(1, kv, length, d)
    prefill = invariant.attention(q, k, v, torch.arange(1, length + 1, device=dev)[None], d ** -0.5)
    same = True
    for pos in (0, 63, 64, 200, length - 1):
        mates = rand(3, heads, 1, d), rand(3, kv, length, d), rand(3, kv, length, d)
        out = invariant.attention(torch.cat([mates[0], q[:, :, pos:pos + 1]]), torch.cat([mates[1], k]),
                                  torch.cat([mates[2], v]),
                                  torch.tensor([[5], [100], [300], [pos + 1]], device=dev), d ** -0.5)
        same &= torch.equal(out[3, :, 0], prefill[0, :, pos])
    checks["attention"] = bool(same)
    return checks


def op_timings(dev: str, dtype: torch.dtype, batch: int, length: int, hidden: int = 1536, ffn: int = 8960,
               vocab: int = 151936, heads: int = 12, kv_heads: int = 2, d: int = 128) -> dict:
    """Milliseconds of each invariant op beside the default op it replaces, at the shapes of one decode step
    (`batch` rows, `length` keys) and of one trainer micro-batch (16,384 tokens in samples of `length`): where the
    mode's cost goes."""
    import torch.nn.functional as F

    from rlflow.engines.models import invariant

    def ms(fn) -> float:
        return 1e3 * min(harness.timed(fn, 3, warmup=1, on=dev))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype)

    w, head, norm_w = rand(ffn, hidden), rand(vocab, hidden), rand(hidden)
    tokens, samples = 16384, max(1, 16384 // length)
    out = {}
    for name, rows in (("decode", batch), ("train", tokens)):
        x = rand(rows, hidden)
        out[f"{name}_linear_{hidden}x{ffn}"] = (ms(lambda x=x: invariant.linear(x, w)), ms(lambda x=x: F.linear(x, w)))
        out[f"{name}_rms_norm"] = (ms(lambda x=x: invariant.rms_norm(x, norm_w, 1e-6)),
                                   ms(lambda x=x: F.rms_norm(x, (hidden,), norm_w, 1e-6)))
    x = rand(batch, hidden)
    out["decode_lm_head"] = (ms(lambda: invariant.linear(x, head)), ms(lambda: F.linear(x, head)))
    z = rand(batch, vocab).float()
    out["decode_logsumexp"] = (ms(lambda: invariant.logsumexp(z)), ms(lambda: torch.logsumexp(z, -1)))
    q, k, v = rand(batch, heads, 1, d), rand(batch, kv_heads, length, d), rand(batch, kv_heads, length, d)
    seen = torch.full((batch, 1), length, device=dev)
    out["decode_attention"] = (ms(lambda: invariant.attention(q, k, v, seen, d ** -0.5)),
                               ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
    q, k, v = rand(samples, heads, length, d), rand(samples, kv_heads, length, d), rand(samples, kv_heads, length, d)
    out["train_attention"] = (ms(lambda: invariant.attention(q, k, v, None, d ** -0.5)),
                              ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))
    return {name: {"invariant_ms": a, "default_ms": b, "ratio": a / b} for name, (a, b) in out.items()}


def measure(model: Path, exact: bool, batch: int, new_tokens: int, dev: str, threads: int) -> dict:
    """Decode tokens/s, train-step tokens/s and the max |train - rollout| log-prob difference of one mode."""
    dtype, precision = (torch.bfloat16, "bf16") if dev == "cuda" else (torch.float32, "fp32")
    rollout = TorchRolloutBackend(str(model), device=dev, dtype=dtype, batch_size=batch, true_on_policy=exact,
                                  threads=threads)
    prompts = [[3 + i % 10, 4, 5 + i % 7] for i in range(batch)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    try:
        decode_s = float("inf")
        for _ in range(2):  # the first also warms up (thread pools, allocator, graphs): the faster one counts
            t0 = time.perf_counter()
            gens = rollout.generate(prompts, params, seed=1)
            decode_s = min(decode_s, time.perf_counter() - t0)
            harness.say(f"true_on_policy={exact}: generate {time.perf_counter() - t0:.2f} s")
    finally:
        rollout.close()
        del rollout
    width = max(len(g.prompt_ids) + len(g.output_ids) for g in gens)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask, loss, old = torch.zeros(batch, width, dtype=torch.long), torch.zeros(batch, width), torch.zeros(batch, width)
    for i, g in enumerate(gens):
        seq, p = g.prompt_ids + g.output_ids, len(g.prompt_ids)
        ids[i, :len(seq)], mask[i, :len(seq)], loss[i, p:len(seq)] = torch.tensor(seq), 1, 1.0
        old[i, p:len(seq)] = torch.tensor(g.output_logprobs)
    train = TorchTrainBackend(str(model), TrainConfig(device=dev, precision=precision, micro_batch_tokens=16384,
                                                      threads=threads),
                              AlgorithmConfig(kl_coef=0.0), true_on_policy=exact)
    data = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss, "old_logprobs": old,
            "advantages": torch.randn(batch)}
    t0 = time.perf_counter()
    metrics = train.train_step(data)  # the rollout's weights: its log-prob difference is the mode's
    harness.say(f"true_on_policy={exact}: first train step {time.perf_counter() - t0:.2f} s, "
                f"max |train - rollout| {metrics['rollout_logprob_diff_max']}")
    t0 = time.perf_counter()
    train.train_step(data)  # warm (optimizer state made, kernels loaded): the one timed
    harness.sync(dev)
    train_s = time.perf_counter() - t0
    tokens = int(mask.sum())
    return {"true_on_policy": exact, "decode_tokens_per_s": batch * new_tokens / decode_s, "decode_s": decode_s,
            "train_tokens_per_s": tokens / train_s, "train_s": train_s, "tokens": tokens,
            "logprob_diff_max": metrics["rollout_logprob_diff_max"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.5B")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", default="true_on_policy.json")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine and the trainer")
    parser.add_argument("--modes", default="default,exact", help="default, exact (rollout.true_on_policy) or both")
    parser.add_argument("--op-timings", action="store_true", help="also time each invariant op beside the default")
    harness.add_smoke(parser)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    if not modes or any(m not in ("default", "exact") for m in modes):
        parser.error(f"--modes {args.modes!r}: expected default, exact or default,exact")
    dev = "cpu" if args.smoke else harness.device()
    size, batch, new = ("smoke", 16, 16) if args.smoke else (args.size, args.batch, args.new_tokens)
    results = harness.report_header(__spec__.name, argv) | {"size": size, "batch": batch, "new_tokens": new,
                                                            "modes": []}
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    results["op_checks"] = op_checks(dev, dtype, *((64, 512) if args.smoke else (1536, 151936)))
    harness.say(f"row-invariance of each op ({dev}, {dtype}): {results['op_checks']}")
    if args.op_timings:
        results["op_timings"] = op_timings(dev, dtype, batch, 3 + new, *((64, 128, 512, 4, 2, 16) if args.smoke
                                                                         else ()))
        for name, row in results["op_timings"].items():
            harness.say(f"{name}: {row}")
        harness.write_json(args.out, results)
    with tempfile.TemporaryDirectory(prefix="rlflow-top-") as tmp:
        model = build_model(size, Path(tmp) / size, "cpu")
        for exact in (m == "exact" for m in modes):
            row = measure(model, exact, batch, new, dev, args.threads)
            results["modes"].append(row)
            harness.say(str(row))
            harness.write_json(args.out, results)
    if len(results["modes"]) != 2:
        return 0
    base, top = results["modes"]
    results["decode_ratio"] = top["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    results["train_ratio"] = top["train_tokens_per_s"] / base["train_tokens_per_s"]
    harness.say(f"true_on_policy / default: decode {results['decode_ratio']:.3f}, train {results['train_ratio']:.3f}")
    harness.write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
