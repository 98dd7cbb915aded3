"""Vision-language models (Qwen2-VL and Qwen2.5-VL): the prompt processor, M-RoPE positions and the tiny demo model.

Why our own processor object and not `AutoProcessor`: transformers 5's Qwen2-VL processor also builds its video
processor, which imports torchvision, and no torchvision wheel in the registry matches the CPU torch CI runs.
`VisionProcessor` is the part of it RL needs, from the model's own pieces: the tokenizer's chat template (which
writes one `<|image_pad|>` per image) and the model's own image processor (`AutoImageProcessor`: resize, patches,
`image_grid_thw`); it then repeats each image's pad token once per merged patch, as Qwen2VLProcessor does.

Why our own M-RoPE index: the positions of a prompt are needed in three places (the engine's prefill, its decode
offset, the trainer's packed stream), for one sample at a time, and transformers changed `get_rope_index`'s
signature between the versions we run (5.17 on the GPU machine, 5.23 here). `mrope_positions` is the same rule,
checked against transformers' in tests/test_vl_engine.py: text tokens advance all three components together; an
image's merged patches take (t, row, column) offsets from the position where the image starts; the text after
it continues from that start + max(rows, columns).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration

from rlflow.engines.core.config import ModelConfig
from rlflow.engines.core.images import IMAGE_PLACEHOLDER, VL_MODEL_TYPES, image_digest, model_type_of

IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
VISION_PREFIX = "model.visual."  # the vision tower's parameters (patch embedding, blocks, merger), transformers 5

# the demo's chat template: the text one, with an image written as vision start, one pad token, vision end
VL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}" + VISION_START + IMAGE_PAD + VISION_END
    + "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
)
# the tiny model's images: 56-112 pixels a side, 14-pixel patches merged 2x2, so 4-16 tokens an image
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 56 * 56, 112 * 112


def is_vision_language(path_or_config) -> bool:
    """Whether a model directory (or a loaded config) is one of the vision-language models rlflow runs."""
    if isinstance(path_or_config, (str, Path)):
        return model_type_of(path_or_config) in VL_MODEL_TYPES
    return getattr(path_or_config, "model_type", None) in VL_MODEL_TYPES


def build_tiny_vl_model(cfg: ModelConfig, out_dir: str | Path, seed: int, tokenizer) -> Path:
    """A randomly initialised tiny Qwen2-VL in `out_dir`: `tokenizer` (the demo's character tokenizer) with the
    vision tokens added, its image chat template, and a PIL image processor for small images (the CPU demo)."""
    out_dir = Path(out_dir)
    # a video pad of its own, never used: transformers' placeholder and position code tells images from videos by id
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)}
    head_dim = cfg.hidden_size // cfg.num_heads
    half = head_dim // 2  # M-RoPE splits the rotary frequencies into (temporal, height, width) sections
    section = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
            max_position_embeddings=cfg.max_seq_len, rope_scaling={"type": "mrope", "mrope_section": section},
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        ),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=cfg.hidden_size, num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids[IMAGE_PAD], vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        video_token_id=ids[VIDEO_PAD], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    write_image_processor(out_dir, TINY_MIN_PIXELS, TINY_MAX_PIXELS)
    return out_dir


def write_image_processor(out_dir: str | Path, min_pixels: int, max_pixels: int) -> Path:
    """Qwen2-VL's image processor config (preprocessor_config.json) for images of min_pixels..max_pixels.

    Written as JSON rather than by an image processor class: transformers picks the class when it loads it
    (AutoImageProcessor: the PIL backend without torchvision, the torchvision one with it, the older
    min_pixels/max_pixels keys on the GPU machine's 5.17), so one file serves every version we run."""
    config = {
        "image_processor_type": "Qwen2VLImageProcessor", "do_convert_rgb": True, "do_normalize": True,
        "do_rescale": True, "do_resize": True, "rescale_factor": 1 / 255, "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": min_pixels,
        "max_pixels": max_pixels, "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }
    path = Path(out_dir) / "preprocessor_config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def open_image(data: bytes) -> Image.Image:
    """An image's encoded bytes (PNG, JPEG, ...) as an RGB PIL image."""
    return Image.open(io.BytesIO(data)).convert("RGB")


def data_uri(data: bytes) -> str:
    """An image's bytes as a base64 data URI (what /generate's image_data takes), its MIME type from the format
    PIL reads in it."""
    with Image.open(io.BytesIO(data)) as img:
        mime = Image.MIME.get(img.format or "", "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


@dataclass
class VisionPrompt:
    """A prompt with images, as the model takes it: the token ids with each image's pad token repeated once per
    merged patch, and each image's (t, h, w) patch grid."""

    prompt_ids: list[int]
    image_grid_thw: list[list[int]]


class VisionProcessor:
    """The model's tokenizer and image processor, and the rule that joins them (see the module's docstring)."""

    def __init__(self, path: str | Path, tokenizer=None):
        self.path = str(path)
        config = json.loads((Path(path) / "config.json").read_text())
        self._tokenizer = tokenizer  # loaded on first use: a train worker only turns pictures into pixels
        self.image_processor = AutoImageProcessor.from_pretrained(self.path)
        self.merge = int(self.image_processor.merge_size)
        self.image_token_id = int(config["image_token_id"])
        self._grids: dict[str, list[int]] = {}  # image digest -> its patch grid (grids_of)
        self.vision_start_id = int(config["vision_start_token_id"])

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        return self._tokenizer

    def tokens_per_image(self, grid_thw: Sequence[int]) -> int:
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // (self.merge * self.merge)

    def pixel_inputs(self, images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
        """pixel_values [patches, C*T*P*P] and image_grid_thw [images, 3] of a prompt's images, in order."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].to(torch.long)}

    def grids(self, images: Sequence[Image.Image]) -> list[list[int]]:
        return self.pixel_inputs(images)["image_grid_thw"].tolist() if images else []

    def expand(self, ids: Sequence[int], grids: Sequence[Sequence[int]], where: str = "prompt") -> list[int]:
        """`ids` with image i's run of pad tokens as long as its merged patches: a run of one pad (a chat
        template's, or SGLang's form of a request) is repeated, a run of exactly that length is kept. One run per
        image; anything else is a ValueError naming `where`."""
        runs = pad_runs(ids, self.image_token_id)
        if len(runs) != len(grids):
            raise ValueError(f"{where}: {len(runs)} image placeholders for {len(grids)} images (runs of {IMAGE_PAD}, "
                             f"token id {self.image_token_id})")
        out: list[int] = []
        last = 0
        for i, ((start, length), grid) in enumerate(zip(runs, grids, strict=True)):
            need = self.tokens_per_image(grid)
            if length not in (1, need):
                raise ValueError(f"{where}: image {i}'s placeholder at index {start} has {length} {IMAGE_PAD} tokens; "
                                 f"its {grid[1]}x{grid[2]} patch grid needs {need} (or 1, to be expanded)")
            out += [*ids[last:start], *[self.image_token_id] * need]
            last = start + length
        out += ids[last:]
        return out

    def encode(self, messages: list[dict], images: Sequence[Image.Image], where: str = "prompt",
               grids: Sequence[Sequence[int]] | None = None) -> VisionPrompt:
        """Chat messages (content a string, or a list of {"type": "image"} / {"type": "text", "text"} parts) and
        the images they place, as token ids and grids (`grids`: the images' already known)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        grids = [list(g) for g in grids] if grids is not None else self.grids(images)
        return VisionPrompt(self.expand(ids, grids, where), grids)

    def grids_of(self, data: Sequence[bytes]) -> list[list[int]]:
        """The patch grids of encoded images, each computed once (the image processor resizes and normalizes the
        whole picture to find it; a prompt taken again in a later epoch, or by its group, costs a lookup)."""
        digests = [image_digest(d) for d in data]
        missing = [(k, d) for k, d in zip(digests, data, strict=True) if k not in self._grids]
        if missing:
            for (k, _), grid in zip(missing, self.grids([open_image(d) for _, d in missing]), strict=True):
                self._grids[k] = grid
        return [self._grids[k] for k in digests]


def encode_row(processor: VisionProcessor, row: dict, images: Sequence[bytes], where: str = "prompt") -> list[int]:
    """A data row's prompt ids with its images placed: its chat messages (a plain prompt as one user message) through
    messages_with_images and the processor; the rollout, SFT and the evaluate flow all encode image rows here."""
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    placed = messages_with_images(messages, len(images), where)
    return processor.encode(placed, [], where, processor.grids_of(images)).prompt_ids


def messages_with_images(messages: list[dict], n_images: int, where: str = "prompt") -> list[dict]:
    """verl's and TRL's messages in the content-parts form chat templates place images with.

    verl writes `<image>` in a message's text where an image goes; TRL rows give content parts already, or none
    (then the images go first in the first user message, as TRL does). More placeholders than images is an error."""
    if any(isinstance(m.get("content"), list) for m in messages):  # TRL's content parts
        out = [m if isinstance(m.get("content"), list) else {**m, "content": [{"type": "text", "text": m["content"]}]}
               for m in messages]
        count = sum(1 for m in out for c in m["content"] if c.get("type") == "image")
        if count > n_images:
            raise ValueError(f"{where}: {count} image placeholders for {n_images} images")
    else:  # verl's <image> markers in the text
        count = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
        if count > n_images:
            raise ValueError(f"{where}: {count} '{IMAGE_PLACEHOLDER}' placeholders for {n_images} images")
        out = [{**m, "content": _parts(m["content"])} for m in messages]
    if count < n_images:  # no placeholders for some images: they go first in the first user message (TRL's way)
        first = next((i for i, m in enumerate(out) if m["role"] == "user"), 0)
        out[first] = {**out[first], "content": [{"type": "image"}] * (n_images - count) + out[first]["content"]}
    return out


def pad_runs(ids: Sequence[int], pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of the image pad token: one run per image."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != pad_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def collapse_image_pads(ids: Sequence[int], pad_id: int) -> list[int]:
    """`ids` with every run of the image pad token cut to one pad: the form SGLang's processor expands (one
    `<|image_pad|>` per image between vision start and end), from rlflow's, which repeats it per merged patch."""
    return [t for i, t in enumerate(ids) if t != pad_id or i == 0 or ids[i - 1] != pad_id]


def _parts(text: str) -> list[dict]:
    """A message's text with verl's `<image>` markers as content parts."""
    content: list[dict] = []
    for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            content.append({"type": "image"})
        if piece:
            content.append({"type": "text", "text": piece})
    return content


def mrope_positions(input_ids: Sequence[int], grids: Sequence[Sequence[int]], image_token_id: int,
                    merge: int) -> tuple[torch.Tensor, int]:
    """M-RoPE position ids [3, len(input_ids)] of one sample, and its delta: the offset its text positions carry
    after the prompt (a decoded token at index i has position i + delta on all three components)."""
    ids = torch.as_tensor(list(input_ids), dtype=torch.long)
    n = ids.numel()
    pos = torch.empty(3, n, dtype=torch.long)
    is_image = (ids == image_token_id).tolist()
    grids_left = iter(grids)
    i, current = 0, 0
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            pos[:, i:j] = torch.arange(current, current + j - i)
            current += j - i
            i = j
            continue
        t, h, w = (int(x) for x in next(grids_left))
        h, w = h // merge, w // merge
        size = t * h * w
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        pos[:, i:i + size] = grid.reshape(3, -1) + current
        current += max(h, w)  # t is 1 for an image
        i += size
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta
