"""The native trainer (TorchTrainBackend, FSDP2) on N GPUs of one host: weak scaling of the RL workload. Commands:

    PYTHONUNBUFFERED=1 python -m bench.train.multi_gpu --gpus 1,2 --out bench/results/train_multi_gpu.json
    PYTHONUNBUFFERED=1 python -m bench.train.multi_gpu --shape 7b --gpus 2 --steps 2 --timeout 480 \\
        --variants rlflow-8k-ckpt --out bench/results/train_multi_gpu_7b.json
    python -m bench.train.multi_gpu --smoke --out /tmp/train_multi_gpu_smoke.json   # CPU, gloo: checks the script

Workload: bench/train/scale.py's (issue 25: a Qwen2-1.5B-shaped model, or --shape 7b for Qwen2.5-7B's dims, random
weights; per GPU 64 samples of a 256-token prompt and a uniform(64, 1,792)-token response, random ids, advantages
~ N(0, 1)), scaled by N: one batch of N x --samples samples drawn with the same seed, split over the ranks by
engines/core/batch.shard_for_workers (the RL session's split: each rank the same number of samples and about the
same number of tokens), each rank calling TorchTrainBackend.train_step on its shard (the loss is normalised by
the global token count, FSDP2 sums the gradients, so N ranks take the optimizer step one rank would take on the
whole batch). bf16 compute over fp32 master weights; the variant's options come from train_scale.VARIANTS
(the torch ones: token budget, activation checkpointing, compile, liger, CPU offload).

Each (variant, N) runs in N fresh processes (bench/ranks.py; rank r on GPU r, so CUDA_VISIBLE_DEVICES picks the
GPUs), nccl on GPUs and gloo on CPUs: the same code. One warm-up step, then --steps timed steps; a step's time is
the slowest rank's. Per N: useful (non-padding) tokens/s in all and per GPU, MFU on useful tokens
(train_scale.flops_per_step over the N GPUs' dense bf16 peak, H100 989 TFLOP/s), scaling efficiency = tokens/s/GPU
at N over that at 1 GPU (the same variant), and peak allocated memory per rank. A rank out of memory ends the run
and is recorded as its result ("out of memory"), as is a run past --timeout seconds (its processes are killed; the
backend's collective timeout is the same, so no rank waits longer on a dead peer). 7B on one 80 GB H100: its fp32
weights, gradients and Adam state alone are 122 GB, so N=1 is expected to report out of memory without
`rlflow-*-offload` (which puts them in host memory), hence `--gpus 2` above (`--gpus 1` alone records that); on
2 GPUs each rank holds half. Expected wall time on two H100s: the 1.5b default about 3 minutes (model build, then
each N loads the model and runs 1 + 3 steps of a few seconds); the 7b command about 5 (loading 7B weights in fp32
on the host takes a minute or two per rank).
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
from bench.ranks import (
    add_workload_args,
    finish_workload_args,
    rank_result,
    rendezvous,
    run_and_collect,
    run_ranks,
    step_figures,
    time_left,
)
from bench.train.scale import SHAPES, VARIANTS, build_model, flops_per_step, workload
from rlflow.engines.core.batch import shard_for_workers
from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
from rlflow.engines.train.torch_backend import TorchTrainBackend

# the native trainer's variants (baseline is a plain one-process loop; megatron-* is bench/megatron/multi_gpu.py)
TORCH_VARIANTS = {k: v for k, v in VARIANTS.items() if k.startswith("rlflow-")}
DEFAULT_VARIANT = {"1.5b": "rlflow-8k", "7b": "rlflow-8k-ckpt", "smoke": "rlflow-8k"}


def _build(rank: int, world: int, cfg: dict, out: str) -> None:
    """The random model, in its own process: the parent never holds a CUDA context the ranks' GPU 0 would lose."""
    build_model(cfg, Path(out))


def train_rank(
    rank: int, world: int, model_path: str, cfg: dict, options: dict, work: dict, url: str, timeout: float, out: str
) -> None:
    """One rank: its shard of the N x samples batch, 1 + steps train steps; its figures go to out.<rank>.json."""
    device = harness.device()
    batch = workload(
        cfg["vocab_size"], world * work["samples"], work["prompt"], work["response_min"], work["response_max"]
    )
    shard = shard_for_workers(batch, world, 1)[rank]
    train = TrainConfig(
        device=device, precision="bf16", lr=1e-6, micro_batch_size=4096, threads=8 if device == "cuda" else 1, **options
    )
    with rank_result(out, rank) as result:
        result["local_tokens"] = int(shard["attention_mask"].sum())
        backend = TorchTrainBackend(
            model_path,
            train,
            AlgorithmConfig(kl_coef=0.0),
            rank=rank,
            world_size=world,
            dist_url=url,
            collective_timeout_s=timeout,
        )
        metrics = []
        times = harness.timed(lambda: metrics.append(backend.train_step(shard)), work["steps"] + 1, on=device)
        result |= {
            "step_s": times[1:],  # the first is the warm-up
            "warmup_s": times[0],
            "loss": metrics[-1].get("loss"),
            "grad_norm": metrics[-1].get("grad_norm"),
        }
    dist.destroy_process_group()


def run_one(a, model: str, cfg: dict, variant: str, n: int, work: Path) -> dict:
    """One (variant, N): the ranks' results combined (or the error that ended the run)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else n  # CPU: any number of gloo ranks
    if n > visible:
        return {"gpus": n, "error": f"skipped: needs {n} GPUs, this machine shows {visible}"}
    limit = time_left(a.timeout, a.end)
    if limit < 10:
        return {"gpus": n, "error": f"skipped: past --deadline {a.deadline:.0f} s"}
    out = work / f"{variant}_n{n}"
    job = {k: getattr(a, k) for k in ("samples", "prompt", "response_min", "response_max", "steps")}
    t0 = time.perf_counter()
    ranks, error = run_and_collect(
        train_rank,
        n,
        limit,
        str(out),
        model,
        cfg,
        TORCH_VARIANTS[variant],
        job,
        rendezvous(str(out)),
        limit,
    )
    lengths = workload(cfg["vocab_size"], n * a.samples, a.prompt, a.response_min, a.response_max)[
        "attention_mask"
    ].sum(-1)
    result = {
        "gpus": n,
        "wall_s": time.perf_counter() - t0,
        "error": error,
        "samples": n * a.samples,
        "useful_tokens": int(lengths.sum()),
        "flops_per_step": flops_per_step(cfg, lengths),
        "ranks": ranks,
    }
    if error is None and len(ranks) == n and all("step_s" in r for r in ranks):
        result |= step_figures(ranks, a.steps, result["useful_tokens"], result["flops_per_step"])
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1,2", help="rank counts to run, comma-separated (each <= the visible GPUs)")
    p.add_argument(
        "--variants",
        help=f"comma-separated, of {', '.join(TORCH_VARIANTS)}; default: "
        f"{DEFAULT_VARIANT['1.5b']} (1.5b), {DEFAULT_VARIANT['7b']} (7b)",
    )
    add_workload_args(p, SHAPES, steps=3)
    p.add_argument("--timeout", type=int, default=300, help="seconds per (variant, N) run, model loading included")
    p.add_argument("--out", type=Path, required=True, help="JSON results (rewritten after each run)")
    a = p.parse_args(argv)
    finish_workload_args(a)
    variants = (a.variants or DEFAULT_VARIANT[a.shape]).split(",")
    unknown = [v for v in variants if v not in TORCH_VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; expected names from {list(TORCH_VARIANTS)}")
    gpus = [int(g) for g in a.gpus.split(",")]
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the ranks inherit it
    cfg = SHAPES[a.shape]
    report = harness.report_header(__spec__.name, argv, name_device=False) | {  # the ranks name their GPU
        "shape": a.shape,
        "model": cfg,
        "samples_per_gpu": a.samples,
        "prompt": a.prompt,
        "response": [a.response_min, a.response_max],
        "steps": a.steps,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        t0 = time.perf_counter()
        run_ranks(_build, 1, time_left(a.timeout, a.end), cfg, model)
        print(f"[train_multi_gpu] built a random {a.shape} model in {time.perf_counter() - t0:.0f} s", flush=True)
        for variant in variants:
            runs = report["runs"].setdefault(variant, {})
            for n in gpus:
                r = run_one(a, model, cfg, variant, n, Path(tmp))
                runs[str(n)] = r
                base = runs.get("1", {}).get("tokens_per_s_per_gpu")
                if base and "tokens_per_s_per_gpu" in r:
                    r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base
                report["device"] = (
                    next((x["device"] for x in r["ranks"] if "device" in x), report.get("device"))
                    if "ranks" in r
                    else report.get("device")
                )
                print(
                    f"[train_multi_gpu] {variant} N={n}: "
                    + json.dumps(
                        {
                            k: r.get(k)
                            for k in (
                                "tokens_per_s_per_gpu",
                                "mfu",
                                "scaling_efficiency",
                                "peak_gib_per_rank",
                                "step_s_median",
                                "wall_s",
                                "error",
                            )
                        }
                    ),
                    flush=True,
                )
                harness.write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
