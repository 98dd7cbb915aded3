"""Sampling parameters and token sampling, with SGLang's field names so the HTTP layer maps 1:1."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 or 0 disables top-k (SGLang uses -1).")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits of the distribution the sample is drawn from; greedy (T=0) reports the T=1 distribution."""
    logits = logits.float()
    return logits / temperature if temperature > 0 else logits


def sample_tokens(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row from temperature-scaled, top-k/top-p/min-p filtered logits [B, V]."""
    if p.temperature == 0:
        return logits.argmax(dim=-1)
    logits = scaled_logits(logits, p.temperature)
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, idx = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_probs)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
