"""Decode attention over a paged KV cache, as two Triton kernels (flash-decoding with a split over pages).

Why our own kernel: torch's SDPA kernels need each sequence's keys in one strided block, so a paged cache would
first be gathered into a copy (reading and writing every live key and value once more per step, when decode is
bound by exactly those bytes); flex_attention's paged path compiles per block mask and is meant for prefill-sized
queries. Decode has one query per sequence, so one program takes one (sequence, KV head) pair and all the query
heads that share it (grouped-query attention without repeating keys), walks its page-table entries and keeps an
online softmax. When there are too few (sequence, head) pairs to fill the GPU, each pair's pages are split over
several programs and a second kernel merges their partial results (flash-decoding). The split count depends only
on the batch size, never on the lengths, so a CUDA graph captured for a batch size stays valid as sequences grow.

It is registered as a torch custom op, so a decode step compiled by torch.compile calls it as one opaque node.
The signature matches `engines.models.paged_attention.paged_decode_attention`, whose torch path is the reference
the tests compare against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(Q, K, V, PAGE_TABLE, LENGTHS, ACC, MAX, SUM, scale,
                  q_b, q_h, k_p, k_h, k_s, pt_b, acc_b, acc_h, acc_s, ms_b, ms_h,
                  GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                  PAGES_PER_BLOCK: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
    """Program (b, kv_head, split): the GROUP query heads of kv_head over this split's pages of sequence b;
    writes its unnormalised output, running max and sum (log2 domain) for the merge."""
    b = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(LENGTHS + b)
    pages = tl.cdiv(length, PAGE)
    per_split = tl.cdiv(pages, SPLITS)
    first = split * per_split
    last = tl.minimum(first + per_split, pages)

    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * q_b + (kv * GROUP + heads)[:, None] * q_h + dims[None, :], mask=head_ok[:, None], other=0.0)

    BLOCK_N: tl.constexpr = PAGE * PAGES_PER_BLOCK
    cols = tl.arange(0, BLOCK_N)
    col_page = cols // PAGE
    col_slot = cols % PAGE
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    s_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp2 is the native instruction
    for p0 in range(first, last, PAGES_PER_BLOCK):
        page = p0 + col_page
        valid = (page < last) & (page * PAGE + col_slot < length)
        phys = tl.load(PAGE_TABLE + b * pt_b + page, mask=page < last, other=0).to(tl.int64)
        offsets = phys[:, None] * k_p + kv * k_h + col_slot[:, None] * k_s + dims[None, :]
        k = tl.load(K + offsets, mask=valid[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        s_sum = s_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + offsets, mask=valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    out_heads = kv * GROUP + heads
    tl.store(ACC + b * acc_b + out_heads[:, None] * acc_h + split * acc_s + dims[None, :], acc, mask=head_ok[:, None])
    tl.store(MAX + b * ms_b + out_heads * ms_h + split, m, mask=head_ok)
    tl.store(SUM + b * ms_b + out_heads * ms_h + split, s_sum, mask=head_ok)


@triton.jit
def _merge_kernel(ACC, MAX, SUM, OUT, acc_b, acc_h, acc_s, ms_b, ms_h, o_b, o_h,
                  HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (b, head): combine the splits' partial softmax results into the output row."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    ok = splits < SPLITS
    m = tl.load(MAX + b * ms_b + h * ms_h + splits, mask=ok, other=float("-inf"))
    s = tl.load(SUM + b * ms_b + h * ms_h + splits, mask=ok, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(ok & (m > float("-inf")), tl.exp2(m - top), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(ACC + b * acc_b + h * acc_h + splits[:, None] * acc_s + dims[None, :], mask=ok[:, None], other=0.0)
    total = tl.sum(w * s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + b * o_b + h * o_h + dims, out.to(OUT.dtype.element_ty))


def num_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Programs per (sequence, KV head): enough to give every SM two programs, at most 16."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    pairs = batch * kv_heads
    return max(1, min(16, -(-2 * sms // pairs)))


@torch.library.custom_op("rlflow::paged_decode_attention", mutates_args=())
def paged_decode_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                  page_table: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D]; k_pool/v_pool [P, KV, page, D]; page_table int32 [B, max_pages]; lengths int32 [B] (keys
    visible to each query, the new token's included). Returns [B, H, D] in q's dtype. Rows of length 0 give 0."""
    batch, heads, dim = q.shape
    _, kv_heads, page, _ = k_pool.shape
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"head_dim {dim}: the Triton paged decode kernel needs a power of two >= 16")
    group = heads // kv_heads
    q = q.contiguous()
    splits = num_splits(batch, kv_heads, q.device)
    acc = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    top = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    total = torch.empty_like(top)
    out = torch.empty_like(q)
    pages_per_block = max(1, 64 // page)
    _split_kernel[(batch, kv_heads, splits)](
        q, k_pool, v_pool, page_table, lengths, acc, top, total, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), page_table.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), top.stride(0), top.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, PAGE=page,
        PAGES_PER_BLOCK=pages_per_block, SPLITS=splits, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    _merge_kernel[(batch, heads)](
        acc, top, total, out, acc.stride(0), acc.stride(1), acc.stride(2), top.stride(0), top.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=dim, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
    )
    return out


@paged_decode_attention_triton.register_fake
def _(q, k_pool, v_pool, page_table, lengths, scale):
    """Shapes for torch.compile, which then treats the kernel as one opaque op inside a compiled decode step."""
    return torch.empty_like(q)
