"""The embedded engine's images: a request's image data checked against its prompt, and the vision encoder's
embeddings of each distinct image, computed once and cached by content digest.

A prompt's images are placed by runs of image pad tokens, one run per image: either expanded (one pad per merged
patch, what rlflow's VisionProcessor writes) or SGLang's form, one pad per image, which is expanded here from the
image's grid as SGLang's processor does; the request then runs, and reports, the expanded ids.

Why a cache by digest: a GRPO group's n samples carry the same images (and a data set's prompts often share
them); the vision tower is run once per image, not per sample or per call. A prompt's `PromptImages` also keeps
the `SequenceImages` it was first prefilled with, so a re-prefill after preemption uses the same embeddings even
when the cache has let them go meanwhile. Weight updates that may move the tower (it trains) clear the cache
(`clear`), and a prompt prefilled again after one gets the new tower's embeddings.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlflow.engines.core.images import image_digest
from rlflow.engines.models.decoder import SequenceImages
from rlflow.engines.models.vision_language import IMAGE_PAD, VisionProcessor, mrope_positions, open_image, pad_runs

CACHED_IMAGES = 64  # distinct images whose embeddings are kept (a step's prompts' images, typically)
MAX_PATH_CHARS = 4096  # a longer string is never taken for a file path


def image_bytes(item: str | bytes, where: str) -> bytes:
    """An image's encoded bytes from what /generate's image_data takes: a `data:image/...;base64,` URI, a local
    file path, or raw base64 (bytes are taken as they are)."""
    if isinstance(item, bytes):
        return item
    if not isinstance(item, str) or not item:
        raise ValueError(f"{where}: expected a base64 data URI, raw base64 or a local file path, got "
                         f"{type(item).__name__}")
    if item.startswith("data:"):
        head, sep, payload = item.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError(f"{where}: a data URI must be 'data:<mime>;base64,<data>' (got {item[:40]!r}...)")
        item = payload
    elif len(item) < MAX_PATH_CHARS and Path(item).is_file():
        return Path(item).read_bytes()
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: neither valid base64 nor an existing file ({item[:40]!r}...)") from None


@dataclass(eq=False)
class PromptImages:
    """A prompt's images, checked against its tokens: the prompt ids with every image's pads expanded, digests and
    grids in order, M-RoPE positions [3, P] and delta, the pad tokens' indices; the encoded bytes (to compute
    embeddings again if the cache dropped them), and once prefilled, the `SequenceImages` it used."""

    prompt_ids: list[int]
    digests: tuple[str, ...]
    grids: tuple[tuple[int, int, int], ...]
    positions: torch.Tensor
    delta: int
    pad_index: torch.Tensor
    data: tuple[bytes, ...] = field(repr=False)
    sequence: SequenceImages | None = None
    tower_version: int = -1  # VisionEncoder.tower_version its sequence's embeddings are of


@dataclass
class _Entry:
    grid: tuple[int, int, int]
    pixels: torch.Tensor | None = None  # the image processor's patches, until embedded
    embeds: torch.Tensor | None = None


class VisionEncoder:
    """A vision-language model's image processor and vision tower (`model.model.visual`), with an LRU cache of
    `cache_images` images by digest. `calls` counts vision-tower forwards (tests and metrics read it)."""

    def __init__(self, model: torch.nn.Module, processor: VisionProcessor, cache_images: int = CACHED_IMAGES):
        self.visual, self.processor = model.model.visual, processor
        self.cache_images = cache_images
        self.calls = 0
        self.tower_version = 0  # the weights' version the embeddings are of (clear moves it)
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()  # prepare runs on request threads, embeddings on the engine's

    def clear(self) -> None:
        """Forget every cached embedding (the tower's weights changed), those a prompt kept for its re-prefills too:
        a request preempted across the update is prefilled again with the new tower's embeddings."""
        with self._lock:
            self._cache.clear()
            self.tower_version += 1

    def prepare(self, input_ids: Sequence[int], items: Sequence[str | bytes], where: str = "image_data"
                ) -> PromptImages:
        """Decode a request's images and check them against its tokens: one run of image pad tokens per image,
        each as long as its image's merged patches or a single pad (expanded here). ValueError naming the field
        otherwise."""
        data = tuple(image_bytes(item, f"{where}[{i}]") for i, item in enumerate(items))
        pad = self.processor.image_token_id
        runs = len(pad_runs(input_ids, pad))
        if runs != len(data):  # checked before any image is processed
            raise ValueError(f"{where}: {len(data)} image(s) for {runs} image placeholder(s) in input_ids (runs of "
                             f"{IMAGE_PAD}, token id {pad})")
        digests = tuple(image_digest(d) for d in data)
        grids = self._grids(digests, data, where)
        ids = self.processor.expand(list(input_ids), grids, "input_ids")
        positions, delta = mrope_positions(ids, grids, pad, self.processor.merge)
        pad_index = torch.tensor([i for i, t in enumerate(ids) if t == pad], dtype=torch.long)
        return PromptImages(ids, digests, grids, positions, delta, pad_index, data)

    def _grids(self, digests: tuple[str, ...], data: tuple[bytes, ...], where: str) -> tuple:
        """Each image's (t, h, w) patch grid: cached, or from the image processor (whose patches are kept for the
        embedding)."""
        with self._lock:
            known = {d: self._cache[d].grid for d in digests if d in self._cache}
        fresh = {d: b for d, b in zip(digests, data, strict=True) if d not in known}
        for d, entry in self._process(fresh, where).items():
            known[d] = entry.grid
            self._remember(d, entry)
        return tuple(known[d] for d in digests)

    def _process(self, images: dict[str, bytes], where: str) -> dict[str, _Entry]:
        """The image processor on distinct images: {digest: entry with its grid and patches}."""
        if not images:
            return {}
        opened = []
        for d, b in images.items():
            try:
                opened.append(open_image(b))
            except Exception as exc:  # PIL raises several types for bytes that are no image
                raise ValueError(f"{where}: the image with sha256 {d[:12]}... is not an image PIL can read ({exc})"
                                 ) from None
        out = self.processor.pixel_inputs(opened)
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
        pixels = out["pixel_values"].split([t * h * w for t, h, w in grids])
        return {d: _Entry(g, p) for d, g, p in zip(images, grids, pixels, strict=True)}

    def _remember(self, digest: str, entry: _Entry) -> None:
        with self._lock:
            self._cache[digest] = entry
            self._cache.move_to_end(digest)
            while len(self._cache) > self.cache_images:
                self._cache.popitem(last=False)

    @torch.no_grad()
    def warm(self, prompts: Sequence[PromptImages]) -> None:
        """Embed, in one tower call, the pictures not cached yet of the prompts a prefill step is about to run (at
        most cache_images of them, so none is dropped before its prompt reads it): one call a step, not a prompt."""
        stale = [p for p in prompts if p.sequence is None or p.tower_version != self.tower_version]
        images = {d: b for p in stale for d, b in zip(p.digests, p.data, strict=True)}
        if images:
            self._embeddings(dict(list(images.items())[:self.cache_images]))

    @torch.no_grad()
    def sequence(self, prompt: PromptImages) -> SequenceImages:
        """The prompt's positions and image embeddings for a prefill (the same object on every later prefill of
        it, until the tower changes). Images not cached go through the vision tower together, in one call."""
        if prompt.sequence is None or prompt.tower_version != self.tower_version:
            version = self.tower_version
            embeds = self._embeddings(dict(zip(prompt.digests, prompt.data, strict=True)))
            rows = torch.cat([embeds[d] for d in prompt.digests])
            prompt.sequence = SequenceImages(prompt.positions, prompt.delta, prompt.pad_index, rows)
            prompt.tower_version = version
        return prompt.sequence

    def _embeddings(self, images: dict[str, bytes]) -> dict[str, torch.Tensor]:
        """{digest: embeddings [tokens, hidden]} of the images (digest: encoded bytes), from the cache or one call
        of the vision tower for all that are not cached."""
        with self._lock:
            entries = {d: self._cache.get(d) for d in images}
        out = {d: e.embeds for d, e in entries.items() if e is not None and e.embeds is not None}
        missing = [d for d in entries if d not in out]
        if not missing:
            return out
        lost = {d: images[d] for d in missing if entries[d] is None or entries[d].pixels is None}
        entries |= self._process(lost, "image_data")
        pixels = torch.cat([entries[d].pixels for d in missing])
        grid = torch.tensor([entries[d].grid for d in missing], dtype=torch.long, device=self.device)
        result = self.visual(pixels.to(self.device, self.visual.dtype), grid_thw=grid)
        self.calls += 1
        merged = getattr(result, "pooler_output", result)  # transformers >= 5.2 returns an output object
        sizes = [self.processor.tokens_per_image(entries[d].grid) for d in missing]
        for d, rows in zip(missing, merged.split(sizes), strict=True):
            out[d] = rows
            self._remember(d, _Entry(entries[d].grid, None, rows))
        return out

    @property
    def device(self) -> torch.device:
        return next(self.visual.parameters()).device
