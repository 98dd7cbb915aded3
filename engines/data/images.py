"""A data row's images as their encoded bytes, checked: what vision-language prompts carry (docs/multimodal.md).

A row's image value is what HF `datasets` gives for its Image feature read undecoded (`{"bytes", "path"}`: the
bytes win), a path (relative to the data file's folder, local or any fsspec URL), or raw bytes; verl's `images`
and TRL's `images` hold a list of them, TRL's `image` one. The bytes are kept as given (PNG, JPEG, ...): never
re-encoded, so an image's content digest is the same wherever it is read. Each image is opened with PIL once, to
refuse what the processor could not take with an error naming it, before a step runs.
"""

from __future__ import annotations

import io
import posixpath
from dataclasses import dataclass, field
from typing import Any

import fsspec
from PIL import Image, UnidentifiedImageError

from rlflow.engines.core.config import DataConfig
from rlflow.engines.core.images import IMAGE_PLACEHOLDER

IMAGE_COLUMNS = ("images", "image")  # verl's and TRL's list column, TRL's single-image column
DEFAULT_MAX_PIXELS = DataConfig.model_fields["max_image_pixels"].default


class ImageError(ValueError):
    """What is wrong with one of a row's images; the prompt reader adds the file and row."""


@dataclass(frozen=True)
class ImageReader:
    """Reads a row's images: paths relative to `base` (the data file's folder, a local path or fsspec URL), with
    the data file's `storage_options`, each checked against `max_pixels`."""

    base: str = ""
    storage_options: dict | None = field(default=None, hash=False)
    max_pixels: int = DEFAULT_MAX_PIXELS

    @classmethod
    def for_file(cls, path: str, storage_options: dict | None, max_pixels: int) -> ImageReader:
        """The reader for images named by a data file at `path`. The options are copied: datasets' load_dataset
        adds its own keys to the dict it is given, which fsspec's filesystems refuse."""
        return cls(posixpath.dirname(path.split("?")[0]), dict(storage_options or {}), max_pixels)

    def row_images(self, obj: dict) -> list[bytes] | None:
        """The images of a data row (its `images` or `image` column), in order; None when it has neither."""
        given = [k for k in IMAGE_COLUMNS if obj.get(k) is not None]
        if len(given) > 1:
            raise ImageError('both "images" and "image" are set: give a row\'s images in one of them')
        if not given:
            return None
        value = obj[given[0]]
        values = value if isinstance(value, list) else [value]
        return [self.read(v, f'"{given[0]}"' + (f" item {i}" if isinstance(value, list) else ""))
                for i, v in enumerate(values)]

    def read(self, value: Any, where: str) -> bytes:
        """One image value as its encoded bytes, checked to be an image PIL opens of at most max_pixels."""
        data = self._bytes(value, where)
        self.check(data, where)
        return data

    def _bytes(self, value: Any, where: str) -> bytes:
        if isinstance(value, dict):  # HF datasets' Image feature: bytes, else a path
            if value.get("bytes") is not None:
                return bytes(value["bytes"])
            if value.get("path"):
                return self._file(value["path"], where)
            raise ImageError(f'{where}: an image with neither "bytes" nor "path"')
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        if isinstance(value, str) and value:
            return self._file(value, where)
        raise ImageError(f'{where}: expected an image as {{"bytes", "path"}}, a path or bytes, got '
                         f"{type(value).__name__}")

    def _file(self, path: str, where: str) -> bytes:
        """An image file: a URL or absolute path as it is, a relative path from the data file's folder."""
        full = path if "://" in path or posixpath.isabs(path) or not self.base else posixpath.join(self.base, path)
        try:
            fs, local = fsspec.core.url_to_fs(full, **(self.storage_options or {}))
            return fs.cat_file(local)
        except FileNotFoundError:
            raise ImageError(f"{where}: image file not found: {full}") from None
        except Exception as e:  # an unreachable store or a bad URL
            raise ImageError(f"{where}: cannot read image file {full}: {type(e).__name__}: {e}") from None

    def check(self, data: bytes, where: str) -> None:
        """Refuse bytes PIL cannot read as an image, and an image larger than max_pixels (width x height)."""
        try:
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
                img.verify()  # the file's own checksums (PNG's CRCs), without decoding the pixels
        except Image.DecompressionBombError as e:
            raise ImageError(f"{where}: {e}; data.max_image_pixels is {self.max_pixels}") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise ImageError(f"{where}: {len(data)} bytes that PIL cannot read as an image "
                             f"({type(e).__name__}: {e})") from None
        if width * height > self.max_pixels:
            raise ImageError(f"{where}: the image is {width}x{height} = {width * height} pixels, more than "
                             f"data.max_image_pixels = {self.max_pixels}")


def image_parts(messages: list[dict]) -> int:
    """The images chat messages place: verl's `<image>` markers in text, or TRL's {"type": "image"} parts."""
    count = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            count += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, list):
            count += sum(1 for c in content if isinstance(c, dict) and c.get("type") == "image")
    return count


def check_placeholders(messages: list[dict], n_images: int) -> None:
    """More image places in the messages than images given is an error (fewer: the rest go first, as TRL does)."""
    count = image_parts(messages)
    if count > n_images:
        raise ImageError(f"the prompt has {count} image placeholders ('{IMAGE_PLACEHOLDER}' or image parts) for "
                         f"{n_images} images")
