"""The Megatron backend on N GPUs of one host, per parallel layout: fp32 log-prob parity and bf16 MFU. Commands:

    PYTHONUNBUFFERED=1 python -m bench.megatron.multi_gpu --out bench/results/megatron_multi_gpu.json
    PYTHONUNBUFFERED=1 python -m bench.megatron.multi_gpu --shape 7b --sections parity --timeout 240 \\
        --out bench/results/megatron_multi_gpu_7b_parity.json
    PYTHONUNBUFFERED=1 python -m bench.megatron.multi_gpu --shape 7b --sections throughput --layouts tp2,pp2 \\
        --micro-batch-tokens 4096 --timeout 270 --out bench/results/megatron_multi_gpu_7b.json
    PYTHONUNBUFFERED=1 python -m bench.megatron.multi_gpu --shape moe --gpus 4 --layouts tp1,ep2,ep4 \\
        --sections parity,throughput --out bench/results/megatron_multi_gpu_moe.json
    python -m bench.megatron.multi_gpu --smoke --out /tmp/megatron_multi_gpu_smoke.json   # CPU, gloo
    python -m bench.megatron.multi_gpu --smoke --shape moe --layouts tp1,ep2 --out /tmp/moe_smoke.json  # CPU

Every layout (--layouts, default tp1,tp2,pp2; tp<N>pp<M>ep<E>, a missing part 1) runs on the same --gpus ranks
(default 2): tp1 is data parallel over all of them, tp2 one tensor-parallel pair per data-parallel rank, pp2 two
pipeline stages, ep<E> (MoE shapes) expert parallel: the dp = gpus / (tp x pp) data-parallel ranks, each with its
own shard of the batch, split every layer's experts E ways (E must divide dp and the number of experts) and send
each token to its experts' rank by all-to-all; the rest of the model stays replicated over dp. Each (layout,
section) runs in fresh processes (bench/ranks.py: rank r on GPU r, a time limit, a rank out of memory recorded as
the result and the others stopped), nccl on GPUs, gloo on CPUs, the same code:
- parity: MegatronTrainBackend with train.precision fp32 computes the per-token log-probs of one small batch
  (8 rows of --parity-seq/4..--parity-seq random tokens, bench/megatron_checks.rl_batch) under each layout; the
  max abs difference from the first layout, over the real tokens, against the issue's 1e-5 (on GPUs torch's TF32
  matmul flag is recorded: it is off unless something turns it on);
- throughput: bf16 train_step on the RL workload of bench/train/scale.py scaled by N (N x --samples samples, the
  same seed; each data-parallel rank its engines/core/batch.shard_for_workers shard, the ranks of one TP x PP
  group the same one, as the RL session feeds them), one warm-up step then the median of --steps; useful tokens/s
  in all and per GPU, MFU on useful tokens (train_scale.flops_per_step over N x the dense bf16 peak, H100 989
  TFLOP/s), peak memory per rank.
Shapes: --shape 1.5b (Qwen2-1.5B dims, default), 7b (Qwen2.5-7B dims) or moe (bench/megatron/gpu.py's MODEL_MOE:
a 2.6B Qwen3-MoE, 32 experts of width 768, top-4; its MFU counts the active parameters, the top-4 experts and the
router), random weights. MoE layers at tp > 1 need sequence parallelism and Transformer Engine (a recorded error
otherwise), so the moe shape runs at tp1 with pp and ep. Memory of the 7B in
bf16 training: bf16 weights and the fp32 gradient buffer (6 bytes a parameter) split over the TP x PP ranks, fp32
main weights and Adam state (12 bytes) split over all ranks by the distributed optimizer: on two 80 GB H100s about
91 GB a rank at tp1 and 68 GB at tp2 / pp2 before activations and logits, so expect "out of memory" results
(recorded, the run goes on); the fp32 parity section (weights and gradient buffer, 8 bytes a parameter over the
TP x PP ranks) fits: `--shape 7b --sections parity`.

On CPU (--smoke: a toy Llama shape, gloo) every layout runs, tensor and pipeline parallel included: megatron-core
0.16's TP and PP paths run on gloo with the local layer spec (tests/test_megatron.py trains TP=2 and PP=2 on CPU).
--smoke --shape moe takes a toy Qwen3-MoE instead (4 experts, top-2): tp1 and ep2 on 2 gloo ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from bench import harness
from bench.megatron import checks
from bench.megatron.gpu import MODEL_MOE, MODEL_SMOKE, MODEL_SMOKE_MOE, versions
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
from bench.train.scale import QWEN2_1_5B, QWEN2_5_7B, flops_per_step, workload
from rlflow.engines.core.batch import shard_for_workers
from rlflow.engines.core.config import AlgorithmConfig, MegatronConfig, TrainConfig
from rlflow.engines.train.megatron.backend import MegatronTrainBackend

SHAPES = {
    "1.5b": dict(arch="qwen2", **QWEN2_1_5B),
    "7b": dict(arch="qwen2", **QWEN2_5_7B),
    "moe": MODEL_MOE,
    "smoke": MODEL_SMOKE,
    "smoke-moe": MODEL_SMOKE_MOE,
}
PARITY_TOLERANCE = 1e-5  # fp32, the target


def parse_layout(name: str) -> tuple[int, int, int]:
    """(tensor, pipeline, expert) parallel sizes: "tp2" -> (2, 1, 1), "pp2" -> (1, 2, 1), "ep2" -> (1, 1, 2),
    "tp2pp2" -> (2, 2, 1), "tp2ep2" -> (2, 1, 2); an absent part is 1."""
    m = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?(?:ep(\d+))?", name)
    if not name or m is None or any(g is not None and int(g) == 0 for g in m.groups()):
        raise ValueError(
            f"--layouts: {name!r} is not a layout; expected tp<N>pp<M>ep<E> with any part left out but not all, "
            "each size >= 1 (e.g. tp2, pp2, ep2, tp2ep2)"
        )
    tp, pp, ep = (int(g or 1) for g in m.groups())
    return tp, pp, ep


def check_layout(name: str, gpus: int, shape: str, cfg: dict) -> None:
    """A ValueError naming --layouts when `name` cannot run on `gpus` ranks with this shape: TP x PP must divide the
    ranks; expert parallelism needs experts, and must divide the data-parallel size and the number of experts
    (megatron splits each layer's experts over data-parallel ranks)."""
    tp, pp, ep = parse_layout(name)
    if gpus % (tp * pp):
        raise ValueError(f"--layouts: {name} needs a multiple of {tp * pp} ranks, --gpus is {gpus}")
    if ep == 1:
        return
    experts = cfg.get("num_experts", 0)
    if not experts:
        raise ValueError(f"--layouts: {name} sets expert parallelism, but --shape {shape} is dense (no experts)")
    dp = gpus // (tp * pp)
    if dp % ep:
        raise ValueError(
            f"--layouts: {name}: ep{ep} must divide the data-parallel size --gpus / (tp x pp) = {gpus} / {tp * pp} "
            f"= {dp}"
        )
    if experts % ep:
        raise ValueError(f"--layouts: {name}: ep{ep} must divide the {experts} experts of --shape {shape}")


def _build(rank: int, world: int, cfg: dict, out: str) -> None:
    """The random HF model, in its own process (the parent holds no CUDA context)."""
    checks.make_hf_model(out, **cfg)


def _backend(
    model: str,
    precision: str,
    tp: int,
    pp: int,
    ep: int,
    mopts: dict,
    rank: int,
    world: int,
    url: str,
    timeout: float,
    micro_batch_size: int,
):
    device = harness.device()
    train = TrainConfig(
        device=device,
        precision=precision,
        lr=1e-6,
        micro_batch_size=micro_batch_size,
        threads=8 if device == "cuda" else 1,
    )
    return MegatronTrainBackend(
        model,
        train,
        AlgorithmConfig(kl_coef=0.0),
        MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, **mopts),
        rank=rank,
        world_size=world,
        dist_url=url,
        collective_timeout_s=timeout,
    )


def parity_rank(rank: int, world: int, model: str, tp: int, pp: int, ep: int, vocab: int, seq: int, url: str,
                timeout: float, out: str) -> None:
    """fp32 log-probs of the parity batch under (tp, pp, ep); rank 0 saves them to out.safetensors."""
    with rank_result(out, rank) as result:
        result["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        backend = _backend(model, "fp32", tp, pp, ep, {}, rank, world, url, timeout, micro_batch_size=4)
        batch = checks.rl_batch(vocab, rows=8, max_len=seq, min_len=max(seq // 4, 2), seed=1)
        logprobs = backend.forward_logprobs(batch)
        if rank == 0:
            save_file({"logprobs": logprobs.contiguous(), "mask": batch["attention_mask"]}, out + ".safetensors")
        result["ok"] = True
    dist.destroy_process_group()


def throughput_rank(rank: int, world: int, model: str, tp: int, pp: int, ep: int, mopts: dict, cfg: dict, work: dict,
                    url: str, timeout: float, out: str) -> None:
    """bf16 train steps on this rank's data-parallel shard of the N x samples workload."""
    device = harness.device()
    batch = workload(
        cfg["vocab_size"], world * work["samples"], work["prompt"], work["response_min"], work["response_max"]
    )
    with rank_result(out, rank) as result:
        backend = _backend(model, "bf16", tp, pp, ep, mopts, rank, world, url, timeout, micro_batch_size=4096)
        shard = shard_for_workers(batch, world // (tp * pp), 1)[backend.data_parallel_rank()]
        result["local_tokens"] = int(shard["attention_mask"].sum())
        metrics = []
        times = harness.timed(lambda: metrics.append(backend.train_step(shard)), work["steps"] + 1, on=device)
        # the first is the warm-up
        result |= {"step_s": times[1:], "warmup_s": times[0], "loss": metrics[-1].get("loss")}
    dist.destroy_process_group()


def run_layout(a, rank_fn, name: str, target: str, *args) -> dict:
    """rank_fn on --gpus ranks under layout `name`, within --timeout and --deadline: the layout, the ranks' dicts,
    the error that ended the run (None if none), wall seconds."""
    tp, pp, ep = parse_layout(name)
    limit = time_left(a.timeout, a.end)
    if limit < 10:
        return {"tp": tp, "pp": pp, "ep": ep, "error": f"skipped: past --deadline {a.deadline:.0f} s", "ranks": []}
    t0 = time.perf_counter()
    url = rendezvous(target)
    ranks, error = run_and_collect(rank_fn, a.gpus, limit, target, a.model, tp, pp, ep, *args, url, limit)
    return {
        "tp": tp,
        "pp": pp,
        "ep": ep,
        "dp": a.gpus // (tp * pp),
        "error": error,
        "wall_s": time.perf_counter() - t0,
        "ranks": ranks,
        "peak_gib_per_rank": [x.get("peak_gib") for x in ranks],
    }


def run_parity(a, cfg: dict, layouts: list[str], work: Path, out: dict, save) -> None:
    out |= {"rows": 8, "seq": a.parity_seq, "tolerance": PARITY_TOLERANCE, "layouts": {}}
    logprobs: dict[str, torch.Tensor] = {}
    for name in layouts:
        target = str(work / f"parity_{name}")
        r = run_layout(a, parity_rank, name, target, cfg["vocab_size"], a.parity_seq)
        r["tf32_matmul"] = r["ranks"][0].get("tf32_matmul") if r["ranks"] else None
        if r["error"] is None:
            saved = load_file(target + ".safetensors")
            logprobs[name] = saved["logprobs"]
            mask = saved["mask"].bool()
            mask[:, 0] = False  # column 0 has no log-prob
            out["tokens"] = int(mask.sum())
            ref_name = next(iter(logprobs))
            d = (saved["logprobs"] - logprobs[ref_name])[mask].abs()
            r |= {
                "vs": ref_name,
                "max_abs_diff": float(d.max()),
                "mean_abs_diff": float(d.mean()),
                "pass": bool(d.max() <= PARITY_TOLERANCE),
            }
        out["layouts"][name] = r
        save()
        print(
            f"[parity] {name}: " + json.dumps({k: r.get(k) for k in ("vs", "max_abs_diff", "pass", "error")}),
            flush=True,
        )


def run_throughput(a, cfg: dict, layouts: list[str], work: Path, out: dict, save) -> None:
    job = {k: getattr(a, k) for k in ("samples", "prompt", "response_min", "response_max", "steps")}
    mopts = {"micro_batch_tokens": a.micro_batch_tokens, "packing": a.packing}
    lengths = workload(cfg["vocab_size"], a.gpus * a.samples, a.prompt, a.response_min, a.response_max)[
        "attention_mask"
    ].sum(-1)
    flops = flops_per_step(cfg, lengths)
    out |= {
        "samples": a.gpus * a.samples,
        "useful_tokens": int(lengths.sum()),
        "flops_per_step": flops,
        "megatron": mopts,
        "layouts": {},
    }
    for name in layouts:
        r = run_layout(a, throughput_rank, name, str(work / f"throughput_{name}"), mopts, cfg, job)
        ranks = r["ranks"]
        if r["error"] is None and len(ranks) == a.gpus and all("step_s" in x for x in ranks):
            r |= step_figures(ranks, a.steps, out["useful_tokens"], flops)
        out["layouts"][name] = r
        save()
        print(
            f"[throughput] {name}: "
            + json.dumps(
                {
                    k: r.get(k)
                    for k in ("tokens_per_s_per_gpu", "mfu", "step_s_median", "peak_gib_per_rank", "wall_s", "error")
                }
            ),
            flush=True,
        )


SECTIONS = {"parity": run_parity, "throughput": run_throughput}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="ranks every layout runs on (GPUs on a GPU machine)")
    p.add_argument(
        "--layouts",
        default="tp1,tp2,pp2",
        help="comma-separated tp<N>pp<M>ep<E>, any part left out (1): tp2, pp2, ep2, tp2ep2; parity compares each "
        "with the first",
    )
    p.add_argument("--sections", default="parity,throughput", help=f"comma-separated subset of {list(SECTIONS)}")
    add_workload_args(p, SHAPES, steps=2)
    p.add_argument("--parity-seq", type=int, default=512, help="longest row of the parity batch")
    p.add_argument("--micro-batch-tokens", type=int, default=8192, help="megatron.micro_batch_tokens")
    p.add_argument("--packing", action="store_true", help="megatron.packing (THD); default: padded rows")
    p.add_argument("--timeout", type=int, default=240, help="seconds per (layout, section) run, loading included")
    p.add_argument("--out", type=Path, required=True, help="JSON results (rewritten after each section)")
    a = p.parse_args(argv)
    finish_workload_args(a)
    if a.smoke:
        a.parity_seq, a.micro_batch_tokens = 32, 256
    cfg = SHAPES[a.shape]
    layouts = a.layouts.split(",")
    try:
        for name in layouts:
            check_layout(name, a.gpus, a.shape, cfg)
    except ValueError as e:
        p.error(str(e))
    sections = a.sections.split(",")
    if set(sections) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(set(sections) - set(SECTIONS))}; expected a subset of {list(SECTIONS)}")
    visible = torch.cuda.device_count()
    if torch.cuda.is_available() and a.gpus > visible:
        p.error(f"--gpus {a.gpus}: this machine shows {visible} GPUs")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the ranks inherit it
    report = harness.report_header(__spec__.name, argv, name_device=False) | {  # the ranks name their GPU
        "versions": versions(),
        "gpus": a.gpus,
        "visible_gpus": visible,
        "shape": a.shape,
        "model": cfg,
        "config": {k: str(v) for k, v in vars(a).items() if k != "end"},
        "sections": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        a.model = str(Path(tmp) / "model")
        t0 = time.perf_counter()
        run_ranks(_build, 1, time_left(a.timeout, a.end), cfg, a.model)
        print(f"[megatron_multi_gpu] built a random {a.shape} model in {time.perf_counter() - t0:.0f} s", flush=True)

        def save() -> None:
            harness.write_json(a.out, report)

        for name in sections:
            SECTIONS[name](a, cfg, layouts, Path(tmp), report["sections"].setdefault(name, {}), save)
    return report


if __name__ == "__main__":
    main()
