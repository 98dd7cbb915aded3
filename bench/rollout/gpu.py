"""Rollout throughput on one GPU: our embedded engine against `transformers` generate, same weights.

    PYTHONUNBUFFERED=1 python -m bench.rollout.gpu --out gpu_rollout.json

A random-weight model of Qwen2-0.5B's shape (bf16, tied embeddings, full 151936 vocab) is saved as an HF
directory with the demo's char tokenizer (prompts are random token ids, so the tokenizer only has to load).
Both sides generate `--new-tokens` tokens for each of `--batch` prompts of `--prompt-len` random ids, with
temperature 1.0 and no top-k/top-p, every request running to full length (ignore_eos / min_new_tokens).
Each side is warmed up once with the full batch, then timed `--repeats` times; the median counts.

The decode limit is what memory bandwidth allows: each decode step reads every weight once plus the keys
and values the paged cache actually holds for the running sequences (each row's own length, not a padded
span); at the measured device-to-device copy bandwidth that gives the fewest seconds per step, hence the
most output tokens/s (prefill not counted, so the limit is generous).

`--sweep` times batch x new-token points (default batch 64/256/512, prompt 256 + 1,024 and + 8,192 new
tokens), each with its fraction of the limit, its preemptions and (unless --skip-hf, or past
--hf-max-new-tokens) HF generate at the same point. `--shared-prefix` times a GRPO group (one
`--group-prompt-len` prompt, n = 8): the prefill with and without prompt sharing (`rollout.kv_cache
.share_prompts`), and the KV pages the group takes with `--group-new-tokens` responses, against one prompt's
pages plus 8 responses'.

`--long-context` runs `--long-batch` sequences from a `--prompt-len` prompt to the model's 32,768 positions
(`--long-context-len`; smoke: a 4,480-token prompt to 4,608); `--max-positions` gives the model more (65,536: 64k).

`--smoke` runs a tiny model on the CPU to check the script itself (sweeps scaled down).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

from bench import harness
from rlflow.engines.core.config import KVCacheConfig
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models.hf import build_char_tokenizer, load_model
from rlflow.engines.models.paged_attention import uses_fast_kernel
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend

MAX_POSITIONS = 32768  # the bench models' context (Qwen2-0.5B/1.5B's own)
SHAPES = {
    "0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    "1.5B": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2),
    "7B": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,  # Qwen2.5-7B
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    # Qwen3-30B-A3B's layer (128 experts of width 768, top-8, hidden 2048, 32 q / 4 kv heads of 128) in 12 of
    # its 48 layers: 16 GB of weights (61 GB whole), which a 64 GB disk holds; per-layer figures carry over
    "30B-A3B-12L": dict(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_hidden_layers=12,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False),
    "smoke-moe": dict(arch="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}


def build_model(size: str, out: Path, device: str, max_positions: int = MAX_POSITIONS) -> Path:
    """Random Qwen2 (or, with arch qwen3_moe, Qwen3-MoE) of `size` in bf16 (HF directory) with the char tokenizer
    beside it; `max_positions`: its max_position_embeddings."""
    shape = dict(SHAPES[size])
    config_class = Qwen3MoeConfig if shape.pop("arch", "qwen2") == "qwen3_moe" else Qwen2Config
    cfg = config_class(**{"tie_word_embeddings": True, "rope_theta": 1e6, "max_position_embeddings": max_positions,
                          **shape})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return out


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy, bytes read plus bytes written (median of 10)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times[2:]) / 1e9


def decode_limit(model: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int, gb_per_s: float) -> dict:
    """Output tokens/s if every decode step only had to read the weights and the live KV cache once (each
    sequence's own tokens: what the paged cache holds and its attention reads)."""
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    experts = getattr(cfg, "num_experts", None)
    if experts:  # MoE: a step reads only the experts its batch's tokens go to (uniform routing, expected count)
        expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
        touched = 1 - (1 - cfg.num_experts_per_tok / experts) ** batch
        weight_bytes -= expert_bytes * (1 - touched)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * element  # k and v
    # step t (0-based) of decode attends over prompt_len + t + 1 positions for every sequence
    steps = max(new_tokens - 1, 1)  # the first token comes from prefill
    kv_bytes = batch * kv_per_token * (steps * (prompt_len + 1) + steps * (steps - 1) // 2)
    seconds = (steps * weight_bytes + kv_bytes) / (gb_per_s * 1e9)
    return {"weight_bytes": weight_bytes, "kv_bytes_mean_per_step": kv_bytes / steps,
            "bytes_per_step": weight_bytes + kv_bytes / steps, "seconds": seconds,
            "tokens_per_s": batch * steps / seconds}


def kv_settings(args: argparse.Namespace, **changes) -> KVCacheConfig:
    """The engine's paged cache for this run (the bench's flags, then `changes`)."""
    return KVCacheConfig(page_size=args.page_size, memory_fraction=args.kv_fraction, **changes)


def time_ours(path: Path, prompts: list[list[int]], new_tokens: int, repeats: int, device: str,
              profile: bool, kv: KVCacheConfig | None = None, warmup_tokens: int | None = None,
              compile: bool = False, fused: bool = True, profile_tokens: int = 32) -> dict:
    backend = TorchRolloutBackend(str(path), device=device, dtype=torch.bfloat16, batch_size=len(prompts),
                                  context_len=len(prompts[0]) + new_tokens + 16, kv_cache=kv, compile=compile)
    backend.engine.lm.use_fused(fused)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    t0 = time.perf_counter()
    warmup = params.model_copy(update={"max_new_tokens": warmup_tokens or new_tokens})
    backend.generate(prompts, warmup, seed=0)  # warm-up: cache allocation, graph capture, kernels
    harness.sync(device)
    warmup_s = time.perf_counter() - t0
    runs = []
    times = harness.timed(lambda: runs.append(backend.generate(prompts, params, seed=1 + len(runs))), repeats,
                          on=device)
    gens = runs[-1]
    tokens = sum(len(g.output_ids) for g in gens)
    assert tokens == len(prompts) * new_tokens, tokens
    out = {"fused_groups": backend.engine.lm.fused_groups, "warmup_s": warmup_s,
           "warmup_tokens": warmup.max_new_tokens, "seconds": times, "output_tokens": tokens,
           "tokens_per_s": tokens / statistics.median(times), "kv": backend.engine.stats(),
           "paged_kernel": "triton" if uses_fast_kernel(torch.device(device), backend.engine.lm.head_dim) else "torch",
           "sample": [(g.prompt_ids, g.output_ids, g.output_logprobs) for g in gens[:8]]}
    if profile and device == "cuda":
        out["profile"] = harness.kernel_profile(lambda: backend.generate(prompts, params.model_copy(
            update={"max_new_tokens": profile_tokens}), seed=9))
        out["profile"].pop("table", None)
        out["profile"]["new_tokens"] = profile_tokens
    backend.close()
    return out


def shared_prefix(path: Path, args: argparse.Namespace, device: str, vocab: int) -> dict:
    """A GRPO group of 8 on one prompt: prefill seconds (max_new_tokens 1, median of --repeats after a
    warm-up) and the KV pages the group takes with --group-new-tokens responses, prompt sharing on and off."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, vocab, (args.group_prompt_len,), generator=g).tolist()
    group, new = 8, args.group_new_tokens
    pages = lambda n: -(-n // args.page_size)  # noqa: E731
    result: dict = {"group": group, "prompt_len": len(prompt), "new_tokens": new, "page_size": args.page_size,
                    "budget_pages": pages(len(prompt)) + group * pages(new)}
    for share in (True, False):
        backend = TorchRolloutBackend(str(path), device=device, dtype=torch.bfloat16, batch_size=group,
                                      context_len=len(prompt) + new + 16,
                                      kv_cache=kv_settings(args, share_prompts=share), compile=args.compile)
        times = prefill_times(backend, prompt, group, args.repeats, device)
        backend.engine.drop_cache()  # a fresh pool: its peak is this group's
        full = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, n=group)
        gens = backend.generate([prompt], full, seed=11)
        assert all(len(x.output_ids) == new for x in gens)
        stats = backend.engine.stats()
        page_bytes = backend.engine.lm.page_bytes(args.page_size)
        result["shared" if share else "unshared"] = {
            "prefill_seconds": times, "prefill_s": statistics.median(times), "kv_pages_peak": stats["kv_pages_peak"],
            "kv_bytes_peak": stats["kv_pages_peak"] * page_bytes, "num_preemptions": stats["num_preemptions"],
            "pages_vs_budget": stats["kv_pages_peak"] / result["budget_pages"]}
        backend.close()
    result["prefill_speedup"] = result["unshared"]["prefill_s"] / result["shared"]["prefill_s"]
    result["kv_saving"] = result["unshared"]["kv_pages_peak"] / result["shared"]["kv_pages_peak"]
    return result


def prefill_times(backend: TorchRolloutBackend, prompt: list[int], group: int, repeats: int, device: str
                  ) -> list[float]:
    """Seconds of each of `repeats` prefills of a group of `group` on `prompt` (one new token), after a warm-up."""
    one = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True, n=group)
    seeds = iter(range(repeats + 1))
    return harness.timed(lambda: backend.generate([prompt], one, seed=next(seeds)), repeats, warmup=1, on=device)


def sweep(path: Path, args: argparse.Namespace, device: str, vocab: int, gbps: float | None, points: list[dict],
          save: Callable[[], None]) -> None:
    """Decode tokens/s at every batch x new-token point (prompt --prompt-len), with the bandwidth-limit
    fraction on CUDA and HF generate at the same point when asked; each point appended to `points` and saved
    as it ends (a run cut short by its time limit keeps the points it finished)."""
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    for new_tokens in args.sweep_new_tokens:
        for batch in args.sweep_batches:
            g = torch.Generator().manual_seed(batch)
            prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=g).tolist()
            point = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": new_tokens}
            # a short warm-up (graphs of later spans are captured in the timed run with the torch attention path)
            ours = time_ours(path, prompts, new_tokens, args.sweep_repeats, device, False, kv_settings(args),
                             warmup_tokens=min(new_tokens, 256), compile=args.compile)
            ours.pop("sample")
            point["ours"] = ours
            if gbps:
                limit = decode_limit(meta, batch, args.prompt_len, new_tokens, gbps)
                point["decode_limit"] = limit
                point["fraction_of_limit"] = ours["tokens_per_s"] / limit["tokens_per_s"]
            if not args.skip_hf and new_tokens <= args.hf_max_new_tokens:
                point["hf"], model = time_hf(path, prompts, new_tokens, args.sweep_repeats, device)
                point["ratio"] = ours["tokens_per_s"] / point["hf"]["tokens_per_s"]
                del model
                if device == "cuda":
                    torch.cuda.empty_cache()
            print(f"sweep batch {batch} new {new_tokens}: {ours['tokens_per_s']:.0f} tokens/s"
                  + (f", {100 * point['fraction_of_limit']:.1f}% of limit" if "fraction_of_limit" in point else "")
                  + (f", {point['ratio']:.2f}x HF" if "ratio" in point else "")
                  + f", preemptions {ours['kv']['num_preemptions']}", flush=True)
            points.append(point)
            save()


def time_hf(path: Path, prompts: list[list[int]], new_tokens: int, repeats: int, device: str
            ) -> tuple[dict, torch.nn.Module]:
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN's SDPA is far slower here; flash/efficient are used
    model = load_model(path, dtype=torch.bfloat16, device=device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    outs = []
    with torch.no_grad():
        warmup_s = harness.timed(lambda: model.generate(ids, **kwargs), 1, on=device)[0]
        times = harness.timed(lambda: outs.append(model.generate(ids, **kwargs)), repeats, on=device)
    out = outs[-1]
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    assert tokens == len(prompts) * new_tokens, out.shape
    result = {"warmup_s": warmup_s, "seconds": times, "output_tokens": tokens,
              "tokens_per_s": tokens / statistics.median(times), "attention": model.config._attn_implementation}
    return result, model


def check_logprobs(device: str) -> dict:
    """Correctness of the fast paths (graphs, overlapped decode, batched sampling) before timing them: a
    small fp32 Qwen2 generates for more prompts than it has slots (requests join as others finish, with
    different lengths, temperatures and filters); every logprob must match the HF forward of the same model
    on the generated sequence."""
    path = Path(tempfile.mkdtemp(prefix="rlflow-check-"))
    cfg = Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    backend = TorchRolloutBackend(str(path), device=device, dtype=torch.float32, batch_size=8, context_len=200)
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(3, 60, (24,), generator=g).tolist()
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]
    variants = [SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True),
                SamplingParams(max_new_tokens=25, temperature=0.7, ignore_eos=True),
                SamplingParams(max_new_tokens=33, temperature=0.9, top_k=50, top_p=0.9, ignore_eos=True),
                SamplingParams(max_new_tokens=17, temperature=0.0, ignore_eos=True)]
    requests = [backend.requests([p], variants[i % 4], seed=i)[0] for i, p in enumerate(prompts)]
    gens = [f.result(timeout=120) for f in backend.engine.submit(requests)]
    worst = 0.0
    with torch.no_grad():
        for r, gen in zip(requests, gens, strict=True):
            ids = torch.tensor([gen.prompt_ids + gen.output_ids], device=device)
            logits = backend.model(ids).logits[0, len(gen.prompt_ids) - 1 : -1].float()
            t = r.params.temperature
            logp = torch.log_softmax(logits / (t if t > 0 else 1.0), -1)
            ref = logp.gather(-1, ids[0, len(gen.prompt_ids):, None])[:, 0].cpu()
            worst = max(worst, float((ref - torch.tensor(gen.output_logprobs)).abs().max()))
            assert len(gen.output_ids) == r.params.max_new_tokens, (len(gen.output_ids), r.params)
            if t == 0:  # greedy: every token is the argmax of the reference
                assert gen.output_ids == logits.argmax(-1).tolist()
    backend.close()
    return {"max_abs_logprob_diff_fp32": worst, "ok": worst < 1e-3}


def hf_agreement(path: Path, gens_prompts: list[list[int]], gens_outputs: list[list[int]],
                 gens_logprobs: list[list[float]], model: torch.nn.Module) -> dict:
    """bf16 context: our rollout logprobs against the HF forward (bf16, sdpa) on the same sequences."""
    diffs = []
    with torch.no_grad():
        for prompt, out, lps in zip(gens_prompts, gens_outputs, gens_logprobs, strict=True):
            ids = torch.tensor([prompt + out], device=model.device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()
            diffs.append((ref - torch.tensor(lps)).abs())
    d = torch.cat(diffs)
    return {"sequences": len(diffs), "mean_abs_logprob_diff_bf16": float(d.mean()), "max": float(d.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.5B", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also record the GPU kernels of a short run of ours")
    ap.add_argument("--profile-tokens", type=int, default=32, help="new tokens of the profiled run")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--check", action="store_true", help="first check logprobs against HF on a small fp32 model")
    ap.add_argument("--page-size", type=int, default=16, help="KV page size (rollout.kv_cache.page_size)")
    ap.add_argument("--kv-fraction", type=float, default=0.85,
                    help="share of the free GPU memory the KV page pool takes (rollout.kv_cache.memory_fraction)")
    ap.add_argument("--sweep", action="store_true", help="also time the batch x new-token points")
    ap.add_argument("--sweep-batches", type=_ints, default=None, help="default 64,256,512 (smoke: 2,4)")
    ap.add_argument("--sweep-new-tokens", type=_ints, default=None, help="default 1024,8192 (smoke: 8,32)")
    ap.add_argument("--sweep-repeats", type=int, default=1)
    ap.add_argument("--hf-max-new-tokens", type=int, default=1024,
                    help="the sweep runs HF generate only at points with at most this many new tokens")
    ap.add_argument("--shared-prefix", action="store_true", help="also measure a GRPO group's shared prompt")
    ap.add_argument("--group-prompt-len", type=int, default=2048)
    ap.add_argument("--group-new-tokens", type=int, default=None, help="default 1024 (smoke: 64)")
    ap.add_argument("--long-context", action="store_true",
                    help="also run --long-batch sequences to --long-context-len tokens (prompt --prompt-len)")
    ap.add_argument("--long-batch", type=int, default=None, help="default 8 (smoke: 2)")
    ap.add_argument("--long-context-len", type=int, default=None,
                    help="default --max-positions (smoke: 4608)")
    ap.add_argument("--max-positions", type=int, default=MAX_POSITIONS,
                    help=f"the bench model's max_position_embeddings (default {MAX_POSITIONS}, Qwen2's own)")
    ap.add_argument("--long-prompt-len", type=int, default=None, help="default --prompt-len (smoke: 4480)")
    ap.add_argument("--only-extras", action="store_true", help="skip the main timing; run --sweep/--shared-prefix")
    ap.add_argument("--compile", action="store_true", help="rollout.compile: torch.compile the decode step")
    ap.add_argument("--uncompiled-too", action="store_true", help="with --compile, also time the engine without it")
    ap.add_argument("--unfused-too", action="store_true",
                    help="also time the engine running q/k/v and gate/up as separate GEMMs (the fused GEMMs' gain)")
    ap.add_argument("--out", default="gpu_rollout.json")
    harness.add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.size = "smoke"
    smoke = args.size.startswith("smoke")
    args.sweep_batches = args.sweep_batches or ([2, 4] if smoke else [64, 256, 512])
    args.sweep_new_tokens = args.sweep_new_tokens or ([8, 32] if smoke else [1024, 8192])
    args.group_new_tokens = args.group_new_tokens or (64 if smoke else 1024)
    args.long_batch = args.long_batch or (2 if smoke else 8)
    args.long_context_len = args.long_context_len or (4608 if smoke else args.max_positions)
    args.long_prompt_len = args.long_prompt_len or (4480 if smoke else None)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="rlflow-rollout-"))
    path = build_model(args.size, work / "model", device, args.max_positions)
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.size]["vocab_size"]
    prompts = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=g).tolist()
    result: dict = harness.report_header(__spec__.name, None) | {
        "transformers": transformers.__version__, "size": args.size, "batch": args.batch,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats}

    def save() -> None:
        harness.write_json(args.out, result)

    if args.check:
        result["check"] = check_logprobs(device)
        print(f"check: {result['check']}", flush=True)
        save()
    if args.shared_prefix:
        result["shared_prefix"] = shared_prefix(path, args, device, vocab)
        sp = result["shared_prefix"]
        print(f"shared prefix: prefill {sp['shared']['prefill_s']:.4f} s shared vs "
              f"{sp['unshared']['prefill_s']:.4f} s; "
              f"KV pages {sp['shared']['kv_pages_peak']} vs {sp['unshared']['kv_pages_peak']} (budget "
              f"{sp['budget_pages']}: {sp['shared']['pages_vs_budget']:.2f}x)", flush=True)
        save()
    gbps = copy_bandwidth() if device == "cuda" else None
    if args.sweep:
        result["copy_gb_per_s"] = gbps
        result["sweep"] = []
        sweep(path, args, device, vocab, gbps, result["sweep"], save)
    if args.long_context:
        g = torch.Generator().manual_seed(3)
        prompt_len = args.long_prompt_len or args.prompt_len
        new = args.long_context_len - prompt_len - 16
        long_prompts = torch.randint(3, vocab, (args.long_batch, prompt_len), generator=g).tolist()
        ours = time_ours(path, long_prompts, new, 1, device, False, kv_settings(args), warmup_tokens=64,
                         compile=args.compile)
        ours.pop("sample")
        result["long_context"] = {"batch": args.long_batch, "prompt_len": prompt_len, "new_tokens": new,
                                  "context": prompt_len + new, "max_positions": args.max_positions, **ours}
        print(f"long context: {args.long_batch} x {prompt_len} + {new} tokens, {ours['tokens_per_s']:.0f} "
              f"tokens/s, preemptions {ours['kv']['num_preemptions']}", flush=True)
        save()
    if args.only_extras:
        return
    if args.uncompiled_too and args.compile:  # the same engine without torch.compile, same run
        result["ours_uncompiled"] = time_ours(path, prompts, args.new_tokens, args.repeats, device, False,
                                              kv_settings(args))
        result["ours_uncompiled"].pop("sample")
        print(f"ours uncompiled: {result['ours_uncompiled']['tokens_per_s']:.0f} tokens/s", flush=True)
    if args.unfused_too:  # the same engine with every projection its own GEMM, same run
        result["ours_unfused"] = time_ours(path, prompts, args.new_tokens, args.repeats, device, False,
                                           kv_settings(args), compile=args.compile, fused=False)
        result["ours_unfused"].pop("sample")
        print(f"ours unfused: {result['ours_unfused']['tokens_per_s']:.0f} tokens/s", flush=True)
    result["ours"] = time_ours(path, prompts, args.new_tokens, args.repeats, device, args.profile, kv_settings(args),
                               compile=args.compile, profile_tokens=args.profile_tokens)
    sample = result["ours"].pop("sample")
    print(f"ours: {result['ours']['tokens_per_s']:.0f} tokens/s  ({result['ours']['seconds']})", flush=True)
    save()
    model = None
    if not args.skip_hf:
        result["hf"], model = time_hf(path, prompts, args.new_tokens, args.repeats, device)
        print(f"hf:   {result['hf']['tokens_per_s']:.0f} tokens/s  ({result['hf']['seconds']})", flush=True)
        result["ratio"] = result["ours"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
        result["agreement"] = hf_agreement(path, *zip(*sample, strict=True), model)
        print(f"agreement with HF: {result['agreement']}", flush=True)
        save()
    if device == "cuda":
        del model
        torch.cuda.empty_cache()
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        result["copy_gb_per_s"] = gbps
        result["decode_limit"] = decode_limit(meta, args.batch, args.prompt_len, args.new_tokens, gbps)
        result["ours"]["fraction_of_limit"] = result["ours"]["tokens_per_s"] / result["decode_limit"]["tokens_per_s"]
        spec = harness.by_device(harness.HBM_GB_PER_S, result["device"])
        if spec:  # the same limit at the memory's datasheet bandwidth (issue 21's ceiling)
            result["decode_limit_spec"] = decode_limit(meta, args.batch, args.prompt_len, args.new_tokens, spec)
            result["ours"]["fraction_of_spec_limit"] = (result["ours"]["tokens_per_s"]
                                                        / result["decode_limit_spec"]["tokens_per_s"])
        print(f"decode limit: {result['decode_limit']['tokens_per_s']:.0f} tokens/s at {gbps:.0f} GB/s; ours at "
              f"{100 * result['ours']['fraction_of_limit']:.1f}%", flush=True)
    save()
    prof = result["ours"].get("profile")
    if prof and "top" in prof:
        print(f"profile ({prof['new_tokens']} new tokens): wall {prof['wall_s']:.3f} s, "
              f"GPU busy {prof['gpu_busy_s']:.3f} s")
        for row in prof["top"][:15]:
            print(f"  {row['ms']:9.2f} ms  x{row['count']:<6} {row['name']}")
    if "ratio" in result:
        print(f"ratio: {result['ratio']:.2f}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


if __name__ == "__main__":
    main()
