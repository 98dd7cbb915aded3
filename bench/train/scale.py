"""The native train backend on one GPU against a plain bf16 loop, on an RL-shaped batch. One command:

    PYTHONUNBUFFERED=1 python -m bench.train.scale --out bench/results/train_scale.json

Workload (issue 25; same seeds every run): a Qwen2-1.5B-shaped model (vocab 151,936, hidden 1,536, 28 layers,
12 query / 2 KV heads, tied embeddings) with random weights, and one GRPO batch of 64 samples, each a
256-token prompt and a response of uniform(64, 1,792) tokens; random token ids, advantages ~ N(0, 1), the
loss on response tokens only. `--response-max` raises the longest response (the no-OOM check at 8,192).

Each variant runs in a fresh process (its own peak memory), one warm-up step, then `--steps` timed steps:
- `baseline`: the plain loop anyone would write: HF forward with SDPA under bf16 autocast, fp32 weights, fused
  AdamW, samples sorted by length into padded micro-batches of at most 8,192 tokens (rows x width), full fp32
  logits and log-softmax, a policy-gradient loss;
- `rlflow-*`: TorchTrainBackend.train_step with precision bf16 (FSDP2 on one rank: fp32 master weights, bf16
  compute copies made per layer gather) and the named options (packing and chunked log-probs always; token
  budget, activation checkpointing (`-ckpt` full, `-sac` selective: attention's outputs kept), torch.compile per
  layer, FSDP2 CPU offload); `*-lora`: train.lora, rank-16
  adapters on every linear of a frozen bf16 base (their MFU counts 4 FLOPs per frozen parameter and token, no
  weight gradients, plus the adapters' 6).
`--shape 7b` takes Qwen2.5-7B's dims (vocab 152,064, hidden 3,584, 28 layers, 28 query / 4 KV heads, untied).
Figures: useful (non-padding) tokens per second, MFU = (6 x matmul params x tokens + 6 x layers x hidden x
sum(len^2)) / time / peak, with the GPU's dense bf16 peak (H100 989 TFLOP/s), and peak memory.
`--smoke` runs a toy shape on CPU to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

from bench import harness
from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.config import AlgorithmConfig, MegatronConfig, TrainConfig
from rlflow.engines.train.torch_backend import TorchTrainBackend

QWEN2_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=16384,
                  tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6)
QWEN2_5_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
# Qwen3-30B-A3B's layer (128 experts of width 768, top-8, hidden 2048, 32 / 4 heads of 128) in 8 of its 48 layers:
# 5.3B parameters, whose fp32 masters, gradients and Adam state (85 GB) fit one 141 GB GPU. Its LM head is a larger
# share of the active FLOPs than in the 48-layer model (about 40% against 10%): docs/benchmarks.md says so.
QWEN3_30B_A3B_8L = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                        num_experts=128, num_experts_per_tok=8, num_hidden_layers=8, num_attention_heads=32,
                        num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6)
SMOKE_MOE = SMOKE | dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16)
SHAPES = {"1.5b": QWEN2_1_5B, "7b": QWEN2_5_7B, "30b-a3b-8l": QWEN3_30B_A3B_8L, "smoke": SMOKE,
          "smoke-moe": SMOKE_MOE}
VARIANTS = {
    "baseline": {},
    "rlflow-8k": {"micro_batch_tokens": 8192},
    "rlflow-16k": {"micro_batch_tokens": 16384},
    "rlflow-8k-eagerhead": {"micro_batch_tokens": 8192, "fused_head": False},  # the head's math as eager ops
    "rlflow-8k-ckpt": {"micro_batch_tokens": 8192, "activation_checkpointing": "full"},
    "rlflow-16k-ckpt": {"micro_batch_tokens": 16384, "activation_checkpointing": "full"},
    "rlflow-32k-ckpt": {"micro_batch_tokens": 32768, "activation_checkpointing": "full"},
    # MoE: per micro-batch costs that scale with all parameters (bf16 casts of the gathered weights, gradient
    # reduction and accumulation) are ten times the active FLOPs' share; fewer, larger micro-batches
    "rlflow-64k-ckpt": {"micro_batch_tokens": 65536, "activation_checkpointing": "full"},
    # selective checkpointing: the layers are recomputed except the attention kernel, whose outputs are kept
    "rlflow-16k-sac": {"micro_batch_tokens": 16384, "activation_checkpointing": "selective"},
    "rlflow-64k-sac": {"micro_batch_tokens": 65536, "activation_checkpointing": "selective"},
    "rlflow-8k-compile": {"micro_batch_tokens": 8192, "compile": True},
    "rlflow-8k-noreshard": {"micro_batch_tokens": 8192, "reshard_after_forward": False},
    "rlflow-8k-liger": {"micro_batch_tokens": 8192, "kernels": "liger"},
    "rlflow-8k-compile-liger": {"micro_batch_tokens": 8192, "compile": True, "kernels": "liger"},
    "rlflow-16k-liger": {"micro_batch_tokens": 16384, "kernels": "liger"},
    "rlflow-16k-ckpt-liger": {"micro_batch_tokens": 16384, "activation_checkpointing": "full", "kernels": "liger"},
    "rlflow-16k-compile": {"micro_batch_tokens": 16384, "compile": True},
    # MoE: the gathered bf16 weights kept from a micro-batch's forward to its backward (no second gather and cast)
    "rlflow-16k-compile-noreshard": {"micro_batch_tokens": 16384, "compile": True, "reshard_after_forward": False},
    "rlflow-16k-ckpt-compile": {"micro_batch_tokens": 16384, "activation_checkpointing": "full", "compile": True},
    "rlflow-32k-ckpt-compile": {"micro_batch_tokens": 32768, "activation_checkpointing": "full", "compile": True},
    # train.lora (issue 23): rank-16 adapters on every linear of the frozen bf16 base, side by side with full FT
    "rlflow-8k-lora": {"micro_batch_tokens": 8192, "lora": {"rank": 16, "alpha": 32}},
    "rlflow-16k-lora": {"micro_batch_tokens": 16384, "lora": {"rank": 16, "alpha": 32}},
    "rlflow-16k-ckpt-lora": {"micro_batch_tokens": 16384, "activation_checkpointing": "full",
                             "lora": {"rank": 16, "alpha": 32}},
    "rlflow-16k-liger-lora": {"micro_batch_tokens": 16384, "kernels": "liger", "lora": {"rank": 16, "alpha": 32}},
    "rlflow-4k-ckpt-c1k": {"micro_batch_tokens": 4096, "activation_checkpointing": "full",
                           "logprob_chunk_tokens": 1024},
    "rlflow-8k-ckpt-offload": {"micro_batch_tokens": 8192, "activation_checkpointing": "full", "cpu_offload": True},
    "rlflow-16k-ckpt-offload": {"micro_batch_tokens": 16384, "activation_checkpointing": "full", "cpu_offload": True},
    "rlflow-32k-ckpt-offload": {"micro_batch_tokens": 32768, "activation_checkpointing": "full", "cpu_offload": True},
    "rlflow-16k-compile-offload": {"micro_batch_tokens": 16384, "compile": True, "cpu_offload": True},
    # the Megatron-core backend on the same batch (packed THD micro-batches by default; megatron.* options)
    "megatron-8k": {"backend": "megatron", "micro_batch_tokens": 8192},
    "megatron-16k": {"backend": "megatron", "micro_batch_tokens": 16384},
    "megatron-16k-padded": {"backend": "megatron", "micro_batch_tokens": 16384, "packing": False},
    "megatron-8k-padded": {"backend": "megatron", "micro_batch_tokens": 8192, "packing": False},
    # train.compile on megatron's decoder layers
    "megatron-8k-compile": {"backend": "megatron", "micro_batch_tokens": 8192, "compile": True},
    "megatron-16k-compile": {"backend": "megatron", "micro_batch_tokens": 16384, "compile": True},
    "megatron-8k-padded-compile": {"backend": "megatron", "micro_batch_tokens": 8192, "packing": False,
                                   "compile": True},
    # megatron-core's own per-tensor fallbacks for apex's kernels, not torch's fused stand-ins (the comparison)
    "megatron-8k-padded-compile-mcore": {"backend": "megatron", "micro_batch_tokens": 8192, "packing": False,
                                         "compile": True, "torch_fused_kernels": False},
    "megatron-16k-unfused": {"backend": "megatron", "micro_batch_tokens": 16384, "attention": "unfused",
                             "packing": False},
}


def workload(vocab: int, n: int, prompt: int, response_min: int, response_max: int, seed: int = 0
             ) -> dict[str, torch.Tensor]:
    """The batch as the train workers get it: right-padded [n, width] (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(response_min, response_max + 1, (n,), generator=g)
    lengths = prompt + responses
    width = int(lengths.max())
    cols = torch.arange(width)[None]
    attn = (cols < lengths[:, None]).long()
    ids = torch.randint(0, vocab, (n, width), generator=g) * attn
    loss_mask = ((cols >= prompt) & attn.bool()).float()
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
            "old_logprobs": torch.zeros(n, width), "advantages": torch.randn(n, generator=g)}


def flops_per_step(cfg: dict, lengths: torch.Tensor, lora_rank: int = 0, causal: bool = True) -> float:
    """Training FLOPs of one pass over the samples (forward + backward) on useful tokens only. The head width is
    cfg's "head_dim" when set (Qwen3), else hidden / heads. An MoE config (num_experts, or Mixtral's
    num_local_experts) counts the experts a token runs through (num_experts_per_tok of them, each of width
    moe_intermediate_size, Mixtral's intermediate_size) and the router: MFU of the active parameters. Every bench
    counts FLOPs here (bench/megatron/checks.train_flops_per_token too). With LoRA (`lora_rank`, adapters on every
    linear of the layers; dense only) the frozen weights get no weight gradient, so their matmuls cost 4 FLOPs per
    parameter and token instead of 6, and the adapters add their own 6. `causal`: attention over the half of each s x s
    matrix a causal model computes (the stricter MFU, every figure's default); False: over all of it (Megatron-LM's
    published convention, bench/megatron/gpu.py's second MFU column)."""
    d, layers, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or d // heads
    q = heads * head_dim
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if experts:
        ffn = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        mlp = 3 * d * ffn * cfg["num_experts_per_tok"] + d * experts  # the active experts and the router
    else:
        ffn = cfg["intermediate_size"]
        mlp = 3 * d * ffn
    per_layer = d * q + 2 * d * kv * head_dim + q * d + mlp
    matmul_params = layers * per_layer + v * d  # + the LM head (the embedding lookup is no matmul)
    tokens = float(lengths.sum())
    # QK^T and AV: 2 matmuls x 2 FLOPs x q x s^2 forward, x3 with the backward, halved when causal
    attention = (6.0 if causal else 12.0) * layers * q * float((lengths.double() ** 2).sum())
    if not lora_rank:
        return 6.0 * matmul_params * tokens + attention
    if experts:
        raise ValueError("flops_per_step: lora_rank on an MoE config is not counted (adapters on dense layers only)")
    # (in, out) of q, k, v, o, gate, up, down
    shapes = [(d, q), (d, kv * head_dim), (d, kv * head_dim), (q, d), (d, ffn), (d, ffn), (ffn, d)]
    adapter_params = layers * lora_rank * sum(i + o for i, o in shapes)
    return 4.0 * matmul_params * tokens + 6.0 * adapter_params * tokens + attention


def build_model(cfg: dict, out: Path, seed: int = 0) -> None:
    """Random weights of the shape (drawn from `seed`), saved in bf16 (initialised on the GPU when there is one: a
    7B shape takes minutes on a CPU)."""
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        config = (Qwen3MoeConfig if "num_experts" in cfg else Qwen2Config)(**cfg)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    if torch.cuda.is_available():  # the variants' processes get the whole GPU
        torch.cuda.empty_cache()


# ---- the variants (each in its own process) ------------------------------------------------------------
def run_baseline(model_path: str, batch: dict, steps: int, device: str, budget: int = 8192) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")
    lengths = batch["attention_mask"].sum(-1)
    order = torch.argsort(lengths, descending=True).tolist()
    micro, current = [], []
    for i in order:  # sorted by length: rows x (the first row's length) <= budget
        if current and (len(current) + 1) * int(lengths[current[0]]) > budget:
            micro.append(current)
            current = []
        current.append(i)
    micro.append(current)
    total = batch["loss_mask"].sum()
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for idx in micro:
            w = int(lengths[idx].max())
            mb = {k: v[idx][:, :w].to(device) if v.dim() == 2 else v[idx].to(device) for k, v in batch.items()}
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = model(mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, mb["input_ids"][:, 1:, None])[..., 0]
            loss = -(logp * mb["advantages"][:, None] * mb["loss_mask"][:, 1:]).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return harness.timed(step, steps, warmup=1, on=device)


def run_rlflow(model_path: str, batch: dict, steps: int, device: str, options: dict) -> dict:
    """The backend's train steps (the first a warm-up), one forward_logprobs pass, and with RLFLOW_BENCH_PROFILE
    where one more step's GPU time goes."""
    options = dict(options)
    if options.pop("backend", "torch") == "megatron":
        from rlflow.engines.train.megatron.backend import MegatronTrainBackend  # megatron-core is an extra

        train = TrainConfig(device=device, precision="bf16", lr=1e-6, micro_batch_size=4096, threads=8,
                            compile=options.pop("compile", False))
        backend = MegatronTrainBackend(model_path, train, AlgorithmConfig(kl_coef=0.0), MegatronConfig(**options),
                                       rank=0, world_size=1, dist_url=f"tcp://127.0.0.1:{free_port()}")
    else:
        train = TrainConfig(device=device, precision="bf16", lr=1e-6, micro_batch_size=4096, threads=8, **options)
        backend = TorchTrainBackend(model_path, train, AlgorithmConfig(kl_coef=0.0))
    out = {"step_s": harness.timed(lambda: backend.train_step(batch), steps, warmup=1, on=device)}
    if harness.profiling():
        out["profile"] = harness.kernel_profile(lambda: backend.train_step(batch))
    # the first pass is a warm-up: its head (no entropy) compiles on its own (train.fused_head)
    out["logprob_s"] = harness.timed(lambda: backend.forward_logprobs(batch), 1, warmup=1, on=device)[0]
    return out


def child(args) -> None:
    """One variant, in this process; its result is one RESULT line."""
    cfg = json.loads(args.model_cfg)
    batch = workload(cfg["vocab_size"], args.samples, args.prompt, args.response_min, args.response_max)
    device = harness.device()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    measured: dict = {"step_s": []}
    try:
        if args.variant == "baseline":
            measured["step_s"] = run_baseline(args.model_path, batch, args.steps, device)
        else:
            measured = run_rlflow(args.model_path, batch, args.steps, device, VARIANTS[args.variant])
        error = None
    except torch.OutOfMemoryError as e:
        error = f"out of memory: {str(e).splitlines()[0]}"
    lengths = batch["attention_mask"].sum(-1)
    lora_rank = VARIANTS.get(args.variant, {}).get("lora", {}).get("rank", 0)
    times = measured["step_s"]
    result = {"variant": args.variant, "step_s": times, "error": error,
              "useful_tokens": int(lengths.sum()), "padded_tokens": int(lengths.numel() * lengths.max()),
              "flops_per_step": flops_per_step(cfg, lengths, lora_rank)}
    if times:
        best = harness.median(times)
        result |= {"step_s_median": best, "tokens_per_s": result["useful_tokens"] / best,
                   "tflops": result["flops_per_step"] / best / 1e12}
    if measured.get("logprob_s"):
        result["logprob_tokens_per_s"] = result["useful_tokens"] / measured["logprob_s"]
    if "profile" in measured:
        print(measured["profile"].pop("table", ""), flush=True)
        result["profile"] = measured["profile"]
    result["peak_gib"] = harness.peak_gib()
    harness.emit_result(result)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response-min", type=int, default=64)
    p.add_argument("--response-max", type=int, default=1792)
    p.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.5b", help="model dims (smoke: a toy on CPU)")
    harness.add_smoke(p)
    p.add_argument("--out", type=Path)
    # internal: run one variant in this process
    p.add_argument("--variant")
    p.add_argument("--model-path")
    p.add_argument("--model-cfg")
    args = p.parse_args()
    if args.variant:
        return child(args)

    if args.smoke:
        args.shape = "smoke" if args.shape != "smoke-moe" else args.shape
    cfg = SHAPES[args.shape]
    if args.shape.startswith("smoke"):
        args.samples, args.prompt, args.response_min, args.response_max = 8, 16, 4, 48
    report = harness.report_header(__spec__.name, None)
    peak = harness.by_device(harness.PEAK_BF16_TFLOPS, report["device"])
    report |= {"peak_tflops": peak, "shape": args.shape, "model": cfg, "samples": args.samples,
               "prompt": args.prompt, "response": [args.response_min, args.response_max], "steps": args.steps,
               "variants": {}}
    env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(cfg, Path(tmp))
        for name in args.variants.split(","):
            result = harness.run_child(
                ["-m", __spec__.name, "--variant", name, "--model-path", tmp, "--model-cfg", json.dumps(cfg),
                 "--steps", str(args.steps), "--samples", str(args.samples), "--prompt", str(args.prompt),
                 "--response-min", str(args.response_min), "--response-max", str(args.response_max)],
                args.timeout, env=env, echo=harness.profiling())
            if peak and "tflops" in result:
                result["mfu"] = result["tflops"] / peak
            report["variants"][name] = result
            print(name, json.dumps({k: v for k, v in result.items() if k != "step_s"}), flush=True)
            if args.out:
                harness.write_json(args.out, report)
    base = report["variants"].get("baseline", {}).get("tokens_per_s")
    for r in report["variants"].values():
        if base and "tokens_per_s" in r:
            r["vs_baseline"] = r["tokens_per_s"] / base
    if args.out:
        harness.write_json(args.out, report)
    print(json.dumps({n: {k: r.get(k) for k in ("tokens_per_s", "mfu", "vs_baseline", "peak_gib", "error")}
                      for n, r in report["variants"].items()}, indent=1))


if __name__ == "__main__":
    main()
