"""model: the policy's starting weights, or the shape of a tiny model built from scratch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlflow.engines.core.config.base import Section


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="Local Hugging Face causal-LM directory. Empty: build a tiny model from the fields "
        "below with the built-in character tokenizer (the CPU demo).",
    )
    arch: Literal["llama", "qwen2", "qwen2_vl"] = Field(
        "llama", description="Architecture of a model built from scratch; qwen2_vl: a tiny Qwen2-VL (vision encoder, "
        "M-RoPE) with the character tokenizer and an image processor (the multimodal demo, docs/multimodal.md).")
    hidden_size: int = Field(96, gt=0)
    intermediate_size: int = Field(256, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(4, gt=0)
    max_seq_len: int = Field(64, gt=0, description="Longest prompt + response, in tokens.")
    extra_chars: str = Field("", description="Characters the built-in character tokenizer holds besides "
                             "'0123456789+=SR' (appended, so the others keep their ids): '*' for the mul task.")
