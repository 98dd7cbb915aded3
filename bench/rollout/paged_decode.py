"""Decode attention over a paged KV cache on one GPU: our Triton kernel against what torch offers, same inputs.

    PYTHONUNBUFFERED=1 python -m bench.rollout.paged_decode --out paged_decode.json

For each (batch, context) case, keys and values of every sequence live in pages of a shared pool, scattered
in random order (as they are after requests come and go). Compared, each timed as a CUDA graph replay:
- `triton`: `engines/models/paged_attention_triton.py`, reading the pages in place;
- `gather_sdpa`: gather every sequence's pages into a contiguous copy, then masked SDPA (the torch reference);
- `contiguous_sdpa`: the engine's layout before the paged cache, one [slots, kv_heads, max_len, head_dim]
  block, masked SDPA over the slots in place (what the paged cache must not be slower than).
The bandwidth figure is the bytes of keys and values each case must read once (the live tokens only) per
second, against the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, Qwen2Config

from bench import harness
from bench.rollout.gpu import SHAPES, copy_bandwidth
from rlflow.engines.models.decoder import DecoderLM
from rlflow.engines.models.paged_attention import reference_paged_decode_attention as reference


def timed(fn, repeats: int = 20) -> float:
    """Median seconds of one replay of `fn` captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[3:])


def case(batch: int, context: int, heads: int, kv: int, dim: int, page: int, ragged: bool) -> dict:
    from rlflow.engines.models.paged_attention_triton import paged_decode_attention_triton  # triton: GPU machines

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(batch * 7 + context)
    lengths = (torch.randint(context // 2, context + 1, (batch,), generator=g) if ragged
               else torch.full((batch,), context)).to(torch.int32)
    max_pages = -(-context // page)
    pages_needed = [int(-(-n // page)) for n in lengths.tolist()]
    pool_pages = sum(pages_needed) + 8
    order = torch.randperm(pool_pages, generator=g)
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = order[at:at + n]
        at += n
    k_pool = torch.randn(pool_pages, kv, page, dim, dtype=dt, device=dev)
    v_pool = torch.randn_like(k_pool)
    q = torch.randn(batch, heads, dim, dtype=dt, device=dev)
    table, lengths = table.to(dev), lengths.to(dev)
    scale = dim ** -0.5

    ours = paged_decode_attention_triton(q, k_pool, v_pool, table, lengths, scale)
    ref = reference(q, k_pool, v_pool, table, lengths, scale)
    err = float((ours.float() - ref.float()).abs().max())
    # fp32 exactness of the kernel (the parity the engine keeps: <= 1e-5 against HF in fp32)
    q32, k32, v32 = q.float(), k_pool.float(), v_pool.float()
    err32 = float((paged_decode_attention_triton(q32, k32, v32, table, lengths, scale)
                   - reference(q32, k32, v32, table, lengths, scale)).abs().max())

    contiguous_k = torch.randn(batch, kv, max_pages * page, dim, dtype=dt, device=dev)
    contiguous_v = torch.randn_like(contiguous_k)
    visible = (torch.arange(max_pages * page, device=dev)[None] < lengths[:, None])[:, None, None]
    grouped = q.view(batch, kv, heads // kv, dim)

    def contiguous():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(grouped, contiguous_k, contiguous_v, attn_mask=visible, scale=scale)

    live_bytes = 2 * int(lengths.sum()) * kv * dim * 2
    seconds = {
        "triton": timed(lambda: paged_decode_attention_triton(q, k_pool, v_pool, table, lengths, scale)),
        "gather_sdpa": timed(lambda: reference(q, k_pool, v_pool, table, lengths, scale)),
        "contiguous_sdpa": timed(contiguous),
    }
    return {"batch": batch, "context": context, "ragged": ragged, "heads": heads, "kv_heads": kv, "head_dim": dim,
            "page": page, "max_abs_err_bf16": err, "max_abs_err_fp32": err32, "live_kv_bytes": live_bytes,
            "seconds": seconds, "gb_per_s": {k: live_bytes / v / 1e9 for k, v in seconds.items()}}


def decode_step(batch: int = 256, span: int = 512, page: int = 16) -> dict:
    """One decode step of the engine (Qwen2-0.5B shape, bf16, paged cache: each row's pages scattered over the
    pool) captured as a CUDA graph, eager against torch.compile'd: how much of a step is small unfused kernels
    (norms, rotary, SwiGLU, adds)."""
    cfg = Qwen2Config(tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=4096, **SHAPES["0.5B"])
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    lm = DecoderLM(model)
    per_row = -(-span // page)
    cache = lm.new_cache(batch, span, num_pages=batch * per_row + 1, page_size=page)
    order = (torch.randperm(batch * per_row) + 1).view(batch, per_row).tolist()  # page 0 is scratch
    for row, pages in enumerate(order):
        cache.set_row(row, pages)
    cache.flush()
    out = torch.empty(batch, lm.vocab_size, dtype=torch.bfloat16, device="cuda")
    tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    positions = torch.randint(span // 2, span, (batch,), device="cuda")
    result = {"batch": batch, "span": span, "page": page}
    with torch.no_grad():
        result["eager_graph_s"] = timed(lambda: lm.decode_rows(cache, tokens, positions, cache.max_pages, out))
        eager = out.clone()
        compiled = torch.compile(lm.decode_rows, dynamic=False)
        result["compiled_graph_s"] = timed(lambda: compiled(cache, tokens, positions, cache.max_pages, out))
        result["max_abs_logit_diff"] = float((out.float() - eager.float()).abs().max())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = 2 * int(positions.sum() + batch) * cfg.num_hidden_layers * cfg.num_key_value_heads * 64 * 2
    result["bytes"] = weight_bytes + kv_bytes
    return result


def inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor):
    """The engine's torch path for unfiltered rows (ContinuousBatchEngine._sample): log-softmax, exp, float64
    cumulative sum, one searchsorted per row."""
    logp = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    cdf = logp.exp().cumsum(-1, dtype=torch.float64)
    tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=logits.shape[1] - 1)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def sampling(batch: int = 256, vocab: int = 151936) -> dict:
    """The Triton exponential-race sampler (engines/models/sampling_triton.py): exact distribution, exact
    log-probabilities, greedy rows, per-row determinism, and its time against the torch inverse-CDF path."""
    from rlflow.engines.models.sampling_triton import race_sample  # triton: GPU machines

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    # distribution: 2^18 rows of the same 10 logits at T=0.7, each with its own seed
    draws = 1 << 18
    z = torch.randn(10, generator=g) * 2
    logits = z.repeat(draws, 1).to(dev)
    temperature = torch.full((draws,), 0.7, device=dev)
    seeds = torch.randint(0, 2**62, (draws,), generator=g).to(dev)
    tokens, logprobs = race_sample(logits, temperature, seeds)
    want = torch.softmax(z / 0.7, -1)
    freq = torch.bincount(tokens.cpu(), minlength=10).double() / draws
    sigma = (want * (1 - want) / draws).sqrt()
    exact = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    again, _ = race_sample(logits, temperature, seeds)
    perm = torch.randperm(draws, generator=g).to(dev)
    shuffled, _ = race_sample(logits[perm], temperature[perm], seeds[perm])
    greedy, greedy_logp = race_sample(logits[:4], torch.zeros(4, device=dev), seeds[:4])
    result = {
        "max_freq_dev_sigmas": float(((freq - want.double()) / sigma.double()).abs().max()),
        "max_abs_logprob_err": float((logprobs - exact).abs().max()),
        "deterministic": bool(torch.equal(tokens, again)),
        "batch_independent": bool(torch.equal(tokens[perm], shuffled)),
        "greedy_is_argmax": bool((greedy.cpu() == z.argmax()).all()),
        "greedy_logprob_err": float((greedy_logp.cpu() - torch.log_softmax(z, -1)[z.argmax()]).abs().max()),
    }
    big = torch.randn(batch, vocab, device=dev, dtype=torch.bfloat16) * 3
    temps = torch.full((batch,), 0.9, device=dev)
    row_seeds = torch.randint(0, 2**62, (batch,), device=dev)
    uniforms = torch.rand(batch, device=dev, dtype=torch.float64)
    result |= {"batch": batch, "vocab": vocab,
               "triton_race_s": timed(lambda: race_sample(big, temps, row_seeds)),
               "torch_inverse_cdf_s": timed(lambda: inverse_cdf(big, uniforms, temps))}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--out", default="paged_decode.json")
    parser.add_argument("--sections", default="attention,step,sampling")
    args = parser.parse_args(argv)
    link = copy_bandwidth()
    results = harness.report_header(__spec__.name, argv) | {"copy_gb_per_s": link, "cases": []}
    if "sampling" in args.sections:
        results["sampling"] = sampling()
        print(json.dumps(results["sampling"]), flush=True)
    if "step" in args.sections:
        step = decode_step(page=args.page)
        step["ideal_s_at_copy_bw"] = step["bytes"] / (link * 1e9)
        results["decode_step"] = step
        print(json.dumps(step), flush=True)
    if "attention" not in args.sections:
        harness.write_json(args.out, results)
        return 0
    shapes = {"0.5B": (14, 2, 64), "1.5B": (12, 2, 128), "7B": (28, 4, 128)}
    for name, (heads, kv, dim) in shapes.items():
        for batch, context in [(256, 512), (256, 1280), (64, 8448), (8, 32768), (512, 1280)]:
            for ragged in (False, True):
                row = case(batch, context, heads, kv, dim, args.page, ragged) | {"shape": name}
                row["fraction_of_copy_bw"] = {k: v / link for k, v in row["gb_per_s"].items()}
                results["cases"].append(row)
                print(json.dumps({k: row[k] for k in ("shape", "batch", "context", "ragged", "max_abs_err_bf16",
                                                      "max_abs_err_fp32", "gb_per_s")}), flush=True)
    harness.write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
