"""End-to-end GRPO on the RL workload, per placement and staleness: tokens/s/GPU side by side (issue 24 item 3).

    PYTHONUNBUFFERED=1 python -m bench.e2e.grpo --shape 7b --out bench/results/e2e_grpo_7b.json   # 2 GPUs (H200s)
    PYTHONUNBUFFERED=1 python -m bench.e2e.grpo --shape 1.5b --out e2e_grpo_15b.json              # 2 GPUs, any
    python -m bench.e2e.grpo --smoke --out /tmp/e2e_grpo_smoke.json                                # CPU: the script

The loop is bench/e2e/bare_loop.py's with the engines as Ray actors, as the flow has them (no Prefect or MLflow:
bench/cpu/overhead.py measures what they add; bench/e2e/fault.py runs the flow itself). Ray must be importable: on the
GPU machines, carry it (`bash bench/device_wheels.sh --ray`). `--set KEY=VALUE` changes every mode's recipe (e.g.
`--set rollout.compile=true --set train.compile=true`). The model is random weights of one of bench/train/scale.py's
shapes (Qwen2-1.5B or Qwen2.5-7B dims) with the demo's char tokenizer beside it (ids outside it decode to nothing,
which is all the reward of random text needs). Each step: --prompts x 8 samples of bench/e2e/workload.py
(256-token prompts, responses of 64-1,792 tokens drawn uniformly and generated to length), the sort task's reward
(0 for random text, so GRPO's advantages are 0: the step computes the same either way), one train step (token
budget 8,192, activation checkpointing, bf16 compute over fp32 master weights, one optimizer step), a weight sync.

Modes (--modes; each in a fresh process under --timeout seconds):
- colocated-sync: trainer and rollout engine share GPU 0 (cuda_ipc sync; the trainer's state parked in host
  memory while the engine runs: train.offload_during_rollout), synchronous;
- disagg-sync, disagg-k1, disagg-k2: the trainer on GPU 0, the rollout engine on GPU 1, nccl sync,
  rollout.max_staleness 0, 1, 2 (k = 2 with algorithm.is_correction: tis, as docs/algorithms.md advises);
- colocated-lora: colocated-sync training rank-16 LoRA adapters (train.lora) on the frozen base, synced through
  the adapter transport (the engine merges the adapter into its weights);
- disagg2x2-sync, disagg2x2-k1: 4 GPUs, two FSDP2 train ranks and two rollout engines, distributed sync
  (gathered buckets broadcast over NCCL), rollout.max_staleness 0 and 1;
- colocated2-sync, colocated4-sync: 2 or 4 GPUs, each with an FSDP2 train rank and a rollout engine (verl's
  colocated layout), cuda_ipc sync (each rank gathers the weights straight into its GPU's engine), the trainer's
  state parked while the engines run, synchronous.
Each mode trains on the same batch (the same seeds: bench/e2e/workload.py draws from them). Per mode, medians
over the steps between the first and the last (--steps in all; the last has no rollout running ahead of it): the
step time and its stages, and tokens/s/GPU = (prompt + response tokens of the step's samples) / step time / GPUs
the mode uses, the unit of issue 24's anchor (NeMo-RL GRPO Llama3.1-8B on 16 H100s: 1,581 on-policy, 2,478
one-step-off). The anchor generates 2,048 samples a step on 16 GPUs, 128 a GPU, with 4 optimizer steps: on 4 GPUs
that is `--prompts 64 --set train.mini_batches=4` (docs/benchmarks.md). For staleness modes `steady_step_s` is what
a long run settles to, max(rollout, train) + sync; a mode cut off by --timeout keeps the steps it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from bench import harness
from bench.e2e.bare_loop import run_bare
from bench.e2e.workload import PROMPT_TOKENS
from bench.train.scale import SHAPES, build_model
from rlflow.engines.core.config import RLConfig, load_recipe
from rlflow.engines.models.hf import build_char_tokenizer

SAMPLES_PER_PROMPT = 8
_TWO_BY_TWO = ["train.num_workers=2", "rollout.num_workers=2", "weight_sync.transport=distributed",
               "weight_sync.bucket_mb=1024"]  # 15 buckets for 7B, not 238: each costs a round of Ray calls
MODES = {  # name: (GPUs, recipe overrides)
    "colocated-sync": (1, ["cluster.colocate=true", "weight_sync.transport=cuda_ipc",
                           "train.offload_during_rollout=true"]),
    "disagg-sync": (2, ["weight_sync.transport=nccl", "rollout.max_staleness=0"]),
    "disagg-k1": (2, ["weight_sync.transport=nccl", "rollout.max_staleness=1"]),
    "disagg-k2": (2, ["weight_sync.transport=nccl", "rollout.max_staleness=2", "algorithm.is_correction=tis"]),
    # LoRA (issue 23): rank-16 adapters on the frozen bf16 base; only the adapter moves at a sync
    "colocated-lora": (1, ["cluster.colocate=true", "weight_sync.transport=adapter", "train.lora.rank=16",
                           "train.lora.alpha=32", "train.offload_during_rollout=true"]),
    # four GPUs: FSDP2 over two train ranks, two rollout engines, gathered buckets broadcast over NCCL
    "disagg2x2-sync": (4, [*_TWO_BY_TWO, "rollout.max_staleness=0"]),
    "disagg2x2-k1": (4, [*_TWO_BY_TWO, "rollout.max_staleness=1"]),
    # verl's colocated layout: every GPU holds an FSDP2 train rank and a rollout engine, cuda_ipc: each rank gathers
    # the weights into its GPU's engine (engines/sync/cuda_ipc.py), the trainer's state parked while engines generate
    **{f"colocated{n}-sync": (n, ["cluster.colocate=true", "weight_sync.transport=cuda_ipc",
                                  "train.offload_during_rollout=true", f"train.num_workers={n}",
                                  f"rollout.num_workers={n}"]) for n in (2, 4)},
    # the long-tail workload's asynchronous layouts (issue 45 item 7): generation is most of the work, so three
    # engines and one train rank; k >= 2 lets a long generation continue across weight updates (partial rollouts)
    **{f"disagg1x3-k{k}": (4, ["train.num_workers=1", "rollout.num_workers=3", "weight_sync.transport=distributed",
                               "weight_sync.bucket_mb=1024", f"rollout.max_staleness={k}",
                               *(["algorithm.is_correction=tis"] if k >= 2 else [])]) for k in (1, 2, 4)},
    "disagg2x2-k2": (4, [*_TWO_BY_TWO, "rollout.max_staleness=2", "algorithm.is_correction=tis"]),
}
WORKLOADS = {  # --workload: the rollout function and the response cap (GPU, smoke)
    "uniform": ("bench.e2e.workload:fixed_lengths", 1792, 8),
    "long-tail": ("bench.e2e.workload:long_tail", 28672, 16),
}


def build_workload_model(shape: str, out: Path) -> Path:
    """Random weights of the shape (bf16 safetensors) and the demo's char tokenizer."""
    build_model(SHAPES[shape], out)
    build_char_tokenizer().save_pretrained(out)
    return out


def workload_overrides(work: Path, model: Path, mode: str, prompts: int, steps: int, device: str,
                       max_new_tokens: int, rollout_fn: str = WORKLOADS["uniform"][0]) -> list[str]:
    """The demo recipe's changes that make it the workload: the model, the rollout function, the batch, one optimizer
    step, the mode's placement (also `rlflow run deployments/sort-tiny.yaml --set ...`'s, bench/e2e/fault.py)."""
    _, placement = MODES[mode]
    return [
        f"name=e2e-{mode}", f"model.path={model}", f"data.train_path={work}/train.jsonl",
        f"data.eval_path={work}/eval.jsonl", f"storage.uri=file://{work}/runs",
        f"rollout.fn={rollout_fn}", f"rollout.prompts_per_step={prompts}",
        f"rollout.samples_per_prompt={SAMPLES_PER_PROMPT}", f"rollout.max_new_tokens={max_new_tokens}",
        f"train.device={device}", f"rollout.device={device}", "train.precision=bf16", "rollout.precision=bf16",
        "train.micro_batch_tokens=8192", "train.activation_checkpointing=full", "train.mini_batches=1",
        "train.epochs=1", f"train.steps={steps}", "eval.every=0", "checkpoint.every=0",
        "checkpoint.save_rollouts=true", "cluster.cpus_per_worker=1", "cluster.num_cpus=8", *placement,
    ]


def recipe(work: Path, model: Path, mode: str, prompts: int, steps: int, device: str, max_new_tokens: int,
           extra: list[str] = (), rollout_fn: str = WORKLOADS["uniform"][0]) -> RLConfig:
    """The workload's recipe; `extra` overrides come last (--set)."""
    return load_recipe("deployments/sort-tiny.yaml", [
        *workload_overrides(work, model, mode, prompts, steps, device, max_new_tokens, rollout_fn), *extra])


def run_mode(shape: str, mode: str, prompts: int, steps: int, model: Path, extra: list[str],
             workload: str = "uniform") -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"rlflow-e2e-{mode}-"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rollout_fn, cap, smoke_cap = WORKLOADS[workload]
    max_new = cap if shape != "smoke" else smoke_cap
    history = run_bare(recipe(work, model, mode, prompts, steps, device, max_new, extra, rollout_fn), str(work),
                       log=lambda line: print(line, flush=True), use_ray=True)
    return summarize(history, mode, prompts, gpus=MODES[mode][0] if device == "cuda" else 0)


def summarize(history: list[dict], mode: str, prompts: int, gpus: int, finished: bool = True) -> dict:
    """A mode's figures from its step metrics: medians over the steps between the first and the last.

    The first step is not timed (nothing ran ahead of it; compilation), nor, with max_staleness >= 1, the last (no
    rollout runs ahead under it: it is only train + sync, which flattered one-step-off 1.2x in a 3-step run). With
    staleness, a step can be shorter than its rollout only while the rollouts run ahead of a long first step, so
    `steady_step_s` is what a long run settles to: the median step, or the median of max(rollout, train) + sync
    over the same steps where that is longer (the step time itself when sync).
    `finished`: false for a mode its timeout cut off, whose last logged step was not the run's last."""
    stale = max(h.get("train/staleness_max", 0) for h in history)
    warm = history[1:-1] if finished and stale and len(history) > 2 else history[1:]
    if not warm:
        return {"mode": mode, "steps": len(history), "error": "no step after the first finished"}

    def median(key: str) -> float | None:
        values = [h[key] for h in warm if key in h]
        return statistics.median(values) if values else None

    samples = prompts * SAMPLES_PER_PROMPT
    tokens = statistics.median(h["rollout/tokens"] + PROMPT_TOKENS * samples for h in warm)
    step_s, rollout_s, train_s, sync_s = (median(k) for k in ("time/step", "time/rollout", "time/train", "time/sync"))
    bound = statistics.median(max(h["time/rollout"], h["time/train"]) + h["time/sync"] for h in warm)
    steady_s = max(step_s, bound) if stale else step_s
    return {"mode": mode, "gpus": gpus, "samples": samples, "tokens_per_step": tokens, "step_s": step_s,
            "tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": tokens / step_s / gpus if gpus else None,
            "steady_step_s": steady_s, "steady_tokens_per_s_per_gpu": tokens / steady_s / gpus if gpus else None,
            "rollout_s": rollout_s, "train_s": train_s, "sync_s": sync_s,
            # time/sync holds a colocated trainer's parking too (time/offload); the transfer alone is bytes / GB/s
            "offload_s": median("time/offload"), "onload_s": median("time/onload"),
            "sync_gb_per_s": median("sync/gb_per_s"), "sync_bytes": median("sync/bytes"),
            "train_worker_s": median("time/train_worker"), "train_tokens_per_s": median("train/tokens_per_s"),
            "staleness_max": stale, "steps": len(history), "timed_steps": len(warm),
            "per_step": [{k: h.get(k) for k in PER_STEP} for h in history]}


PER_STEP = ("step", "time/step", "time/rollout", "time/train", "time/sync", "rollout/tokens", "train/tokens_per_s")


def logged_steps(output: str) -> list[dict]:
    """The step metrics a mode printed (one JSON line a step): what is left of a mode cut off by its timeout."""
    steps = []
    for line in output.splitlines():
        if line.startswith('{"step": '):
            with contextlib.suppress(json.JSONDecodeError):  # the line the timeout cut
                steps.append(json.loads(line))
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1.5b", choices=["1.5b", "7b"])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prompts", type=int, default=16, help="prompts a step (x 8 samples)")
    ap.add_argument("--steps", type=int, default=5, help="steps a mode (the first and last are not timed)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a mode may take")
    harness.add_smoke(ap)
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY.PATH=VALUE",
                    help="a recipe change for every mode, after the mode's own (e.g. rollout.compile=true)")
    ap.add_argument("--workload", default="uniform", choices=list(WORKLOADS),
                    help="response lengths: uniform 64-1,792, or long-tail (lognormal, median 3,000, cap 28,672)")
    ap.add_argument("--out", default="e2e_grpo.json")
    ap.add_argument("--child", nargs="*")
    a = ap.parse_args()
    if a.child is not None:
        shape, mode, model = a.child
        result = run_mode(shape, mode, a.prompts, a.steps, Path(model), a.overrides, a.workload)
        harness.emit_result(result)
        return
    shape = "smoke" if a.smoke else a.shape
    gpus = torch.cuda.device_count()
    report = harness.report_header(__spec__.name, None) | {
              "shape": shape, "workload": a.workload, "prompts": a.prompts, "steps": a.steps,
              "overrides": a.overrides, "modes": []}
    model = build_workload_model(shape, Path(tempfile.mkdtemp(prefix="rlflow-e2e-model-")))  # one for every mode
    sets = [arg for o in a.overrides for arg in ("--set", o)]
    for mode in a.modes.split(","):
        needs = MODES[mode][0]
        if (gpus and gpus < needs) or (not gpus and mode.startswith("colocated")):  # on CPUs: cuda_ipc has no path
            report["modes"].append({"mode": mode, "skipped": f"needs {needs} GPU(s), {gpus} here"})
            continue
        r = harness.run_child(["-m", __spec__.name, "--child", shape, mode, str(model), "--prompts", str(a.prompts),
                               "--steps", str(a.steps), "--workload", a.workload, *sets], a.timeout, echo=True,
                              keep_output=True)
        output = r.pop("output", "")
        if "error" in r and len(steps := logged_steps(output)) >= 2:  # cut off: keep the steps it finished
            r |= summarize(steps, mode, a.prompts, needs if gpus else 0, finished=False) | {"partial": r.pop("error")}
        if shutil.which("ray"):  # a mode that timed out leaves its Ray workers (and their GPU memory) behind
            subprocess.run(["ray", "stop", "--force"], capture_output=True)
        report["modes"].append({"mode": mode} | r)
        print(f"[e2e_grpo] {mode}: {json.dumps(r)[:400]}", flush=True)
        harness.write_json(a.out, report)
    done = {m["mode"]: m for m in report["modes"] if m.get("step_s")}  # a cut-off mode's finished steps count
    for sync, others in (("disagg-sync", ("disagg-k1", "disagg-k2", "colocated-sync")),
                         ("disagg2x2-sync", ("disagg2x2-k1",))):
        for mode in others:
            if sync in done and mode in done:
                name = f"{mode}_vs_{sync.replace('-', '_')}"
                report[f"speedup_{name}"] = done[sync]["step_s"] / done[mode]["step_s"]
                report[f"steady_speedup_{name}"] = done[sync]["steady_step_s"] / done[mode]["steady_step_s"]
    report |= best_async_vs_sync(list(done.values()))
    harness.write_json(a.out, report)


def best_async_vs_sync(done: list[dict]) -> dict:
    """Issue 45's comparison: the best asynchronous mode's steady tokens/s/GPU over the best synchronous one's,
    each the best of the modes that ran (whatever their GPU count: the unit is per GPU)."""
    def best(modes: list[dict]) -> dict | None:
        rated = [m for m in modes if m.get("steady_tokens_per_s_per_gpu")]
        return max(rated, key=lambda m: m["steady_tokens_per_s_per_gpu"]) if rated else None

    sync = best([m for m in done if not m.get("staleness_max")])
    async_ = best([m for m in done if m.get("staleness_max")])
    if not (sync and async_):
        return {}
    return {"best_sync": sync["mode"], "best_async": async_["mode"],
            "best_async_vs_best_sync": async_["steady_tokens_per_s_per_gpu"] / sync["steady_tokens_per_s_per_gpu"]}


if __name__ == "__main__":
    main()
