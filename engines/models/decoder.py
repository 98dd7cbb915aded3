"""Our own forward for Llama / Qwen2 / Qwen3 decoders (and their MoE variants, Mixtral and Qwen3-MoE), reading
the weights of a loaded HF model, with a paged KV cache (engines/models/kv_pages.py).

Why not HF's forward: continuous batching needs every sequence in its own pages, joining and leaving
the batch at any decode step, and a fixed-shape decode step that a GPU captures in CUDA graphs
(`DecodeRunner`). The weights stay the HF model's `nn.Parameter`s, so weight updates (`copy_`,
released/resumed `.data`) are seen here with no extra step (a graph is captured again when they move).
Where the weights lie in one flat buffer in `fusable_order` (the rollout worker's on GPU), q/k/v and gate/up
run as one GEMM each over views of that memory: at decode batch sizes the projections are small GEMMs whose
launch and tail costs add up, and a fused view costs nothing to keep current.
An MoE layer routes through engines/models/routing.py's `select_experts` and computes its experts with the grouped
matmuls of engines/models/grouped_experts.py (the trainer's functions): with bf16 weights on CUDA nothing waits for
the host, so a MoE decode step is captured as a CUDA graph like a dense one (`graph_safe`). With `record_routing`
each token's experts are written, on the device, to a [rows, positions, layers, k] store (routing replay, R3).
With `quantize_fp8` the dense projections run from e4m3 weights through engines/models/fp8.py (rollout.precision
fp8); the bf16 copies are freed.
Qwen2-VL / Qwen2.5-VL: the language model (`model.language_model`) runs here with multimodal rotary positions
(M-RoPE): a prompt's prefill takes 3-D positions and the image embeddings that replace its image pad tokens
(`SequenceImages`); a generated token's position is its index + the sequence's delta on all three components,
which is plain RoPE at that position, so a decode step only adds a per-row offset.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlflow.engines.core.images import VL_MODEL_TYPES
from rlflow.engines.models import invariant
from rlflow.engines.models.flat_weights import fused_linear
from rlflow.engines.models.fp8 import Fp8Projections
from rlflow.engines.models.grouped_experts import experts_forward, kernel_applies
from rlflow.engines.models.kv_pages import PagedKVCache
from rlflow.engines.models.paged_attention import (
    decode_attention,
    gather_pages,
    sdpa_backends,
    store_kv,
    uses_fast_kernel,
)
from rlflow.engines.models.routing import (
    ROUTING_DTYPE,
    moe_routers,
    router_normalizes,
    routing_shape,
    select_experts,
)
from rlflow.engines.models.transfer import to_device

__all__ = ["DecodeRunner", "DecoderLM", "PagedKVCache", "SequenceImages", "to_device"]

SUPPORTED = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", *VL_MODEL_TYPES)  # VL: the language model


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Qwen compute it: in fp32, cast back, then scaled."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _is_moe_block(mlp: torch.nn.Module) -> bool:
    """An HF MoE block (router + experts) rather than a dense SwiGLU MLP."""
    return hasattr(mlp, "experts")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (the half-split convention of HF's Llama/Qwen)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class SequenceImages:
    """What a prefill of a sequence with images needs: its prompt's M-RoPE positions [3, P] (CPU, long), the delta
    every later token's position carries, and the image embeddings [n, hidden] (on the model's device) that
    replace the prompt's image pad tokens at `pad_index` [n] (ascending prompt indices, CPU)."""

    positions: torch.Tensor
    delta: int
    pad_index: torch.Tensor
    embeds: torch.Tensor

    def positions_of(self, start: int, stop: int) -> torch.Tensor:
        """[3, stop - start] positions of sequence indices start..stop-1: the prompt's, then index + delta."""
        prompt = self.positions.shape[1]
        head = self.positions[:, start:min(stop, prompt)]
        tail = torch.arange(max(start, prompt), max(stop, prompt)) + self.delta
        return torch.cat([head, tail.expand(3, -1)], dim=1) if len(tail) else head

    def pads_in(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices relative to `start`, embedding rows) of the image pad tokens among indices start..stop-1."""
        lo, hi = torch.searchsorted(self.pad_index, torch.tensor([start, stop])).tolist()
        return self.pad_index[lo:hi] - start, self.embeds[lo:hi]


def mrope_section_of(cfg) -> list[int] | None:
    """The M-RoPE split of a text config's rotary frequencies (temporal, height, width), or None for plain RoPE.
    transformers 5 keeps it in rope_parameters, earlier versions in rope_scaling."""
    for attr in ("rope_parameters", "rope_scaling"):
        section = (getattr(cfg, attr, None) or {}).get("mrope_section")
        if section:
            return [int(x) for x in section]
    return None


class DecoderLM:
    """Prefill prompts into cache slots; decode one token for many slots at once."""

    def __init__(self, hf_model: torch.nn.Module):
        top = hf_model.config
        if top.model_type not in SUPPORTED:
            raise ValueError(f"model config model_type {top.model_type!r}: the embedded engine runs {SUPPORTED}")
        self.vision_language = top.model_type in VL_MODEL_TYPES
        # a VL model's language model: its own config (text_config) and module (model.language_model)
        cfg = top.text_config if self.vision_language else top
        self.body = hf_model.model.language_model if self.vision_language else hf_model.model
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"model config hidden_act {cfg.hidden_act!r}: expected 'silu' (SwiGLU)")
        if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mixtral" and cfg.sliding_window):
            raise ValueError("model config use_sliding_window / sliding_window: sliding-window attention is not "
                             "supported")
        self.model, self.cfg, self.model_type = hf_model, cfg, top.model_type
        self.mrope_section = mrope_section_of(cfg) if self.vision_language else None
        if self.vision_language and self.mrope_section is None:
            raise ValueError(f"model config text_config.rope_parameters: {top.model_type} needs an mrope_section")
        # M-RoPE: which position component (0 time, 1 height, 2 width) each rotary dim takes: mrope_section over the
        # first half of the dims, repeated over the second, as transformers' Qwen2-VL recomposes them
        self._mrope_component = None if self.mrope_section is None else torch.repeat_interleave(
            torch.arange(len(self.mrope_section)) % 3, torch.tensor(self.mrope_section)).repeat(2)
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_positions = cfg.max_position_embeddings
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        # chosen once, so a compiled decode step sees one op and no lookup
        self.decode_attention = decode_attention(self.device, self.head_dim)
        # the Parameter objects stay (updates copy into them or swap their .data); listed once, not walked per step
        self._params = list(hf_model.parameters())
        # per layer: (weight, bias) of q/k/v and of gate/up as one GEMM, or None (run one by one); found again
        # whenever the weights move (`fuse_projections`)
        layers = len(self.body.layers)
        self._qkv: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * layers
        self._gate_up: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * layers
        self._fused_at: tuple[int, ...] | None = None
        self.fp8: Fp8Projections | None = None  # rollout.precision fp8: the quantized projections
        self.exact = False  # rollout.true_on_policy: every op through engines/models/invariant.py (`true_on_policy`)
        self._act, self._norm = F.silu, rms_norm
        self.use_fused(True)
        # routing replay: per MoE layer, its index in a record; the store the engine reads records from (or None)
        self._moe_index = {id(r): n for n, r in enumerate(moe_routers(hf_model))}
        self.routing: torch.Tensor | None = None

    def true_on_policy(self) -> None:
        """rollout.true_on_policy: from now on every op is engines/models/invariant.py's, as in the trainer's forward
        in that mode (projections one by one: a fused q/k/v GEMM gives other bits than q alone; attention one query
        against its own prefix), so a token's logits do not depend on its batch-mates, its row or its position."""
        if self.fp8 is not None:
            raise ValueError("rollout.true_on_policy with rollout.precision fp8: the trainer computes in bf16/fp32")
        if self.vision_language:
            raise ValueError(f"rollout.true_on_policy: not supported for vision-language models ({self.model_type})")
        invariant.make_invariant(self.model)
        self.exact, self._act, self._norm = True, invariant.silu, invariant.rms_norm
        self.use_fused(False)

    def quantize_fp8(self) -> Fp8Projections:
        """Hold every dense projection (q/k/v, o, gate/up, down) in e4m3 from now on, quantized from the current
        weights, whose bf16 tensors are freed; weight updates then write into `self.fp8` (`Fp8Projections.write`)."""
        if self.vision_language:
            raise ValueError(f"rollout.precision fp8: not supported for vision-language models ({self.model_type})")
        self.fp8 = Fp8Projections(self.model)
        self.unfuse()
        return self.fp8

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """(MoE layers, experts per token), None for a dense model."""
        return routing_shape(self.model)

    def record_routing(self, rows: int, max_len: int) -> None:
        """Record every token's experts from now on into `self.routing` [rows, max_len + 1, layers, k] (int16, -1
        where nothing was recorded; the last column is where idle decode rows write)."""
        layers, k = self.routing_shape or (0, 0)
        if not layers:
            raise ValueError("routing replay: the model has no MoE layers to record")
        self.routing = torch.full((rows, max_len + 1, layers, k), -1, dtype=ROUTING_DTYPE, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    def page_bytes(self, page_size: int) -> int:
        """Bytes one KV page takes over all layers."""
        return PagedKVCache.page_bytes(len(self.body.layers), self.num_kv_heads, page_size, self.head_dim,
                                       self.dtype)

    def new_cache(self, rows: int, max_len: int, num_pages: int, page_size: int) -> PagedKVCache:
        """A paged cache of `num_pages` pages for up to `rows` decoding sequences of at most `max_len` tokens."""
        return PagedKVCache(len(self.body.layers), rows, max_len, num_pages, page_size, self.num_kv_heads,
                            self.head_dim, self.dtype, self.device)

    def _rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max positions, head_dim], computed once by HF's own rotary module (so every rope scaling
        variant it supports is honoured; M-RoPE's with 3 equal components, which is plain RoPE)."""
        if self._rope is None:
            pos = torch.arange(self.max_positions, device=self.device)[None]
            if self.vision_language:  # M-RoPE's module takes [3, batch, T] (5.17's refuses [batch, T])
                pos = pos[None].expand(3, -1, -1)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.body.rotary_emb(probe, pos)
            self._rope = (cos.reshape(-1, *cos.shape[-2:])[0], sin.reshape(-1, *sin.shape[-2:])[0])
        return self._rope

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`."""
        cos, sin = self._rope_table()
        return cos[positions], sin[positions]

    def _mrope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [..., T, head_dim] of M-RoPE positions [..., 3, T]: rotary dim d takes the position component
        its section names (`_mrope_component`), read from the same table as plain positions."""
        component = self._mrope_component.to(positions.device)
        per_dim = positions.index_select(-2, component).transpose(-1, -2)  # [..., T, head_dim]
        dims = torch.arange(per_dim.shape[-1], device=positions.device)
        cos, sin = self._rope_table()
        return cos[per_dim, dims], sin[per_dim, dims]

    def use_fused(self, enabled: bool) -> None:
        """Run q/k/v and gate/up as one GEMM each where the weights' layout allows it (the default), or every
        projection alone (what a benchmark compares against)."""
        self._fuse, self._fused_at = enabled, None
        self.fuse_projections()

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step can be captured as a CUDA graph: every MoE layer's experts must run on torch's
        grouped kernel (bf16 on CUDA, aligned rows), whose per-expert offsets stay on the device; the reference
        loop over the experts, and true on-policy's (invariant.experts), read them on the host."""
        if self.exact and any(_is_moe_block(layer.mlp) for layer in self.body.layers):
            return False
        probe = torch.empty(0, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        return all(kernel_applies(probe, e.gate_up_proj.transpose(1, 2)) and kernel_applies(
            probe, e.down_proj.transpose(1, 2)) for e in (layer.mlp.experts for layer in self.body.layers
                                                           if _is_moe_block(layer.mlp)))

    @property
    def fused_groups(self) -> int:
        """How many projection groups (q/k/v, gate/up: two a layer) run as one GEMM now."""
        return sum(f is not None for f in self._qkv + self._gate_up)

    def unfuse(self) -> None:
        """Let go of the fused views (the weights were released: the views would keep their memory); the next
        step fuses again where the weights are then."""
        n = len(self.body.layers)
        self._qkv, self._gate_up, self._fused_at = [None] * n, [None] * n, None

    def fuse_projections(self) -> tuple[int, ...]:
        """Point the fused q/k/v and gate/up GEMMs at the weights' current memory (the first time, or after a
        re-allocation; otherwise nothing to do) and return where the weights are (`weight_pointers`)."""
        at = self.weight_pointers()
        if at == self._fused_at:
            return at
        self._fused_at = at
        fuse = self._fuse and self.fp8 is None  # fp8: the quantized stores are fused already
        for i, layer in enumerate(self.body.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self._qkv[i] = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj]) if fuse else None
            dense = not _is_moe_block(mlp)
            self._gate_up[i] = fused_linear([mlp.gate_proj, mlp.up_proj]) if fuse and dense else None
        return at

    def _moe(self, mlp: torch.nn.Module, h: torch.Tensor, route) -> torch.Tensor:
        """An MoE block on h [B, T, hidden]: the router's top-k (select_experts), the grouped experts; `route(n,
        ids [B*T, k])` receives the choice of MoE layer n."""
        flat = h.reshape(-1, h.shape[-1])
        router, experts = mlp.gate, mlp.experts
        logits = invariant.linear(flat, router.weight) if self.exact else F.linear(flat, router.weight)
        weights, ids = select_experts(logits, router.top_k, router_normalizes(router), exact=self.exact)
        if route is not None:
            route(self._moe_index[id(router)], ids)
        if self.exact:  # rollout.true_on_policy: the trainer's experts (invariant.make_invariant)
            out = invariant.experts(flat, ids, weights.to(logits.dtype), experts.gate_up_proj, experts.down_proj)
        else:
            out = experts_forward(flat, ids, weights.to(logits.dtype), experts.gate_up_proj, experts.down_proj,
                                  experts.act_fn)
        return out.view(h.shape)

    def _layer(self, i: int, x: torch.Tensor, cos, sin, attend, route=None) -> torch.Tensor:
        """Decoder layer i on x [B, T, hidden]; `attend(q, k, v)` stores k/v and returns attention; `route` sees
        an MoE layer's expert choice (`_moe`)."""
        layer = self.body.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        fp8 = self.fp8.layers[i] if self.fp8 is not None else {}
        bsz, t, _ = x.shape
        h = self._norm(x, layer.input_layernorm.weight, self.eps)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if "qkv" in fp8:
            q, k, v = fp8["qkv"](h).split([q_size, kv_size, kv_size], dim=-1)
        elif (qkv := self._qkv[i]) is not None:
            q, k, v = F.linear(h, *qkv).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q = q.view(bsz, t, self.num_heads, self.head_dim)
        k = k.view(bsz, t, self.num_kv_heads, self.head_dim)
        v = v.view(bsz, t, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm on q and k before rotary
            q = self._norm(q, attn.q_norm.weight, self.eps)
            k = self._norm(k, attn.k_norm.weight, self.eps)
        q = rotate(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = rotate(k.transpose(1, 2), cos, sin)
        o = attend(q, k, v.transpose(1, 2))
        x = x + fp8.get("o", attn.o_proj)(o.transpose(1, 2).reshape(bsz, t, self.num_heads * self.head_dim))
        h = self._norm(x, layer.post_attention_layernorm.weight, self.eps)
        if _is_moe_block(mlp):
            return x + self._moe(mlp, h, route)
        if "gate_up" in fp8:
            gate, up = fp8["gate_up"](h).chunk(2, dim=-1)
        elif (gate_up := self._gate_up[i]) is not None:
            gate, up = F.linear(h, *gate_up).chunk(2, dim=-1)
        else:
            gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        return x + fp8.get("down", mlp.down_proj)(self._act(gate) * up)


    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._norm(x, self.body.norm.weight, self.eps)).float()

    @torch.no_grad()
    def prefill(self, cache: PagedKVCache, pieces: list[list[int]], starts: list[int], pages: list[list[int]],
                owners: list[list[int]] | None = None, images: list[SequenceImages | None] | None = None
                ) -> torch.Tensor:
        """Run `pieces[i]`, the tokens at positions starts[i].. of sequence i, store their keys/values in its
        `pages[i]` (which cover them), and return the next-token logits after each piece [len(pieces), V].
        While routing is recorded, piece i's experts go to the store's rows `owners[i]` (the rows of the requests
        that share the piece), at its positions.

        Pieces that start a sequence run as one right-padded batch with a plain causal mask (padding sits
        after every real token, so no real query sees it, and only real tokens are stored). A piece that
        continues a sequence (chunked prefill, or a preempted request's recompute in parts) attends to the
        sequence's cached pages plus itself, causally; it runs alone.
        `images[i]` (vision-language models): sequence i's M-RoPE positions and image embeddings, or None."""
        self.fuse_projections()
        owners = owners or [[] for _ in pieces]
        images = images or [None] * len(pieces)
        if any(starts):
            return torch.cat([self._prefill_continued(cache, t, s, p, o, im) for t, s, p, o, im in
                              zip(pieces, starts, pages, owners, images, strict=True)])
        lengths = [len(p) for p in pieces]
        width = max(lengths)
        ids = to_device([p + [0] * (width - len(p)) for p in pieces], torch.long, self.device)
        if any(im is not None for im in images):
            cos, sin = self._mrope_cos_sin(self._batch_positions(lengths, images, width))
            cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]: per row, broadcast over heads
        else:
            cos, sin = self._cos_sin(torch.arange(width, device=self.device))
        rows, cols, dest_pages, dest_offsets = [], [], [], []
        for i, (n, held) in enumerate(zip(lengths, pages, strict=True)):
            pg, off = cache.slots(held, 0, n)
            rows += [i] * n
            cols += range(n)
            dest_pages += pg
            dest_offsets += off
        index = to_device([rows, cols, dest_pages, dest_offsets, [n - 1 for n in lengths] + [0] * (len(rows) - len(
            lengths))], torch.long, self.device)
        group = self.num_heads // self.num_kv_heads
        route = self._route_prefill(lengths, [0] * len(pieces), owners, width)
        scale = self.head_dim**-0.5
        x = self._embed(ids, [(b, im.pads_in(0, n)) for b, (n, im) in enumerate(zip(lengths, images, strict=True))
                              if im is not None])
        for i in range(len(self.body.layers)):
            def attend(q, k, v, i=i):
                cache.write(i, index[2], index[3], k[index[0], :, index[1]], v[index[0], :, index[1]])
                if self.exact:  # each query against its own prefix (padding queries: their own, never read)
                    return invariant.attention(q, k, v, None, scale)
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                with sdpa_backends(q.device, flash=True):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            x = self._layer(i, x, cos, sin, attend, route)
        return self._logits(x[torch.arange(len(pieces), device=self.device), index[4, :len(pieces)]])

    def _batch_positions(self, lengths: list[int], images: list[SequenceImages | None], width: int) -> torch.Tensor:
        """M-RoPE positions [B, 3, width] of a right-padded batch of sequence starts (text rows: their index on
        all three components; padding: position 0)."""
        pos = torch.zeros(len(lengths), 3, width, dtype=torch.long)
        for b, (n, im) in enumerate(zip(lengths, images, strict=True)):
            pos[b, :, :n] = torch.arange(n) if im is None else im.positions_of(0, n)
        return pos.to(self.device)

    def _embed(self, ids: torch.Tensor, pads: list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
        """Token embeddings of ids [B, T], with row b's image pad tokens replaced by its image embeddings
        (`pads`: (b, (columns, rows)) per row with images)."""
        x = self.body.embed_tokens(ids)
        pads = [(b, cols, rows) for b, (cols, rows) in pads if len(cols)]
        if pads:
            b_index = torch.cat([torch.full_like(cols, b) for b, cols, _ in pads]).to(self.device)
            c_index = torch.cat([cols for _, cols, _ in pads]).to(self.device)
            x[b_index, c_index] = torch.cat([rows for *_, rows in pads]).to(x.dtype)
        return x

    def _route_prefill(self, lengths: list[int], starts: list[int], rows: list[list[int]], width: int):
        """The `route` of a prefill of pieces right-padded to `width`: piece b's first lengths[b] tokens' experts
        go to each of its rows of the store, at positions starts[b]... None when nothing is recorded."""
        if self.routing is None or not any(rows):
            return None
        src, dst_row, dst_col = [], [], []
        for b, (n, start, members) in enumerate(zip(lengths, starts, rows, strict=True)):
            for r in members:
                src += range(b * width, b * width + n)
                dst_row += [r] * n
                dst_col += range(start, start + n)
        index = to_device([src, dst_row, dst_col], torch.long, self.device)

        def route(n: int, ids: torch.Tensor) -> None:
            self.routing[index[1], index[2], n] = ids[index[0]].to(ROUTING_DTYPE)

        return route

    def _prefill_continued(self, cache: PagedKVCache, tokens: list[int], start: int, pages: list[int],
                           rows: list[int], images: SequenceImages | None = None) -> torch.Tensor:
        """One piece at positions start.. of a sequence whose first `start` tokens are cached: store its keys
        and values, then attend over the sequence's pages with an offset causal mask. Returns logits [1, V]."""
        n, stop = len(tokens), start + len(tokens)
        positions = torch.arange(start, stop, device=self.device)
        pg, off = cache.slots(pages, start, stop)
        where = to_device([pg, off], torch.long, self.device)
        table = to_device([pages[: cache.pages_for(stop)]], torch.int32, self.device)
        visible = torch.arange(stop, device=self.device)[None] <= positions[:, None]  # [n, stop]
        if images is None:
            cos, sin = self._cos_sin(positions)
        else:
            cos, sin = self._mrope_cos_sin(images.positions_of(start, stop).to(self.device))
        group = self.num_heads // self.num_kv_heads
        route = self._route_prefill([n], [start], [rows], n)
        ids = to_device([tokens], torch.long, self.device)
        x = self._embed(ids, [] if images is None else [(0, images.pads_in(start, stop))])
        for i in range(len(self.body.layers)):
            def attend(q, k, v, i=i):
                cache.write(i, where[0], where[1], k[0].transpose(0, 1), v[0].transpose(0, 1))
                if self.exact:
                    return invariant.attention(q, gather_pages(cache.k[i], table), gather_pages(cache.v[i], table),
                                               positions[None] + 1, self.head_dim**-0.5)
                keys = gather_pages(cache.k[i], table)[:, :, :stop].repeat_interleave(group, dim=1)
                values = gather_pages(cache.v[i], table)[:, :, :stop].repeat_interleave(group, dim=1)
                with sdpa_backends(q.device, flash=False):
                    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)

            x = self._layer(i, x, cos, sin, attend, route)
        return self._logits(x[:, n - 1])

    @torch.no_grad()
    def decode_rows(self, cache: PagedKVCache, tokens: torch.Tensor, positions: torch.Tensor, pages: int,
                    out: torch.Tensor, offsets: torch.Tensor | None = None) -> None:
        """One token for rows 0..R-1 (R = len(tokens)) of the page table: row b's token at positions[b], its
        key/value stored in the row's pages, attention over the row's first positions[b] + 1 tokens (within
        its first `pages` pages); the next-token logits go to out[:R] (model dtype). Nothing here waits for
        the device (under rollout.true_on_policy too, a MoE model's experts excepted), so a CUDA graph can capture it
        for a fixed (R, pages). Idle rows decode token 0 at position 0 of the scratch page. `offsets[b]` (M-RoPE
        models): row b's rotary position is positions[b] + offsets[b] (its sequence's delta; its cache position
        stays positions[b])."""
        rows = tokens.shape[0]
        table = cache.page_table[:rows, :pages]
        lengths = (positions + 1).to(torch.int32)
        scale = self.head_dim**-0.5
        attention = self.decode_attention
        cos, sin = self._cos_sin((positions if offsets is None else positions + offsets)[:, None])
        cos, sin = cos[:, None], sin[:, None]
        route = None
        if self.routing is not None:  # idle rows (position 0: a real decode is never at 0) write the spare column
            row_index = torch.arange(rows, device=positions.device)
            column = torch.where(positions > 0, positions, self.routing.shape[1] - 1)

            def route(n: int, ids: torch.Tensor) -> None:
                self.routing[row_index, column, n] = ids.to(ROUTING_DTYPE)

        x = self.body.embed_tokens(tokens[:, None])
        for i in range(len(self.body.layers)):
            def attend(q, k, v, i=i):
                store_kv(cache.k[i], cache.v[i], table, positions, k[:, :, 0], v[:, :, 0])
                if self.exact:  # each row against exactly its own prefix
                    return invariant.attention(q, gather_pages(cache.k[i], table), gather_pages(cache.v[i], table),
                                               lengths[:, None].long(), scale)
                return attention(q[:, :, 0], cache.k[i], cache.v[i], table, lengths, scale)[:, :, None]

            x = self._layer(i, x, cos, sin, attend, route)
        h = self._norm(x[:, -1], self.body.norm.weight, self.eps)
        head = self.model.lm_head
        if self.exact:
            out[:rows] = invariant.linear(h, head.weight, head.bias)
            return
        torch.matmul(h, head.weight.t(), out=out[:rows])
        if head.bias is not None:
            out[:rows] += head.bias

    @property
    def vocab_size(self) -> int:
        return self.model.lm_head.weight.shape[0]

    def weight_pointers(self) -> tuple[int, ...]:
        """Where every weight lives: a CUDA graph holds these addresses, so it is stale once one moves."""
        held = tuple(p.data_ptr() for p in self._params)
        return held if self.fp8 is None else held + self.fp8.pointers()


class DecodeRunner:
    """Runs `DecoderLM.decode_rows` for the busy rows of one paged cache. On CUDA each shape bucket is
    captured once as a CUDA graph and replayed: a decode step is ~25 kernels a layer, and launching them
    one by one from Python costs more than the GPU needs to run them. With the Triton kernel a bucket is a
    row count (the kernel loops to each row's own length); with the torch path, rows and a page span.
    Inputs go through static buffers (tokens, positions per row, the cache's page table); logits land in
    `out` [rows, V]."""

    def __init__(self, lm: DecoderLM, cache: PagedKVCache, out: torch.Tensor, graphs: bool, max_graphs: int = 64,
                 compile: bool = False):
        """`compile`: the captured step is `decode_rows` compiled by torch.compile (norms, rotary, SwiGLU and
        residual adds fused; the paged attention stays one custom op), compiled once per shape class."""
        self.lm, self.cache, self.out = lm, cache, out
        self.step = torch.compile(lm.decode_rows) if compile else lm.decode_rows
        self.use_graphs, self.max_graphs = graphs, max_graphs
        # the Triton kernel reads each row's own length; true on-policy's attention folds every key block it is given
        self.full_span = uses_fast_kernel(lm.device, lm.head_dim) and not lm.exact
        self.tokens = torch.zeros(cache.rows, dtype=torch.long, device=lm.device)
        self.positions = torch.zeros(cache.rows, dtype=torch.long, device=lm.device)
        # M-RoPE models: each row's rotary offset (its sequence's delta); None keeps a text model's step as it was
        self.offsets = torch.zeros(cache.rows, dtype=torch.long, device=lm.device) if lm.mrope_section else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.weights = lm.weight_pointers() if graphs else ()

    def bucket(self, rows: int, span: int) -> tuple[int, int]:
        """Graph sizes: rows a power of two up to 64 then multiples of 64; pages covering the span rounded up
        to 128 tokens (all of the table with the Triton kernel)."""
        r = 1 << (rows - 1).bit_length() if rows <= 64 else -(-rows // 64) * 64
        pages = self.cache.max_pages if self.full_span else self.cache.pages_for(-(-span // 128) * 128)
        return min(r, self.cache.rows), min(pages, self.cache.max_pages)

    def run(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, rows: int, span: int,
            offsets: torch.Tensor | None = None) -> None:
        """Decode `tokens[b]` at `positions[b]` of row `slots[b]` (device tensors; every row < rows, every
        position < span); the other rows below `rows` decode padding. `offsets[b]`: the row's rotary offset
        (M-RoPE models; None: 0)."""
        self.cache.flush()
        weights = self.lm.fuse_projections()  # the fused GEMMs follow weights that moved
        if self.use_graphs:
            rows, pages = self.bucket(rows, span)
            if weights != self.weights:  # weights re-allocated (released and resumed): capture again
                self.graphs.clear()
                self.weights = weights
        else:
            pages = self.cache.max_pages if self.full_span else self.cache.pages_for(span)
        self.tokens[:rows].zero_()
        self.positions[:rows].zero_()
        self.tokens[slots] = tokens
        self.positions[slots] = positions
        if self.offsets is not None:
            self.offsets[:rows].zero_()
            if offsets is not None:
                self.offsets[slots] = offsets
        graph = self.graphs.get((rows, pages))
        if graph is not None:
            graph.replay()
        elif self.use_graphs and len(self.graphs) < self.max_graphs:
            self._capture(rows, pages)
        else:
            self.step(*self._args(rows, pages))

    def _args(self, rows: int, pages: int) -> tuple:
        """decode_rows' arguments over the static buffers (the row offsets only for an M-RoPE model)."""
        args = (self.cache, self.tokens[:rows], self.positions[:rows], pages, self.out)
        return args if self.offsets is None else (*args, self.offsets[:rows])

    def _capture(self, rows: int, pages: int) -> None:
        """Run the step eagerly on a side stream (warm-up, and compilation; its results are this step's), then
        capture it. A step that fails to compile falls back to the uncompiled one."""
        args = self._args(rows, pages)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            try:
                for _ in range(2):  # idempotent: same tokens, same cache writes, same logits
                    self.step(*args)
            except Exception:
                if self.step is self.lm.decode_rows:
                    raise
                logging.getLogger(__name__).exception("torch.compile of the decode step failed; running it eagerly")
                self.step = self.lm.decode_rows
                for _ in range(2):
                    self.step(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.step(*args)
        except Exception:
            logging.getLogger(__name__).exception("CUDA graph capture failed; decoding without graphs")
            self.use_graphs = False
            self.graphs.clear()
            return
        self.pool = self.pool or graph.pool()
        self.graphs[(rows, pages)] = graph
