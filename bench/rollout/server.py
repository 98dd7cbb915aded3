"""Embedded rollout server throughput on CPU: continuous batching vs one request at a time, side by side.

    python -m bench.rollout.server [--requests 64] [--max-new-tokens 32] [--repeats 3] [--json out.json]

One TorchRolloutBackend serves HTTP on an ephemeral port (a tiny random Llama). The same requests are sent
(a) one at a time, each waiting for the previous answer, and (b) all at once from an asyncio client, so
the engine batches them continuously. Output tokens are fixed (ignore_eos), so both modes do the same work.
The modes alternate `--repeats` times; prints each mode's median output tokens/s and `ratio: X`
(concurrent / sequential).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench import harness
from rlflow.engines.core.config import ModelConfig
from rlflow.engines.models.hf import build_tiny_model
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend


def _bodies(n: int, max_new_tokens: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 12))),
             "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True,
                                 "sampling_seed": i}} for i in range(n)]


async def _run(url: str, bodies: list[dict], concurrent: bool) -> tuple[int, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=len(bodies))) as c:
        async def one(body: dict) -> int:
            r = await c.post("/generate", json=body)
            r.raise_for_status()
            return r.json()["meta_info"]["completion_tokens"]

        t0 = time.perf_counter()
        if concurrent:
            tokens = sum(await asyncio.gather(*(one(b) for b in bodies)))
        else:
            tokens = 0
            for b in bodies:
                tokens += await one(b)
        return tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cfg = ModelConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_layers=args.layers,
                          num_heads=4, num_kv_heads=4, max_seq_len=64 + args.max_new_tokens)
        path = build_tiny_model(cfg, Path(tmp) / "model", seed=0)
        backend = TorchRolloutBackend(str(path), threads=args.threads, batch_size=args.requests)
        url = backend.start_server()
        bodies = _bodies(args.requests, args.max_new_tokens)
        asyncio.run(_run(url, bodies[:4], concurrent=True))  # warm-up
        rates: dict[str, list[float]] = {"sequential": [], "concurrent": []}
        for _ in range(args.repeats):
            for mode in ("sequential", "concurrent"):
                tokens, seconds = asyncio.run(_run(url, bodies, concurrent=mode == "concurrent"))
                rates[mode].append(tokens / seconds)
                print(f"{mode:>10}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s", flush=True)
        backend.close()

    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["concurrent"] / med["sequential"]
    print(f"median tokens/s: sequential {med['sequential']:.0f}, concurrent {med['concurrent']:.0f}")
    print(f"ratio: {ratio:.2f}")
    if args.json:
        harness.write_json(args.json, harness.report_header(__spec__.name, None) | {
            "args": vars(args), "tokens_per_s": rates, "median": med, "ratio": ratio})


if __name__ == "__main__":
    main()
