"""Context parallelism in the native trainer (train.context_parallel, Ulysses) on N GPUs of one host: one long sample
split over N ranks. Commands:

    PYTHONUNBUFFERED=1 python -m bench.train.context_parallel --runs 65536x2,131072x4 \\
        --out bench/results/train_context_parallel.json          # 64k tokens on 2 GPUs (CP=2), 128k on 4 (CP=4)
    python -m bench.train.context_parallel --runs 65536x1,65536x2 --out /tmp/cp.json   # CP=1 beside CP=2
    python -m bench.train.context_parallel --smoke --out /tmp/cp_smoke.json    # CPU, gloo: checks the script
    python -m bench.train.context_parallel --runs 65536x1,65536x1+selective,65536x1+cudnn,65536x1+selective+cudnn \
        --out /tmp/cp_levers.json                 # variants side by side: +off|full|selective, +flash|cudnn, +compile

Workload: a Qwen2-1.5B-shaped model (bench/train/scale.py's shape, random weights, max positions raised to the
longest sample), one sample per step of TOKENS tokens (a --prompt-token prompt, the rest a response that the loss
covers), random ids, advantage 1. Each run TOKENSxN is N fresh processes (bench/ranks.py; rank r on GPU r), with
train.context_parallel N (one data-parallel group; N = 1 runs without CP) and train.micro_batch_tokens TOKENS / N
(rounded up), so the sample is one micro-batch whose stream each rank holds 1/N of; bf16 over fp32 master weights,
activation checkpointing (--ckpt full, the default; selective: the attention kernel's outputs kept, the rest of each
layer recomputed; off, or --no-ckpt), --compile for train.compile. One warm-up step, then --steps timed steps,
a step's time the slowest rank's. Reported per run: useful tokens/s in all and per GPU, MFU on useful tokens
(bench/train/scale.flops_per_step, causal attention, over N GPUs' dense bf16 peak from harness.PEAK_BF16_TFLOPS),
peak allocated memory per rank, and the loss (the same for every N: a check that the split changes nothing). A rank
out of memory, or a run past --timeout, is recorded as that run's error.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench import harness
from bench.ranks import rank_result, rendezvous, run_and_collect, run_ranks, step_figures, time_left
from bench.train.scale import SHAPES, build_model, flops_per_step
from rlflow.engines.core.batch import shard_for_workers
from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
from rlflow.engines.train.torch_backend import TorchTrainBackend

DEFAULT_RUNS = "65536x2,131072x4"
SMOKE_RUNS = "97x1,97x2"  # an odd length: the stream is padded to split evenly


def long_sample(vocab: int, tokens: int, prompt: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One sample of `tokens` tokens as a train batch: the loss on everything after the prompt."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.arange(tokens)[None]
    return {"input_ids": torch.randint(0, vocab, (1, tokens), generator=g),
            "attention_mask": torch.ones(1, tokens, dtype=torch.long),
            "loss_mask": (cols >= min(prompt, tokens - 1)).float(),
            "old_logprobs": torch.zeros(1, tokens), "advantages": torch.ones(1)}


def _build(rank: int, world: int, cfg: dict, out: str) -> None:
    """The random model, in its own process: the parent never holds a CUDA context the ranks' GPU 0 would lose."""
    build_model(cfg, Path(out))


def cp_rank(rank: int, world: int, model_path: str, cfg: dict, job: dict, url: str, timeout: float, out: str
            ) -> None:
    """One rank of a CP group of `world`: 1 + steps train steps on the long sample; figures to out.<rank>.json."""
    device = harness.device()
    batch = long_sample(cfg["vocab_size"], job["tokens"], job["prompt"])
    train = TrainConfig(device=device, precision="bf16", lr=1e-6, threads=8 if device == "cuda" else 1,
                        context_parallel=world, micro_batch_tokens=-(-job["tokens"] // world),
                        activation_checkpointing=job["ckpt"], compile=job["compile"], attention_kernel=job["kernel"])
    with rank_result(out, rank) as result:
        backend = TorchTrainBackend(model_path, train, AlgorithmConfig(kl_coef=0.0), rank=rank, world_size=world,
                                    dist_url=url, collective_timeout_s=timeout)
        shard = shard_for_workers(batch, 1, 1)[backend.data_parallel_rank()]
        result["micro_batches"] = len(backend.micro_batches(shard))
        metrics = []
        times = harness.timed(lambda: metrics.append(backend.train_step(shard)), job["steps"] + 1, on=device)
        result |= {"step_s": times[1:], "warmup_s": times[0], "loss": metrics[-1].get("loss"),
                   "grad_norm": metrics[-1].get("grad_norm")}
    dist.destroy_process_group()


def run_one(a, model: str, cfg: dict, run: dict, work: Path) -> dict:
    """One run (`parse_runs`): the ranks' results combined (or the error that ended it)."""
    tokens, n = run["tokens"], run["gpus"]
    visible = torch.cuda.device_count() if torch.cuda.is_available() else n  # CPU: any number of gloo ranks
    if n > visible:
        return {"gpus": n, "tokens": tokens, "error": f"skipped: needs {n} GPUs, this machine shows {visible}"}
    limit = time_left(a.timeout, a.end)
    if limit < 10:
        return {"gpus": n, "tokens": tokens, "error": f"skipped: past --deadline {a.deadline:.0f} s"}
    out = work / f"cp_{run['name'].replace('+', '_')}"
    job = {"tokens": tokens, "prompt": a.prompt, "steps": a.steps, "ckpt": run.get("ckpt", a.ckpt),
           "compile": run.get("compile", a.compile), "kernel": run.get("kernel", a.attention_kernel)}
    t0 = time.perf_counter()
    ranks, error = run_and_collect(cp_rank, n, limit, str(out), model, cfg, job, rendezvous(str(out)), limit)
    flops = flops_per_step(cfg, torch.tensor([tokens]))
    result = {"gpus": n, "context_parallel": n, "tokens": tokens, "tokens_per_rank": -(-tokens // n),
              "activation_checkpointing": job["ckpt"], "compile": job["compile"], "attention_kernel": job["kernel"],
              "wall_s": time.perf_counter() - t0, "error": error, "useful_tokens": tokens, "flops_per_step": flops,
              "ranks": ranks}
    if error is None and len(ranks) == n and all("step_s" in r for r in ranks):
        result |= step_figures(ranks, a.steps, tokens, flops)
    return result


RUN_OPTIONS = {"off": ("ckpt", "off"), "full": ("ckpt", "full"), "selective": ("ckpt", "selective"),
               "flash": ("kernel", "flash"), "cudnn": ("kernel", "cudnn"), "compile": ("compile", True)}


def parse_runs(text: str) -> list[dict]:
    """"65536x2,65536x1+selective+cudnn" -> one dict per run: name, tokens, gpus, and the options given after
    `+` (activation checkpointing off/full/selective, attention kernel flash/cudnn, compile), which override the
    command line's for that run, so variants are measured side by side in one invocation."""
    runs = []
    for part in text.split(","):
        head, *options = part.strip().split("+")
        tokens, _, n = head.partition("x")
        if not (tokens.isdigit() and n.isdigit() and int(n) > 0 and int(tokens) > 1):
            raise ValueError(f"--runs: {part!r} is not TOKENSxGPUS[+option...] (e.g. 65536x2+selective)")
        unknown = [o for o in options if o not in RUN_OPTIONS]
        if unknown:
            raise ValueError(f"--runs: {part!r}: unknown option {unknown[0]!r} (one of {', '.join(RUN_OPTIONS)})")
        runs.append({"name": part.strip(), "tokens": int(tokens), "gpus": int(n)} | dict(RUN_OPTIONS[o]
                                                                                         for o in options))
    return runs


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=None, help=f"comma-separated TOKENSxGPUS (default {DEFAULT_RUNS}; CP = GPUS)")
    p.add_argument("--shape", choices=["1.5b", "7b"], default="1.5b")
    harness.add_smoke(p)
    p.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up); the median is reported")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the sample (no loss on them)")
    p.add_argument("--ckpt", choices=["off", "full", "selective"], default="full",
                   help="train.activation_checkpointing (selective: attention's outputs kept, the rest recomputed)")
    p.add_argument("--no-ckpt", dest="ckpt", action="store_const", const="off", help="--ckpt off")
    p.add_argument("--compile", action="store_true", help="train.compile (each decoder layer compiled)")
    p.add_argument("--attention-kernel", choices=["flash", "cudnn"], default="flash",
                   help="train.attention_kernel (cudnn: the one-sample stream through cuDNN's SDPA)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per run, model loading included")
    p.add_argument("--deadline", type=float, default=570, help="seconds for the whole script: later runs are skipped")
    p.add_argument("--out", type=Path, required=True, help="JSON results (rewritten after each run)")
    a = p.parse_args(argv)
    a.end = time.monotonic() + a.deadline
    try:
        runs = parse_runs(a.runs or (SMOKE_RUNS if a.smoke else DEFAULT_RUNS))
    except ValueError as e:
        p.error(str(e))
    if a.smoke:
        a.shape, a.prompt, a.steps = "smoke", 16, min(a.steps, 1)
    cfg = SHAPES[a.shape] | {"max_position_embeddings": max(r["tokens"] for r in runs)}
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the ranks inherit it
    report = harness.report_header(__spec__.name, argv, name_device=False) | {
        "shape": a.shape, "model": cfg, "prompt": a.prompt, "steps": a.steps, "activation_checkpointing": a.ckpt,
        "compile": a.compile, "attention_kernel": a.attention_kernel, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        run_ranks(_build, 1, time_left(a.timeout, a.end), cfg, model)
        for run in runs:
            r = run_one(a, model, cfg, run, Path(tmp))
            report["runs"][run["name"]] = r
            report["device"] = next((x["device"] for x in r.get("ranks", []) if "device" in x), report.get("device"))
            print(f"[train_context_parallel] {run['name']}: " + json.dumps(
                {k: r.get(k) for k in ("tokens_per_s_per_gpu", "mfu", "peak_gib_per_rank", "step_s_median", "loss",
                                       "grad_norm", "wall_s", "error")}), flush=True)
            harness.write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
