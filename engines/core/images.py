"""Images across the layers: how every layer names one, by the sha256 of its encoded bytes (the run store's key, a
rollout batch's `images` entries, a train batch's IMAGE_IDS, the engine's embedding cache), and which models take
them. A module of its own so the run store and the config can use both without importing torch or transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # the vision-language models rlflow runs (config.json model_type)
IMAGE_PLACEHOLDER = "<image>"  # verl's marker in a prompt's text where an image goes


def image_digest(data: bytes) -> str:
    """An image's key: the sha256 hex digest of its encoded bytes (PNG, JPEG, ... as given)."""
    return hashlib.sha256(data).hexdigest()


def model_type_of(path: str | Path) -> str | None:
    """model_type of an HF directory's config.json (None when it has none)."""
    config = Path(path) / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None
