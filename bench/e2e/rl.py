"""GPU placement, weight sync and one-step-off async, measured side by side on the device machine:

    PYTHONUNBUFFERED=1 python -m bench.e2e.rl --out gpu_rl.json            # 2 GPUs: every section

weight_sync: a Qwen2-0.5B- and a Qwen2-1.5B-shaped model (random weights, full 151936 vocab) in the torch
    train backend (fp32 master weights) and the rollout backend (bf16), as Ray actors placed by the recipe:
    - colocated (cluster.colocate, one GPU): transport cuda_ipc, against the measured device-to-device copy
      bandwidth of that GPU; also with the rollout engine's weights released and resumed around it;
    - disaggregated (two GPUs): transport nccl, against a plain NCCL broadcast of 1 GiB between the same two
      actors; and transport ray (through Ray's object store, the CPU path) for reference.
    GB/s counts the bytes each rollout worker receives (bf16). Every sync is checked: the rollout's weights
    sum to the trainer's weights cast to bf16.
async: the sort recipe on a ~0.3B Llama on two GPUs (train on one, rollout on the other, nccl sync), sync
    vs one-step-off (rollout.max_staleness 1), driven by bench/e2e/bare_loop.py with the engines in Ray
    actors. max_new_tokens is first calibrated so that rollout and training take about the same time.

Each section runs in its own process with a time limit and the JSON is rewritten after each. No Prefect or
MLflow (the orchestration overhead has its own CPU benchmark, bench/cpu/overhead.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from bench import harness
from bench.e2e.bare_loop import run_bare
from rlflow.engines.core.config import RLConfig, load_recipe
from rlflow.engines.core.protocols import RolloutBackend
from rlflow.engines.models.hf import build_char_tokenizer
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data
from rlflow.engines.sync.endpoints import GpuLinkProbe

QWEN2 = {  # Qwen2.5-0.5B and -1.5B shapes (tied embeddings)
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
}


def build_random_qwen2(size: str, out: Path) -> Path:
    """A random-weight Qwen2 of `size` (bf16 safetensors) with the demo's char tokenizer beside it."""
    vocab = 151936 if size != "smoke" else 256
    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=True, **QWEN2[size])
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return out


def _recipe(work: Path, overrides: list[str]) -> RLConfig:
    base = [
        f"data.train_path={work}/train.jsonl", f"data.eval_path={work}/eval.jsonl", "train.device=cuda",
        "rollout.device=cuda", "rollout.precision=bf16", "train.precision=bf16", "cluster.cpus_per_worker=1",
        "cluster.num_cpus=8", "cluster.object_store_mb=8192", f"storage.uri=file://{work}/runs",
        "checkpoint.save_rollouts=true",
    ]
    return load_recipe("deployments/sort-tiny.yaml", base + overrides)


# ---- weight sync -----------------------------------------------------------------------------------------
def weight_sync(size: str, mode: str, repeats: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="rlflow-sync-"))
    model = build_random_qwen2(size, work / "model")
    transport, _, bucket_mb = mode.partition("@")  # e.g. nccl@128: bucket size in MB (default 512)
    placement = {
        "cuda_ipc": ["cluster.colocate=true", "weight_sync.transport=cuda_ipc"],
        "nccl": ["weight_sync.transport=nccl"],
        "ray": ["weight_sync.transport=ray"],
    }[transport]
    cfg = _recipe(work, [f"name=sync-{transport}", f"model.path={model}", f"weight_sync.bucket_mb={bucket_mb or 512}",
                         *placement])
    prepare_data(cfg)
    session = RLSession.create(cfg, str(model))
    try:
        train, rollout = session.train_group, session.rollout_group
        times, released, in_worker, ray_call = [], [], [], []
        for step in range(repeats + 1):
            m = session.sync_weights(step)
            if step:  # the first sync also sets the link up
                times.append(m["sync/bytes"] / m["sync/gb_per_s"] / 1e9)
                t0 = time.perf_counter()  # a no-op round trip: the control cost inside every sync
                in_worker.append(rollout.call_rank0(RolloutBackend.last_update_seconds))
                ray_call.append(time.perf_counter() - t0)
        nbytes = m["sync/bytes"]
        digest = GpuLinkProbe.weights_digest
        digest_ok = abs(train.call_rank0(digest, "bf16") - rollout.call_rank0(digest)) < 1e-3
        extra = {}
        if transport == "cuda_ipc":  # what a colocated step really pays: weights released for training, resumed
            for step in range(repeats):
                t0 = time.perf_counter()
                rollout.call(RolloutBackend.release_memory_occupation)
                session.sync_weights(repeats + 1 + step)
                released.append(time.perf_counter() - t0)
            link = train.call_rank0(GpuLinkProbe.link_bandwidth, "copy", 1 << 30)
            link_name = "device-to-device copy"
            extra["cast_copy_gb_per_s"] = train.call_rank0(GpuLinkProbe.link_bandwidth, "cast_copy", 1 << 30)
        elif transport == "nccl":
            probe = train.submit_rank0(GpuLinkProbe.link_bandwidth, "nccl", 1 << 30)
            rollout.call(GpuLinkProbe.link_bandwidth, "nccl", 1 << 30)
            link = train.wait([probe])[0]
            link_name = "NCCL broadcast, GPU to GPU"
        else:
            link, link_name = None, None
        t = statistics.median(times)
        out = extra | {"size": size, "transport": mode, "bytes": nbytes, "sync_s": t, "gb_per_s": nbytes / t / 1e9,
               "weights_match": digest_ok, "link": link_name, "link_gb_per_s": link,
               "fraction_of_link": (nbytes / t / 1e9) / link if link else None}
        if released:
            out["sync_with_release_resume_s"] = statistics.median(released)
        if transport != "ray":  # the transfer as the receiving worker times it, without the driver's Ray calls
            w = statistics.median(in_worker)
            out |= {"in_worker_s": w, "in_worker_gb_per_s": nbytes / w / 1e9,
                    "in_worker_fraction_of_link": nbytes / w / 1e9 / link, "ray_call_s": statistics.median(ray_call)}
        return out
    finally:
        session.shutdown()


# ---- async vs sync -----------------------------------------------------------------------------------------
ASYNC_MODEL = ["model.hidden_size=1024", "model.intermediate_size=4096", "model.num_layers=24", "model.num_heads=16",
               "model.num_kv_heads=16", "model.max_seq_len=1024"]


def _loop(work: Path, overrides: list[str], steps: int) -> list[dict]:
    cfg = _recipe(work, [*ASYNC_MODEL, "weight_sync.transport=nccl", f"train.steps={steps}", "eval.every=0",
                         "checkpoint.every=0", "rollout.batch_size=512",
                         "train.micro_batch_size=64", *overrides])
    return run_bare(cfg, str(work), log=lambda line: print(line, flush=True), use_ray=True)


def async_speedup(steps: int, smoke: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="rlflow-async-"))
    extra = ["model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128", "model.num_heads=4",
             "model.num_kv_heads=4"] if smoke else []
    m0 = 64
    calib = _loop(work, [f"rollout.max_new_tokens={m0}", *extra], 3)[-1]
    rollout_s, rest_s = calib["time/rollout"], calib["time/step"] - calib["time/rollout"]
    new_tokens = max(8, min(512, round(m0 * rest_s / rollout_s)))
    runs = {}
    for label, off in (("sync", 0), ("one_step_off", 1)):
        hist = _loop(work, [f"rollout.max_new_tokens={new_tokens}", f"rollout.max_staleness={off}", *extra], steps)
        warm = hist[2:]
        runs[label] = {"step_s": statistics.mean(h["time/step"] for h in warm),
                       "rollout_s": statistics.mean(h["time/rollout"] for h in warm if "time/rollout" in h),
                       "train_s": statistics.mean(h["time/train"] for h in warm),
                       "sync_s": statistics.mean(h["time/sync"] for h in warm),
                       "staleness_max": max(h.get("train/staleness_max", 0) for h in hist)}
    return {"calibration": {"max_new_tokens_probe": m0, "rollout_s": rollout_s, "rest_s": rest_s},
            "max_new_tokens": new_tokens, **runs,
            "speedup": runs["sync"]["step_s"] / runs["one_step_off"]["step_s"]}


# ---- driver ----------------------------------------------------------------------------------------------
def run_section(args: list[str], timeout: float) -> dict:
    """One section in a fresh process (`--child <args>`) under `timeout` seconds: its result or its error."""
    return harness.run_child(["-m", __spec__.name, "--child", *args], timeout, echo=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_rl.json")
    ap.add_argument("--sections", default="weight_sync,async")
    ap.add_argument("--sizes", default="0.5B,1.5B")
    ap.add_argument("--modes", default="cuda_ipc,nccl@128,nccl@512,ray", help="transport[@bucket MB], comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    harness.add_smoke(ap)
    ap.add_argument("--child", nargs="*")
    a = ap.parse_args()
    if a.child is not None:
        kind, *rest = a.child
        res = weight_sync(rest[0], rest[1], a.repeats) if kind == "weight_sync" else async_speedup(a.steps, a.smoke)
        harness.emit_result(res)
        return
    gpus = torch.cuda.device_count()
    report = harness.report_header(__spec__.name, None) | {"weight_sync": [], "async": None}
    sizes = ["smoke"] if a.smoke else a.sizes.split(",")
    smoke = ["--smoke"] if a.smoke else []
    if "weight_sync" in a.sections:
        for size in sizes:
            for mode in a.modes.split(","):
                if not mode.startswith("cuda_ipc") and gpus < 2:
                    continue
                r = run_section(["weight_sync", size, mode, *smoke, "--repeats", str(a.repeats)], 240)
                report["weight_sync"].append({"size": size, "transport": mode} | r)
                harness.write_json(a.out, report)
    if "async" in a.sections and gpus >= 2:
        report["async"] = run_section(["async", *smoke, "--steps", str(a.steps)], 420)
        harness.write_json(a.out, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
