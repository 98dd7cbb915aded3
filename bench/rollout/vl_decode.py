"""Vision-language rollout on one GPU: the embedded engine with 1 and 4 images a prompt, beside text-only prompts of
the same length on the same language model (issue 44 item 7).

    PYTHONUNBUFFERED=1 python -m bench.rollout.vl_decode --out vl_decode.json

The model is Qwen2.5-VL-3B's shape with random bf16 weights (a 32-block vision tower of width 1,280 with window
attention, its merger into the 36-layer, 2,048-wide language model, vocab 151,936), the demo's char tokenizer
beside it and Qwen2-VL's image processor. Each of `--prompts` prompts is `--text-tokens` random text ids and
`--images` random-noise 448 x 448 pictures (256 merged tokens each), asked for a GRPO group of `--group` samples of
`--new-tokens` tokens each (ignore_eos, temperature 1): batch = prompts x group rows. The text-only variant gives the
same prompts with text ids in place of each picture's tokens, so both decode the same number of positions. Each
variant is warmed up once, then timed `--repeats` times (the median counts); the picture variants' time includes
the image processor and the vision tower, once per distinct picture (the group shares it), which the JSON also
reports as vision-encoder calls.
`--smoke` runs a toy Qwen2-VL on the CPU to check the script.
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig
from transformers import Qwen2VLForConditionalGeneration as Qwen2VLModel

from bench import harness
from rlflow.engines.core.config import KVCacheConfig
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models.hf import build_char_tokenizer
from rlflow.engines.models.vision_language import write_image_processor
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend

IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = 151655, 151652, 151653, 151656
QWEN2_5_VL_3B_TEXT = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                          num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                          rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                          rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
QWEN2_5_VL_3B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3,
                            out_hidden_size=2048, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                            window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
                            hidden_act="silu")
PICTURE = 448  # pixels a side: 32 x 32 patches of 14, merged 2 x 2: 256 tokens
SMOKE_TEXT = dict(vocab_size=IMAGE_TOKEN + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
                  rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
SMOKE_VISION = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2)
SMOKE_PICTURE = 56


def build_vl_model(out: Path, smoke: bool, seed: int = 0) -> Path:
    """Random bf16 weights of the shape (initialised on the GPU when there is one), the char tokenizer, the image
    processor; the special token ids are Qwen's, outside the char tokenizer (prompts are ids, not text)."""
    torch.manual_seed(seed)
    ids = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END, tie_word_embeddings=True)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        if smoke:
            model = Qwen2VLModel(Qwen2VLConfig(text_config=SMOKE_TEXT, vision_config=SMOKE_VISION, **ids))
        else:
            config = Qwen2_5_VLConfig(text_config=QWEN2_5_VL_3B_TEXT, vision_config=QWEN2_5_VL_3B_VISION, **ids)
            model = Qwen2_5_VLForConditionalGeneration(config)
        model.to(torch.bfloat16).save_pretrained(out)
    del model
    build_char_tokenizer().save_pretrained(out)
    write_image_processor(out, 56 * 56, PICTURE * PICTURE)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def picture_bytes(rng: random.Random, side: int) -> bytes:
    """A random-noise RGB picture as PNG bytes (every prompt's own: no two share an embedding)."""
    pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def tokens_per_picture(side: int) -> int:
    return (side // 14 // 2) ** 2


def prompt_ids(rng: random.Random, text: int, images: int, per_image: int, vocab: int) -> list[int]:
    """`text` random ids, then each picture as vision start, its pad tokens, vision end (text ids when
    images is 0 stand in for the same number of positions)."""
    ids = [rng.randrange(3, vocab // 2) for _ in range(text)]
    for _ in range(images):
        ids += [VISION_START, *[IMAGE_TOKEN] * per_image, VISION_END]
    return ids


def time_variant(path: Path, images: int, text_images: int, args, device: str) -> dict:
    """Output tokens/s of one variant: `images` pictures a prompt (0: text only, of the length `text_images`
    pictures would take)."""
    side = SMOKE_PICTURE if args.smoke else PICTURE
    per_image = tokens_per_picture(side)
    rng = random.Random(0)
    vocab = 151936
    prompts, pictures = [], []
    for _ in range(args.prompts):
        if images:
            prompts.append(prompt_ids(rng, args.text_tokens, images, per_image, vocab))
            pictures.append([picture_bytes(rng, side) for _ in range(images)])
        else:
            prompts.append(prompt_ids(rng, args.text_tokens + text_images * (per_image + 2), 0, per_image, vocab))
    rows = [p for p in prompts for _ in range(args.group)]
    row_images = [p for p in pictures for _ in range(args.group)] if images else None
    kv = KVCacheConfig(page_size=16, memory_fraction=args.kv_fraction)
    backend = TorchRolloutBackend(str(path), device=device, dtype=torch.bfloat16, batch_size=len(rows),
                                  context_len=len(rows[0]) + args.new_tokens + 16, kv_cache=kv,
                                  compile=args.compile)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    t0 = time.perf_counter()
    backend.generate(rows, params.model_copy(update={"max_new_tokens": 8}), seed=0, image_data=row_images)
    harness.sync(device)
    warmup_s = time.perf_counter() - t0
    before = backend.engine.stats().get("vision_encoder_calls", 0)
    runs: list = []
    # a new engine cache per run would be fairer to the first run only: clear the embeddings so every timed run
    # pays the vision tower once per distinct picture, as a new step's prompts do
    def one() -> None:
        if backend.engine.vision is not None:
            backend.engine.vision.clear()
        runs.append(backend.generate(rows, params, seed=1 + len(runs), image_data=row_images))

    times = harness.timed(one, args.repeats, on=device)
    tokens = sum(len(g.output_ids) for g in runs[-1])
    calls = backend.engine.stats().get("vision_encoder_calls", 0) - before
    backend.close()
    return {"images_per_prompt": images, "prompt_tokens": len(rows[0]), "rows": len(rows),
            "output_tokens": tokens, "seconds": times, "tokens_per_s": tokens / statistics.median(times),
            "warmup_s": warmup_s, "vision_encoder_calls_per_run": calls / max(len(runs), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="samples a prompt (GRPO group)")
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--images", default="1,4", help="pictures a prompt, each beside a text-only variant")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-fraction", type=float, default=0.6)
    ap.add_argument("--compile", action="store_true", help="rollout.compile")
    harness.add_smoke(ap)
    ap.add_argument("--out", default="vl_decode.json")
    args = ap.parse_args()
    device = harness.device()
    if args.smoke:
        args.prompts, args.group, args.text_tokens, args.new_tokens, args.repeats = 2, 2, 8, 8, 1
    path = build_vl_model(Path(tempfile.mkdtemp(prefix="rlflow-vl-")), args.smoke)
    report = harness.report_header(__spec__.name, None) | {
        "shape": "smoke" if args.smoke else "qwen2.5-vl-3b", "prompts": args.prompts, "group": args.group,
        "text_tokens": args.text_tokens, "new_tokens": args.new_tokens, "compile": args.compile, "variants": []}
    for k in (int(x) for x in args.images.split(",")):
        for images in (k, 0):
            r = time_variant(path, images, k, args, device)
            report["variants"].append(r)
            print(f"[vl_decode] {k} picture(s), images={images}: {r['tokens_per_s']:.0f} tok/s", flush=True)
            harness.write_json(args.out, report)
        pics, text = report["variants"][-2], report["variants"][-1]
        report[f"ratio_{k}_images_vs_text"] = pics["tokens_per_s"] / text["tokens_per_s"]
    harness.write_json(args.out, report)


if __name__ == "__main__":
    main()
