"""Sampling parameters and token sampling, with SGLang's field names so the HTTP layer maps 1:1.

Every row of a batch carries its own parameters (a continuous batch mixes requests) and its own uniform
random number (drawn from the request's generator), so what a request samples never depends on what
else shares its batch.
"""

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
    n: int = Field(1, ge=1, description="Samples per prompt (each its own request).")


def scaled_logits(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Logits of the distribution the sample is drawn from; greedy (T=0) reports the T=1 distribution.
    `temperature` is one number or one per row of logits [B, V]."""
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        return logits / torch.where(temperature > 0, temperature, 1.0)[:, None].to(logits)
    return logits / temperature if temperature > 0 else logits


def row_params(params: list[SamplingParams], device) -> dict[str, torch.Tensor]:
    """Per-row parameter tensors for `sample_rows`."""
    return {
        "temperature": torch.tensor([p.temperature for p in params], device=device),
        "top_p": torch.tensor([p.top_p for p in params], device=device),
        "top_k": torch.tensor([p.top_k for p in params], device=device),
        "min_p": torch.tensor([p.min_p for p in params], device=device),
    }


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [B, V]: temperature, then top-k, top-p (on the top-k renormalised
    probabilities) and min-p; greedy rows (T=0) take the argmax. Every filter keeps a prefix of the tokens
    sorted by probability, so one sort serves all and the draw is an inverse-CDF lookup of `uniforms` [B]."""
    vocab = logits.shape[-1]
    z, order = scaled_logits(logits, temperature).sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None]
    probs = torch.softmax(z.masked_fill(rank >= k, float("-inf")), dim=-1)
    keep = (probs.cumsum(-1) - probs <= top_p[:, None]) & (rank < k)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    kept = probs.masked_fill(~keep, 0.0).double()
    cdf = kept.cumsum(-1)
    pick = (cdf <= uniforms.double()[:, None] * cdf[:, -1:]).sum(-1)
    pick = torch.minimum(pick, keep.sum(-1) - 1)  # a rounding at the top end stays inside the kept prefix
    pick = torch.where(temperature > 0, pick, 0)  # greedy: the most likely token
    return order.gather(-1, pick[:, None]).squeeze(-1)
