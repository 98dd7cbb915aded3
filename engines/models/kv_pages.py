"""The paged KV cache: one pool of fixed-size pages per layer, a host allocator with reference counts, and
the device page table a decode step reads.

Why pages: a slot per sequence reserves memory for the longest possible sequence in every slot; pages are
taken as a sequence grows, so the pool holds as many tokens as are live, and the samples of one prompt can
share the prompt's full pages (reference counts; the partial last page is copied, so a shared page is never
written). Page 0 is a scratch page no sequence owns: rows that are not decoding point at it, so the padding
rows of a fixed-shape (CUDA-graph) decode step write there and nowhere else.
"""

from __future__ import annotations

import math

import torch

from rlflow.engines.models.transfer import to_device

SCRATCH_PAGE = 0


class PageAllocator:
    """Free pages and how many sequences hold each page (host side; the engine thread is its only user)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"KV cache: {num_pages} pages; at least 2 are needed (page 0 is scratch)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages held once each, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each page (a sample of a group taking the prompt's full pages)."""
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"KV cache: page {p} is shared but not held")
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one hold on each page; a page nobody holds is free again."""
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"KV cache: page {p} released but not held")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refs(self, page: int) -> int:
        return self._refs[page]


class PagedKVCache:
    """k and v pools per layer [num_pages, kv_heads, page_size, head_dim], the allocator, and the device page
    table int32 [rows, max_pages] (row r: the pages of the sequence decoding in row r). Page-table writes are
    queued on the host and applied by `flush` right before a decode step, in stream order after any decode
    still running, so a freed row stops pointing at its pages before the next step reads the table."""

    def __init__(
        self,
        layers: int,
        rows: int,
        max_len: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if page_size <= 0:
            raise ValueError(f"KV cache page_size: {page_size}; expected a positive number of tokens")
        shape = (num_pages, kv_heads, page_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows, self.page_size, self.num_pages = rows, page_size, num_pages
        self.max_pages = math.ceil(max_len / page_size)
        self.max_len = self.max_pages * page_size
        self.page_table = torch.zeros(rows, self.max_pages, dtype=torch.int32, device=device)
        self.allocator = PageAllocator(num_pages)
        self._pending: dict[tuple[int, int], int] = {}  # (row, index) -> page, applied by flush()

    @staticmethod
    def page_bytes(layers: int, kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one page takes over all layers, keys and values."""
        return 2 * layers * kv_heads * page_size * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def device(self) -> torch.device:
        return self.page_table.device

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def set_row(self, row: int, pages: list[int], start: int = 0) -> None:
        """Row `row` holds `pages` from page index `start` on (queued until `flush`)."""
        for i, p in enumerate(pages, start):
            self._pending[(row, i)] = p

    def clear_row(self, row: int) -> None:
        """Row `row` decodes nothing: its first entry goes back to the scratch page (padding writes land there)."""
        self._pending[(row, 0)] = SCRATCH_PAGE

    def flush(self) -> None:
        """Apply queued page-table writes (one host-to-device copy)."""
        if not self._pending:
            return
        keys = list(self._pending)
        index = to_device([[r for r, _ in keys], [i for _, i in keys]], torch.long, self.device)
        values = to_device([self._pending[k] for k in keys], torch.int32, self.device)
        self.page_table[index[0], index[1]] = values
        self._pending.clear()

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page `src` into `dst` in every layer (copy-on-write of a shared prompt's partial last page)."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens' keys/values k, v [N, KV, D] at (pages[n], offsets[n]) of layer `layer`."""
        self.k[layer][pages, :, offsets] = k
        self.v[layer][pages, :, offsets] = v

    def slots(self, pages: list[int], start: int, stop: int) -> tuple[list[int], list[int]]:
        """Host (page, offset) of token positions start..stop-1 of a sequence holding `pages`."""
        ps = self.page_size
        return [pages[p // ps] for p in range(start, stop)], [p % ps for p in range(start, stop)]
