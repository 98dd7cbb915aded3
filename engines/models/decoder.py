"""Our own forward for Llama / Qwen2 / Qwen3 decoders, reading the weights of a loaded HF model, with a
slot-based KV cache.

Why not HF's forward: continuous batching needs every sequence in its own cache slot, joining and leaving
the batch at any decode step, and a fixed-shape decode step that a GPU captures in CUDA graphs
(`DecodeRunner`). The weights stay the HF model's `nn.Parameter`s, so weight updates (`copy_`,
released/resumed `.data`) are seen here with no extra step (a graph is captured again when they move).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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

    def _attend_cached(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor
                       ) -> torch.Tensor:
        """One new query per sequence, q [B, H, 1, D], against cached keys/values [B, KV, L, D] with
        visible [B, 1, 1, L]. The query heads that share a KV head become that head's query rows, so one
        masked SDPA over [B, KV, H/KV, D] does grouped-query attention without repeating the cache."""
        b = q.shape[0]
        grouped = q.reshape(b, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        with _backends(q.device, flash=False):
            o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible)
        return o.reshape(b, self.num_heads, 1, self.head_dim)

    @torch.no_grad()
    def prefill(self, cache: KVCache, slots: list[list[int]], prompts: list[list[int]]) -> torch.Tensor:
        """Run prompts in one right-padded batch and store prompt i's keys/values in every slot of
        `slots[i]` (requests sharing a prompt); returns the next-token logits [len(prompts), V].

        A plain causal mask suffices: padding sits after every real token, so no real query sees it (the
        padded positions' keys land in the cache past the prompt, where decode masks or overwrites them)."""
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = to_device([p + [0] * (width - len(p)) for p in prompts], torch.long, self.device)
        cos, sin = self._cos_sin(torch.arange(width, device=self.device))
        rows = to_device([i for i, group in enumerate(slots) for _ in group], torch.long, self.device)
        dest = to_device([s for group in slots for s in group], torch.long, self.device)
        last = to_device([n - 1 for n in lengths], torch.long, self.device)
        group = self.num_heads // self.num_kv_heads
        x = self.model.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.model.layers):
            def attend(q, k, v, i=i):
                cache.k[i][dest, :, :width] = k[rows]
                cache.v[i][dest, :, :width] = v[rows]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                with _backends(q.device, flash=True):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            x = self._layer(layer, x, cos, sin, attend)
        return self._logits(x[torch.arange(len(prompts), device=self.device), last])

    @torch.no_grad()
    def decode(self, cache: KVCache, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
               ) -> torch.Tensor:
        """One token for each of any set of sequences: `tokens[b]` sits at `positions[b]` of slot `slots[b]`.
        Returns the next-token logits [B, V]. (The engine uses `decode_rows`, which needs no gather.)"""
        span = int(positions.max()) + 1
        cos, sin = self._cos_sin(positions[:, None])  # [B, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        visible = (torch.arange(span, device=self.device)[None] <= positions[:, None])[:, None, None]  # [B,1,1,L]
        x = self.model.model.embed_tokens(tokens[:, None])
        for i, layer in enumerate(self.model.model.layers):
            def attend(q, k, v, i=i):
                cache.k[i][slots, :, positions] = k[:, :, 0]
                cache.v[i][slots, :, positions] = v[:, :, 0]
                return self._attend_cached(q, cache.k[i][slots, :, :span], cache.v[i][slots, :, :span], visible)

            x = self._layer(layer, x, cos, sin, attend)
        return self._logits(x[:, -1])

    @torch.no_grad()
    def decode_rows(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, span: int,
                    out: torch.Tensor) -> None:
        """One token for slots 0..R-1 (R = len(tokens)), attending over the first `span` cache positions, the
        next-token logits written to out[:R] (model dtype). Slot b's keys are read in place (no gather) and
        nothing here waits for the GPU, so a CUDA graph can capture it for a fixed (R, span). Rows of idle
        slots decode token 0 at position 0 (their cache is rewritten by the next prefill)."""
        rows = tokens.shape[0]
        slots = torch.arange(rows, device=self.device)
        cos, sin = self._cos_sin(positions[:, None])
        cos, sin = cos[:, None], sin[:, None]
        visible = (torch.arange(span, device=self.device)[None] <= positions[:, None])[:, None, None]
        x = self.model.model.embed_tokens(tokens[:, None])
        for i, layer in enumerate(self.model.model.layers):
            def attend(q, k, v, i=i):
                cache.k[i][slots, :, positions] = k[:, :, 0]
                cache.v[i][slots, :, positions] = v[:, :, 0]
                return self._attend_cached(q, cache.k[i][:rows, :, :span], cache.v[i][:rows, :, :span], visible)

            x = self._layer(layer, x, cos, sin, attend)
        h = rms_norm(x[:, -1], self.model.model.norm.weight, self.eps)
        head = self.model.lm_head
        torch.matmul(h, head.weight.t(), out=out[:rows])
        if head.bias is not None:
            out[:rows] += head.bias

    @property
    def vocab_size(self) -> int:
        return self.model.lm_head.weight.shape[0]

    def weight_pointers(self) -> tuple[int, ...]:
        """Where every weight lives: a CUDA graph holds these addresses, so it is stale once one moves."""
        return tuple(p.data_ptr() for p in self.model.parameters())


def _backends(device: torch.device, flash: bool):
    """SDPA kernels to use on CUDA: flash for causal prefill; the memory-efficient kernel for masked decode
    (cuDNN's is not asked for: slower for these shapes). Elsewhere torch picks."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, *backends] if flash else backends)


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of Python data on `device`; to CUDA through pinned memory, so the host does not wait for
    the GPU's queued work (a plain `torch.tensor(..., device='cuda')` synchronizes)."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class DecodeRunner:
    """Runs `DecoderLM.decode_rows` for the busy slots of one cache. On CUDA each (rows, span) bucket is
    captured once as a CUDA graph and replayed: a decode step is ~25 kernels a layer, and launching them
    one by one from Python costs more than the GPU needs to run them. Inputs go through static buffers
    (tokens, positions per slot); logits land in `out` [slots, V]."""

    def __init__(self, lm: DecoderLM, cache: KVCache, out: torch.Tensor, graphs: bool, max_graphs: int = 64):
        self.lm, self.cache, self.out = lm, cache, out
        self.use_graphs, self.max_graphs = graphs, max_graphs
        self.tokens = torch.zeros(cache.slots, dtype=torch.long, device=lm.device)
        self.positions = torch.zeros(cache.slots, dtype=torch.long, device=lm.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.weights = lm.weight_pointers() if graphs else ()

    def bucket(self, rows: int, span: int) -> tuple[int, int]:
        """Graph sizes: rows a power of two up to 64 then multiples of 64; span a multiple of 128."""
        r = 1 << (rows - 1).bit_length() if rows <= 64 else -(-rows // 64) * 64
        return min(r, self.cache.slots), min(-(-span // 128) * 128, self.cache.max_len)

    def run(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, rows: int, span: int) -> None:
        """Decode `tokens[b]` at `positions[b]` of slot `slots[b]` (device tensors; every slot < rows, every
        position < span); the other slots below `rows` decode padding."""
        if self.use_graphs:
            rows, span = self.bucket(rows, span)
            weights = self.lm.weight_pointers()
            if weights != self.weights:  # weights re-allocated (released and resumed): capture again
                self.graphs.clear()
                self.weights = weights
        self.tokens[:rows].zero_()
        self.positions[:rows].zero_()
        self.tokens[slots] = tokens
        self.positions[slots] = positions
        graph = self.graphs.get((rows, span))
        if graph is not None:
            graph.replay()
        elif self.use_graphs and len(self.graphs) < self.max_graphs:
            self._capture(rows, span)
        else:
            self.lm.decode_rows(self.cache, self.tokens[:rows], self.positions[:rows], span, self.out)

    def _capture(self, rows: int, span: int) -> None:
        """Run the step eagerly on a side stream (warm-up; its results are this step's), then capture it."""
        args = (self.cache, self.tokens[:rows], self.positions[:rows], span, self.out)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # idempotent: same tokens, same cache writes, same logits
                self.lm.decode_rows(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.lm.decode_rows(*args)
        except Exception:
            logging.getLogger(__name__).exception("CUDA graph capture failed; decoding without graphs")
            self.use_graphs = False
            self.graphs.clear()
            return
        self.pool = self.pool or graph.pool()
        self.graphs[(rows, span)] = graph
