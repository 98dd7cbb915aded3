"""Weight sync, train -> rollout: HF-named tensors in buckets, stamped with a weight version.

The trainer's rank 0 holds full weights (data parallel), so it is the only sender. Buckets bound the
memory a transfer holds at once; the version travels with every update so each generated sample
records which policy produced it.
"""

from __future__ import annotations

from collections.abc import Iterator


def plan_buckets(layout: list[tuple[str, int]], bucket_bytes: int) -> Iterator[list[str]]:
    """Group weight names into buckets of at most `bucket_bytes` (a single larger tensor gets its own)."""
    bucket, size = [], 0
    for name, nbytes in layout:
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(name)
        size += nbytes
    if bucket:
        yield bucket
