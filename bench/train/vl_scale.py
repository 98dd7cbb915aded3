"""Vision-language training on one GPU: the native backend on a VL batch beside the same batch as text only
(issue 44 item 7).

    PYTHONUNBUFFERED=1 python -m bench.train.vl_scale --out vl_scale.json

The model is bench/rollout/vl_decode.py's Qwen2.5-VL-3B shape (random bf16 weights). The batch: `--samples` GRPO
samples, each a prompt of 64 text ids and `--images` random 448 x 448 pictures (256 merged tokens each, one picture
per group of 8 samples shared, as a GRPO group shares its prompt), and a response of uniform(64, `--response-max`)
tokens; the text-only variant has text ids in the pictures' places (the same lengths). TorchTrainBackend.train_step
in bf16 (FSDP2 on one rank, token budget 16,384, activation checkpointing), `train.freeze_vision` true (the
tower runs forward only, once per distinct picture in a micro-batch) and, as `--trained-vision`, false.
Figures: useful tokens/s; MFU of the language model (bench/train/scale.flops_per_step over its dims); the vision
tower's FLOPs counted apart (forward 2 x matmul params x patches + attention over its windows and full blocks, x3
when it trains) and an MFU with them added. The GPU's dense bf16 peak (H100/H200 989 TFLOP/s).
`--smoke` runs a toy Qwen2-VL on the CPU to check the script.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from bench import harness
from bench.rollout.vl_decode import (
    PICTURE,
    QWEN2_5_VL_3B_TEXT,
    QWEN2_5_VL_3B_VISION,
    SMOKE_PICTURE,
    SMOKE_TEXT,
    SMOKE_VISION,
    build_vl_model,
    picture_bytes,
    prompt_ids,
    tokens_per_picture,
)
from bench.train.scale import flops_per_step
from rlflow.engines.core.batch import IMAGE_IDS, image_ids
from rlflow.engines.core.config import AlgorithmConfig, StorageConfig, TrainConfig
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.train.torch_backend import TorchTrainBackend

GROUP = 8  # samples a picture is shared by


def vision_flops(vision: dict, patches: int, trained: bool, smoke: bool) -> float:
    """FLOPs of the vision tower on one picture of `patches` patches (forward, x3 when it trains)."""
    width = vision.get("hidden_size") if not smoke else vision["embed_dim"]
    if smoke:
        mlp = 2 * width * width * vision["mlp_ratio"]
    else:
        mlp = 3 * width * vision["intermediate_size"]  # SwiGLU
    block = 4 * width * width + mlp  # qkv + proj, the MLP
    merge = vision["spatial_merge_size"] ** 2
    out = vision.get("out_hidden_size", vision["hidden_size"])
    merger = (width * merge) ** 2 + width * merge * out
    patch_in = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2 * width
    matmul = vision["depth"] * block * patches + (merger * patches / merge) + patch_in * patches
    full = set(vision.get("fullatt_block_indexes", range(vision["depth"])))
    window = (vision.get("window_size", 0) // vision["patch_size"]) ** 2 or patches
    attention = sum(4 * patches * (patches if b in full else min(window, patches)) * width
                    for b in range(vision["depth"]))
    return (2 * matmul + attention) * (3 if trained else 1)


def batch_and_store(args, store: RunStore, images: int) -> tuple[dict, torch.Tensor, int]:
    """The right-padded TrainBatch (with IMAGE_IDS when `images`), its lengths, and the distinct pictures."""
    rng, responses = random.Random(0), random.Random(1)  # the responses' lengths the same in every variant
    side = SMOKE_PICTURE if args.smoke else PICTURE
    per = tokens_per_picture(side)
    n = args.samples
    rows, digests = [], []
    for _ in range(n // GROUP):
        pics = [picture_bytes(rng, side) for _ in range(args.images)]
        ids = prompt_ids(rng, 64, args.images, per, 151936) if images else prompt_ids(
            rng, 64 + args.images * (per + 2), 0, per, 151936)
        names = [store.put_image(p) for p in pics] if images else []
        for _ in range(GROUP):
            length = responses.randint(64 if not args.smoke else 4, args.response_max)
            response = [responses.randrange(3, 151936 // 2) for _ in range(length)]
            rows.append((ids, response))
            digests.append(names)
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    attn, loss_mask = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width)
    for i, (p, r) in enumerate(rows):
        input_ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        attn[i, :len(p) + len(r)] = 1
        loss_mask[i, len(p):len(p) + len(r)] = 1
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": input_ids, "attention_mask": attn, "loss_mask": loss_mask,
             "old_logprobs": torch.zeros(n, width), "advantages": torch.randn(n, generator=g)}
    if images:
        batch[IMAGE_IDS] = image_ids(digests)
    return batch, attn.sum(-1), (n // GROUP) * args.images


def run(args, path: Path, images: int, trained_vision: bool, device: str, peak: float | None) -> dict:
    store = RunStore(StorageConfig(uri=str(path.parent / "store")), "vl")
    batch, lengths, pictures = batch_and_store(args, store, images)
    train = TrainConfig(device=device, precision="bf16", lr=1e-6, micro_batch_size=4096, threads=8,
                        micro_batch_tokens=args.micro_batch_tokens, activation_checkpointing="full",
                        freeze_vision=not trained_vision)
    backend = TorchTrainBackend(str(path), train, AlgorithmConfig(kl_coef=0.0),
                                storage=StorageConfig(uri=str(path.parent / "store")), run="vl")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        times = harness.timed(lambda: backend.train_step(batch), args.steps, warmup=1, on=device)
    except torch.OutOfMemoryError as e:
        return {"images": images, "trained_vision": trained_vision, "error": f"out of memory: {e}".splitlines()[0]}
    text_cfg = SMOKE_TEXT if args.smoke else QWEN2_5_VL_3B_TEXT
    side = SMOKE_PICTURE if args.smoke else PICTURE
    patches = (side // 14) ** 2
    lang = flops_per_step(text_cfg, lengths)
    vision = vision_flops(SMOKE_VISION if args.smoke else QWEN2_5_VL_3B_VISION, patches, trained_vision,
                          args.smoke) * pictures if images else 0.0
    step = harness.median(times)
    out = {"images": images, "trained_vision": trained_vision, "step_s": times, "useful_tokens": int(lengths.sum()),
           "tokens_per_s": float(lengths.sum()) / step, "language_tflops": lang / step / 1e12,
           "vision_tflops": vision / step / 1e12, "vision_flops_share": vision / (lang + vision),
           "pictures": pictures, "peak_gib": harness.peak_gib()}
    if peak:
        out |= {"mfu_language": lang / step / 1e12 / peak, "mfu_with_vision": (lang + vision) / step / 1e12 / peak}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--images", type=int, default=1, help="pictures a prompt")
    ap.add_argument("--response-max", type=int, default=1024)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--trained-vision", action="store_true", help="also time train.freeze_vision false")
    harness.add_smoke(ap)
    ap.add_argument("--out", default="vl_scale.json")
    args = ap.parse_args()
    device = harness.device()
    if args.smoke:
        args.samples, args.response_max, args.steps, args.micro_batch_tokens = 16, 12, 1, 256
    work = Path(tempfile.mkdtemp(prefix="rlflow-vl-train-"))
    path = build_vl_model(work / "model", args.smoke)
    report = harness.report_header(__spec__.name, None)
    peak = harness.by_device(harness.PEAK_BF16_TFLOPS, report["device"])
    report |= {"peak_tflops": peak, "shape": "smoke" if args.smoke else "qwen2.5-vl-3b", "samples": args.samples,
               "images_per_prompt": args.images, "response_max": args.response_max, "variants": []}
    plan = [(args.images, False), (0, False)] + ([(args.images, True)] if args.trained_vision else [])
    for images, trained in plan:
        r = run(args, path, images, trained, device, peak)
        report["variants"].append(r)
        print("[vl_scale]", json.dumps({k: v for k, v in r.items() if k != "step_s"}), flush=True)
        harness.write_json(args.out, report)
        if device == "cuda":
            torch.cuda.empty_cache()
    with_images, text = report["variants"][0], report["variants"][1]
    if "tokens_per_s" in with_images and "tokens_per_s" in text:
        report["tokens_per_s_images_vs_text"] = with_images["tokens_per_s"] / text["tokens_per_s"]
    harness.write_json(args.out, report)


if __name__ == "__main__":
    main()
