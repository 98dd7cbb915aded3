"""Where a train worker gets a micro-batch's images: digests from the batch, bytes from the run store, pixels from
the model's own image processor (docs/multimodal.md, item 6).

Why digests and not pixels in the batch: a TrainBatch crosses Ray once per worker per step, and a GRPO group's
samples share one prompt, so pixels per sample would be sent (and processed) group-size times. The batch carries
each sample's image digests (`image_ids`, uint8 [N, max images, 32], all-zero where a sample has fewer), the run
store holds each image's bytes once (RunStore.put_image at prompt time), and each worker decodes and processes an
image once, keeping its pixel inputs in a cache bounded by bytes (an epoch sees the same prompts again).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from rlflow.engines.core.batch import DIGEST_BYTES, IMAGE_IDS, image_digests
from rlflow.engines.models.packed import PackedRows
from rlflow.engines.models.vision_language import VisionProcessor, open_image
from rlflow.engines.store.run_store import RunStore


class ImageInputs:
    """A train worker's images: each digest's pixel inputs (pixel_values [patches, C*T*P*P], image_grid_thw [3]),
    read from the run store and processed once, then kept while they fit in `cache_bytes`, least recently used
    evicted first."""

    def __init__(self, model_path: str, store: RunStore | None, cache_bytes: int = 1 << 30):
        self.processor = VisionProcessor(model_path)
        self.store, self.cache_bytes = store, cache_bytes
        self._cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._held = 0
        self.processed = 0  # images decoded and processed (cache misses), for tests and metrics

    def pixel_inputs(self, digest: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, grid_thw [3]) of one image, from the cache or the run store."""
        hit = self._cache.get(digest)
        if hit is not None:
            self._cache.move_to_end(digest)
            return hit
        if self.store is None:
            raise ValueError(f"image {digest}: this train worker has no run store to read images from (a "
                             "vision-language batch needs the run's storage passed to the train backend)")
        out = self.processor.pixel_inputs([open_image(self.store.get_image(digest))])
        entry = out["pixel_values"], out["image_grid_thw"][0]
        self.processed += 1
        self._keep(digest, entry)
        return entry

    def _keep(self, digest: str, entry: tuple[torch.Tensor, torch.Tensor]) -> None:
        size = entry[0].nbytes + entry[1].nbytes
        self._cache[digest] = entry
        self._held += size
        while self._held > self.cache_bytes and len(self._cache) > 1:
            _, (pixels, grid) = self._cache.popitem(last=False)
            self._held -= pixels.nbytes + grid.nbytes

    def attach(self, packed: PackedRows, image_ids: torch.Tensor) -> PackedRows:
        """`packed` with its rows' images (PackedRows.with_images): each distinct digest of the micro-batch
        processed (or found in the cache) once, in order of first appearance."""
        if image_ids.dim() != 3 or image_ids.shape[-1] != DIGEST_BYTES:
            raise ValueError(f"{IMAGE_IDS}: expected uint8 [rows, max images, {DIGEST_BYTES}] (raw sha256 digests), "
                             f"got {image_ids.dtype} {list(image_ids.shape)}")
        rows = image_digests(image_ids)
        distinct = list(dict.fromkeys(d for row in rows for d in row))
        index = {d: i for i, d in enumerate(distinct)}
        inputs = [self.pixel_inputs(d) for d in distinct]
        pixels = torch.cat([p for p, _ in inputs]) if inputs else torch.zeros(0)  # none: PackedLM's blank image
        grids = torch.stack([g for _, g in inputs]) if inputs else torch.zeros(0, 3, dtype=torch.long)
        return packed.with_images([[index[d] for d in row] for row in rows], grids, pixels,
                                  self.processor.image_token_id, self.processor.merge)
