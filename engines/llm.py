"""Our own forward for Llama / Qwen2 / Qwen3 decoders, reading the weights of a loaded HF model, with a
slot-based KV cache.

Why not HF's forward: continuous batching needs every sequence in its own cache slot, joining and leaving
the batch at any decode step, and a fixed-shape structure a GPU can later capture in CUDA graphs. The
weights stay the HF model's `nn.Parameter`s, so weight updates (`copy_`, released/resumed `.data`) are
seen here with no extra step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "qwen3")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Qwen compute it: in fp32, cast back, then scaled."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (the half-split convention of HF's Llama/Qwen)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Keys and values per layer, [slots, kv_heads, max_len, head_dim]: one slot per running sequence."""

    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots, self.max_len = slots, max_len


class DecoderLM:
    """Prefill prompts into cache slots; decode one token for many slots at once."""

    def __init__(self, hf_model: torch.nn.Module):
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"model config model_type {cfg.model_type!r}: the embedded engine runs {SUPPORTED}")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"model config hidden_act {cfg.hidden_act!r}: expected 'silu' (SwiGLU)")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("model config use_sliding_window: sliding-window attention is not supported")
        self.model, self.cfg = hf_model, cfg
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_positions = cfg.max_position_embeddings
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        return KVCache(len(self.model.model.layers), slots, self.num_kv_heads, max_len, self.head_dim, self.dtype,
                       self.device)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions` from a table HF's own rotary module computes once (so every rope
        scaling variant it supports is honoured)."""
        if self._rope is None:
            pos = torch.arange(self.max_positions, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.model.model.rotary_emb(probe, pos)
            self._rope = (cos[0], sin[0])
        cos, sin = self._rope
        return cos[positions], sin[positions]

    def _layer(self, layer, x: torch.Tensor, cos, sin, attend) -> torch.Tensor:
        """One decoder layer on x [B, T, hidden]; `attend(i, q, k, v)` stores k/v and returns attention."""
        attn, mlp = layer.self_attn, layer.mlp
        bsz, t, _ = x.shape
        h = rms_norm(x, layer.input_layernorm.weight, self.eps)
        q = attn.q_proj(h).view(bsz, t, self.num_heads, self.head_dim)
        k = attn.k_proj(h).view(bsz, t, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(h).view(bsz, t, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm on q and k before rotary
            q = rms_norm(q, attn.q_norm.weight, self.eps)
            k = rms_norm(k, attn.k_norm.weight, self.eps)
        q = rotate(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = rotate(k.transpose(1, 2), cos, sin)
        o = attend(q, k, v.transpose(1, 2))
        x = x + attn.o_proj(o.transpose(1, 2).reshape(bsz, t, self.num_heads * self.head_dim))
        h = rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
        return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(rms_norm(x, self.model.model.norm.weight, self.eps)).float()

    @torch.no_grad()
    def prefill(self, cache: KVCache, slots: list[list[int]], prompts: list[list[int]]) -> torch.Tensor:
        """Run prompts in one right-padded batch and store prompt i's keys/values in every slot of
        `slots[i]` (requests sharing a prompt); returns the next-token logits [len(prompts), V]."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, device=self.device)
        cos, sin = self._cos_sin(torch.arange(width, device=self.device))
        span = torch.arange(width, device=self.device)
        # causal, and never a padded key: [N, 1, T, T]
        visible = ((span[None, :] <= span[:, None])[None] & (span[None, None, :] < lengths[:, None, None]))[:, None]
        rows = torch.tensor([i for i, group in enumerate(slots) for _ in group], device=self.device)
        dest = torch.tensor([s for group in slots for s in group], device=self.device)
        x = self.model.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.model.layers):
            def attend(q, k, v, i=i):
                # keys past a prompt's end are padding; decode masks them until it overwrites them
                cache.k[i][dest, :, :width] = k[rows]
                cache.v[i][dest, :, :width] = v[rows]
                return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)

            x = self._layer(layer, x, cos, sin, attend)
        return self._logits(x[torch.arange(len(prompts), device=self.device), lengths - 1])

    @torch.no_grad()
    def decode(self, cache: KVCache, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
               ) -> torch.Tensor:
        """One token for each running sequence: `tokens[b]` sits at `positions[b]` of slot `slots[b]`.
        Returns the next-token logits [B, V]."""
        span = int(positions.max()) + 1
        cos, sin = self._cos_sin(positions[:, None])  # [B, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        visible = (torch.arange(span, device=self.device)[None] <= positions[:, None])[:, None, None]  # [B,1,1,L]
        x = self.model.model.embed_tokens(tokens[:, None])
        for i, layer in enumerate(self.model.model.layers):
            def attend(q, k, v, i=i):
                cache.k[i][slots, :, positions] = k[:, :, 0]
                cache.v[i][slots, :, positions] = v[:, :, 0]
                keys, values = cache.k[i][slots, :, :span], cache.v[i][slots, :, :span]
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)

            x = self._layer(layer, x, cos, sin, attend)
        return self._logits(x[:, -1])
