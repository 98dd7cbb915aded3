"""Attention over a paged KV cache: the one decode attention of the embedded engine, and the k/v store.

A layer's pool holds keys (and values) as [num_pages, kv_heads, page_size, head_dim]; a sequence's tokens
live in the pages its page-table row lists, token p at page_table[row, p // page_size], offset
p % page_size. On CUDA the decode attention runs the Triton kernel of
`engines/models/paged_attention_triton.py` when that module imports (it loops to each row's own length);
everywhere else a reference path gathers each row's pages and runs one masked SDPA. Both take the same
arguments, and nothing here waits for the device, so a CUDA graph can capture either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlflow.engines.models.triton_kernels import triton_kernel


def fast_kernel() -> Callable[..., torch.Tensor] | None:
    """The Triton decode kernel, or None where it is missing (no triton, or the module not there)."""
    return triton_kernel("paged_attention_triton", "paged_decode_attention_triton")


def uses_fast_kernel(device: torch.device, head_dim: int) -> bool:
    """Whether decode on `device` runs the Triton kernel, which loops to each row's own length (so a captured
    graph need not fix a span); it takes head dims that are powers of two from 16 on."""
    supported = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    return device.type == "cuda" and supported and fast_kernel() is not None


def decode_attention(device: torch.device, head_dim: int) -> Callable[..., torch.Tensor]:
    """The decode attention for tensors on `device`, chosen once (the caller keeps it, so a compiled decode step
    sees one function, not a lookup): the Triton kernel where `uses_fast_kernel`, else the torch reference.

    Either is called as f(q [B, H, D], k_pool, v_pool, page_table int32 [B, maxp], lengths int32 [B] (>= 1),
    scale): one query per row over the first lengths[b] tokens of row b's pages (the new token's k/v already
    stored); returns [B, H, D]."""
    return fast_kernel() if uses_fast_kernel(device, head_dim) else reference_paged_decode_attention


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                           lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention` applied once (tests and one-off calls)."""
    return decode_attention(q.device, q.shape[-1])(q, k_pool, v_pool, page_table, lengths, scale)


def gather_pages(pool: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """The pages of every row laid end to end: [B, KV, maxp * page_size, D]."""
    b, maxp = page_table.shape
    _, kv, page, d = pool.shape
    return pool[page_table.long()].permute(0, 2, 1, 3, 4).reshape(b, kv, maxp * page, d)


def reference_paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Gather each row's pages and run one masked SDPA; the query heads sharing a KV head become that head's
    query rows ([B, KV, H/KV, D]), so grouped-query attention never repeats the cache."""
    b, h, d = q.shape
    kv = k_pool.shape[1]
    keys, values = gather_pages(k_pool, page_table), gather_pages(v_pool, page_table)
    visible = torch.arange(keys.shape[2], device=q.device)[None] < lengths[:, None]  # [B, L]
    grouped = q.reshape(b, kv, h // kv, d)
    with sdpa_backends(q.device, flash=False):
        o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible[:, None, None], scale=scale)
    return o.reshape(b, h, d)


def sdpa_backends(device: torch.device, flash: bool):
    """SDPA kernels to use on CUDA: flash for causal prefill; the memory-efficient kernel for masked attention
    (cuDNN's is not asked for: slower for these shapes). Elsewhere torch picks."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, *backends] if flash else backends)


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write row b's new key/value k[b], v[b] [KV, D] at token positions[b] of its pages (pure indexing: no
    host sync, so a CUDA graph captures it)."""
    page_size = k_pool.shape[2]
    rows = torch.arange(positions.shape[0], device=positions.device)
    pages = page_table[rows, positions // page_size].long()
    offsets = positions % page_size
    k_pool[pages, :, offsets] = k
    v_pool[pages, :, offsets] = v
