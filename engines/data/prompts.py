"""Prompt files and a resumable, deterministic walk over them in batches.

Files are read with Hugging Face `datasets` (JSON lines or parquet; a local path or an fsspec URL such as
s3://, with `storage_options`): it converts a file once to a memory-mapped Arrow table in its cache, and rows
are read from it when a step takes them, so a large file never sits in memory as Python objects. Rows come in
the formats verl and TRL users have (docs/data.md): plain `prompt`/`label`; verl's `prompt` as chat messages
with `reward_model.ground_truth`, `data_source`, `extra_info`; TRL's `prompt`/`completion` and `messages`.
Vision-language rows add verl's `images` or TRL's `image`/`images` (engines/data/images.py reads them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import PurePosixPath
from typing import Any

import fsspec
import numpy as np
import pyarrow.parquet as pq

from rlflow.engines.data.images import DEFAULT_MAX_PIXELS, IMAGE_COLUMNS, ImageError, ImageReader, check_placeholders

JSON_SUFFIXES, PARQUET_SUFFIXES = (".jsonl", ".json"), (".parquet",)
# where a label is found when `label_key` is left at "label" and the row has none: verl's ground truth, TRL's
# completion (prompt-completion rows); TRL `messages` rows give the last assistant turn
LABEL_FALLBACKS = ("reward_model.ground_truth", "completion")
DEFAULT_LABEL_KEYS = ("label", "response")  # data.label_key's and sft.response_key's defaults


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file and what was expected."""


class _RowError(ValueError):
    """What is wrong with one row; the caller adds the file and the row's position."""


def _get(obj: dict, key: str) -> Any:
    """obj[key], following a dotted key into nested objects (`reward_model.ground_truth`); None when absent."""
    if obj.get(key) is not None or "." not in key:
        return obj.get(key)
    for part in key.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _messages(value: Any, field: str) -> list[dict]:
    """Chat messages as [{"role", "content"}, ...]; the nulls a column union adds to each message are dropped.
    A content is a string, or (TRL's vision rows) a list of {"type": "text", "text"} and {"type": "image"} parts."""
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _RowError(f'"{field}" item {i} must be a chat message {{"role": str, "content": str}}, got {m!r}')
        content = m.get("content")
        if isinstance(content, list):
            content = _parts(content, f'"{field}" item {i}')
        elif not isinstance(content, str):
            raise _RowError(f'"{field}" item {i} must be a chat message {{"role": str, "content": str}}, got {m!r}')
        out.append({k: v for k, v in m.items() if v is not None} | {"content": content})
    if not out:
        raise _RowError(f'"{field}" is an empty list of chat messages')
    return out


def _parts(content: list, where: str) -> list[dict]:
    """A message's content parts, each {"type": "text", "text": str} or {"type": "image"} (nulls dropped)."""
    out = []
    for j, c in enumerate(content):
        part = {k: v for k, v in c.items() if v is not None} if isinstance(c, dict) else None
        if part is None or not (part.get("type") == "image" or (part.get("type") == "text"
                                                                and isinstance(part.get("text"), str))):
            raise _RowError(f'{where} content part {j} must be {{"type": "text", "text": str}} or '
                            f'{{"type": "image"}}, got {c!r}')
        out.append(part)
    return out


def _content_text(content: str | list[dict]) -> str:
    """A message's text: its content, or the text of its parts (images left out)."""
    return content if isinstance(content, str) else "".join(c["text"] for c in content if c["type"] == "text")


def _text(value: Any, field: str) -> Any:
    """A label given as chat messages (TRL's conversational completion) is its messages' text."""
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return "".join(_content_text(m["content"]) for m in _messages(value, field))
    return value


def normalize_row(obj: Any, prompt_key: str, label_key: str, images: ImageReader | None = None) -> dict:
    """One data row as {"prompt": text, "label", "meta": the other columns} (+ "messages" when the prompt is
    chat messages: the model sees them through the tokenizer's chat template; "prompt" is then the last user
    message, what tables and rewards show; + "images", the encoded bytes of its images, read by `images`)."""
    if not isinstance(obj, dict):
        raise _RowError(f"expected a JSON object, got {type(obj).__name__}")
    present = [k for k, v in obj.items() if v is not None]
    used = {prompt_key, label_key}  # columns a dotted key reaches into stay in meta (verl's reward_model.style)
    prompt, label, label_found = _get(obj, prompt_key), _get(obj, label_key), _get(obj, label_key) is not None
    conversation = None
    if prompt is None and prompt_key == "prompt" and isinstance(obj.get("messages"), list):  # TRL conversational
        conversation, used = _messages(obj["messages"], "messages"), used | {"messages"}
        if conversation[-1]["role"] == "assistant":
            conversation, last = conversation[:-1], _content_text(conversation[-1]["content"])
            if not label_found and label_key in DEFAULT_LABEL_KEYS:
                label, label_found = last, True
        prompt = conversation
    if not label_found and label_key in DEFAULT_LABEL_KEYS:
        for key in LABEL_FALLBACKS:
            if (label := _get(obj, key)) is not None:
                label_found, used = True, used | {key}
                break
    for key, found in ((prompt_key, prompt is not None), (label_key, label_found)):
        if not found:
            raise _RowError(f'missing key "{key}"; keys present: ' + (", ".join(f'"{k}"' for k in present) or "none"))
    row: dict[str, Any] = {}
    if isinstance(prompt, list):
        row["messages"] = _messages(prompt, prompt_key)
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        prompt = _content_text(users[-1] if users else row["messages"][-1]["content"])
    elif not isinstance(prompt, str):
        raise _RowError(f'"{prompt_key}" must be a string or a list of chat messages, got {type(prompt).__name__}')
    if (pictures := _images(obj, row.get("messages") or [{"role": "user", "content": prompt}], images)):
        row["images"] = pictures
    meta = {k: v for k, v in obj.items() if k not in used and k not in IMAGE_COLUMNS and v is not None}
    return {"prompt": prompt, "label": _text(label, label_key), "meta": meta, **row}


def _images(obj: dict, messages: list[dict], reader: ImageReader | None) -> list[bytes]:
    """The row's images (bytes), checked against the places its messages give them. A row without an image
    column is a text row: an `<image>` in its text is text then, but an image content part needs an image."""
    try:
        found = (reader or ImageReader()).row_images(obj)
        if found is not None or any(isinstance(m["content"], list) for m in messages):
            check_placeholders(messages, len(found or []))
    except ImageError as e:
        raise _RowError(str(e)) from None
    return found or []


def _fs(path: str, storage_options: dict | None):
    return fsspec.core.url_to_fs(path, **(storage_options or {}))[0]


def _jsonl_problem(path: str, storage_options: dict | None) -> str | None:
    """Why a JSON-lines file cannot be a table of rows, naming the line; only read when loading it failed or
    gave no usable rows (datasets' own errors name no line)."""
    types: dict[str, tuple[str, int]] = {}
    row = 0
    offset = 0  # of the line in the file, in bytes: where a bad byte is, for a hex editor or `dd`
    with _fs(path, storage_options).open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"line {lineno} is not UTF-8: byte {raw[e.start]:#04x} at offset {offset + e.start} of the "
                        f"file ({e.reason}); data files must be UTF-8 (convert with e.g. `iconv -f latin1 -t utf-8`)")
            offset += len(raw)
            if not line.strip():
                continue
            row += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                return f"bad JSON on line {lineno}: {e.msg} (column {e.colno})"
            if not isinstance(obj, dict):
                return f"row {row} (line {lineno}): expected a JSON object, got {type(obj).__name__}"
            for k, v in obj.items():
                if v is None:
                    continue
                seen = types.setdefault(k, (type(v).__name__, lineno))
                if seen[0] != type(v).__name__:
                    return (f'"{k}" is {seen[0]} on line {seen[1]} but {type(v).__name__} on line {lineno}: '
                            "a column holds one type")
    return None


def _line_of(path: str, storage_options: dict | None, row: int) -> int:
    """The line of a JSON-lines file holding its `row`-th row (blank lines hold none)."""
    with _fs(path, storage_options).open(path, "r", encoding="utf-8") as f:
        seen = 0
        for lineno, line in enumerate(f, start=1):
            seen += bool(line.strip())
            if seen == row:
                return lineno
    return row


def _parquet_problem(path: str, storage_options: dict | None) -> str | None:
    """Why datasets could not read a parquet file: not parquet at all, or no rows (an error in datasets)."""
    try:
        with _fs(path, storage_options).open(path, "rb") as f:
            rows = pq.ParquetFile(f).metadata.num_rows
    except Exception as e:
        return f"not a readable parquet file: {e}"
    return "data file is empty, expected at least one row" if rows == 0 else None


def _read(path: str, storage_options: dict | None):
    """The file as a datasets.Dataset (memory-mapped Arrow). Raises DataError naming the file."""
    import datasets  # seconds to import: only where a file is read

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    suffix = PurePosixPath(path.split("?")[0]).suffix
    if suffix not in JSON_SUFFIXES + PARQUET_SUFFIXES:
        raise DataError(f"{path}: unknown extension {suffix!r}; expected .jsonl, .json or .parquet")
    try:
        exists = _fs(path, storage_options).isfile(path)
    except Exception as e:  # a bad URL or unreachable store
        raise DataError(f"data file {path}: cannot reach it: {type(e).__name__}: {e}") from None
    if not exists:
        raise DataError(f"data file not found: {path}")
    builder = "json" if suffix in JSON_SUFFIXES else "parquet"
    try:
        table = datasets.load_dataset(builder, data_files=path, split="train", storage_options=storage_options)
        return _undecoded(table, datasets)
    except Exception as e:
        if builder == "json":
            problem = _jsonl_problem(path, storage_options)
            if problem is None and not any(line.strip() for line in _fs(path, storage_options).open(path, "r")):
                problem = "data file is empty, expected at least one row"
        else:
            problem = _parquet_problem(path, storage_options)
        raise DataError(f"{path}: {problem or f'cannot read it: {type(e).__name__}: {e.__cause__ or e}'}") from None


def _undecoded(table, datasets):
    """The dataset with its Image features left as {"bytes", "path"}: datasets would decode them to PIL images
    (re-encoding changes an image's bytes and so its digest) and read a path from the working directory, not the
    data file's folder. The same memory-mapped table, only its features' decode flag changed."""
    features = _no_decode(table.features, datasets)
    if features == table.features:
        return table
    info = table.info.copy()
    info.features = datasets.Features(features)
    return datasets.Dataset(table.data, info=info, split=table.split)


def _no_decode(feature, datasets):
    if isinstance(feature, datasets.Image):
        return datasets.Image(mode=feature.mode, decode=False)
    if isinstance(feature, datasets.List):
        return datasets.List(_no_decode(feature.feature, datasets), length=feature.length)
    if isinstance(feature, dict):
        return {k: _no_decode(v, datasets) for k, v in feature.items()}
    return feature


class PromptRows(Sequence):
    """The rows of a prompt file, checked once on opening and normalized (normalize_row) when taken."""

    def __init__(self, path: str, prompt_key: str = "prompt", label_key: str = "label",
                 storage_options: dict | None = None, max_image_pixels: int = DEFAULT_MAX_PIXELS):
        self.path, self.prompt_key, self.label_key = path, prompt_key, label_key
        self.images = ImageReader.for_file(path, storage_options, max_image_pixels)
        self._table = _read(path, storage_options)
        if len(self._table) == 0:
            raise DataError(f"{path}: data file is empty, expected at least one row")
        json_file = PurePosixPath(path).suffix in JSON_SUFFIXES
        try:
            self._check(storage_options, json_file)
        except UnicodeDecodeError as e:  # Arrow's JSON reader keeps invalid UTF-8; decoding a row finds it
            problem = _jsonl_problem(path, storage_options) if json_file else None
            raise DataError(f"{path}: {problem or f'is not UTF-8: {e}'}") from None

    def _check(self, storage_options: dict | None, json_file: bool) -> None:
        """Normalize every row once, so a bad row fails on opening, naming its row (and line)."""
        path, prompt_key, label_key = self.path, self.prompt_key, self.label_key
        for i, batch in enumerate(self._table.iter(batch_size=1024)):
            for j, obj in enumerate(_rows_of(batch)):
                try:
                    normalize_row(obj, prompt_key, label_key, self.images)
                except _RowError as e:
                    row = i * 1024 + j + 1
                    if json_file and (problem := _jsonl_problem(path, storage_options)):
                        raise DataError(f"{path}: {problem}") from None
                    where = f"row {row}" + (f" (line {_line_of(path, storage_options, row)})" if json_file else "")
                    msg = str(e)
                    if msg.startswith("missing key"):
                        key, present = msg.split("; ", 1)
                        raise DataError(f"{path}: {key} in {where}; {present}") from None
                    raise DataError(f"{path}: {where}: {msg}") from None

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return normalize_row(self._table[int(i)], self.prompt_key, self.label_key, self.images)

    def __iter__(self) -> Iterator[dict]:
        for batch in self._table.iter(batch_size=1024):
            for obj in _rows_of(batch):
                yield normalize_row(obj, self.prompt_key, self.label_key, self.images)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


def _rows_of(batch: dict[str, list]) -> list[dict]:
    keys = list(batch)
    return [dict(zip(keys, values, strict=True)) for values in zip(*batch.values(), strict=True)]


def load_prompts(path: str, prompt_key: str = "prompt", label_key: str = "label",
                 storage_options: dict | None = None, max_image_pixels: int = DEFAULT_MAX_PIXELS) -> PromptRows:
    """Rows as {"prompt", "label", "meta"} ("meta" holds the other columns; "messages" chat prompts; "images"
    the encoded bytes of a vision-language row's images). Raises DataError naming the file, the row (and line)
    and the field."""
    return PromptRows(path, prompt_key, label_key, storage_options, max_image_pixels)


class PromptCursor:
    """Walks indices 0..n-1 in batches, one seeded permutation per epoch, so a run resumes on the same batches."""

    def __init__(self, num_prompts: int, batch_size: int, seed: int, shuffle: bool = True):
        if num_prompts <= 0:
            raise ValueError(f"PromptCursor: num_prompts must be positive, got {num_prompts}")
        if batch_size <= 0:
            raise ValueError(f"PromptCursor: batch_size must be positive, got {batch_size}")
        self.num_prompts, self.batch_size, self.seed, self.shuffle = num_prompts, batch_size, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._perm: list[int] | None = None

    def _order(self) -> list[int]:
        if self._perm is None:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, self.epoch])
                self._perm = rng.permutation(self.num_prompts).tolist()
            else:
                self._perm = list(range(self.num_prompts))
        return self._perm

    def next_batch(self, size: int | None = None) -> list[int]:
        """The next batch_size (or `size`) indices; a batch that runs past an epoch's end continues into the
        next epoch."""
        size = self.batch_size if size is None else size
        batch: list[int] = []
        while len(batch) < size:
            take = min(size - len(batch), self.num_prompts - self.offset)
            batch += self._order()[self.offset : self.offset + take]
            self.offset += take
            if self.offset == self.num_prompts:
                self.epoch, self.offset, self._perm = self.epoch + 1, 0, None
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, d: dict) -> None:
        """Restore a position; refuse one saved over a different number of prompts, whose batches would differ."""
        if d.get("num_prompts", self.num_prompts) != self.num_prompts:
            raise ValueError(
                f"PromptCursor: state was saved over {d['num_prompts']} prompts, this cursor has {self.num_prompts}"
            )
        epoch, offset = int(d["epoch"]), int(d["offset"])
        if epoch < 0 or not 0 <= offset < self.num_prompts:
            raise ValueError(f"PromptCursor: bad state epoch={epoch} offset={offset} for {self.num_prompts} prompts")
        self.epoch, self.offset, self.seed = epoch, offset, int(d["seed"])
        self.shuffle = bool(d.get("shuffle", self.shuffle))
        self._perm = None


def load_pairs(path: str, prompt_key: str = "prompt", response_key: str = "response",
               storage_options: dict | None = None, max_image_pixels: int = DEFAULT_MAX_PIXELS) -> list[dict]:
    """SFT rows as {"prompt", "response"} (+ "messages" for chat prompts, "images" for a vision-language row's
    images' bytes); TRL's prompt-completion and `messages` rows too. Raises DataError naming the file, row and key."""
    out = []
    rows = load_prompts(path, prompt_key, response_key, storage_options, max_image_pixels)
    for i, row in enumerate(rows, start=1):
        if not isinstance(row["label"], str):
            raise DataError(f'{path}: row {i}: "{response_key}" must be a string, got {type(row["label"]).__name__}')
        out.append({"prompt": row["prompt"], "response": row["label"]}
                   | ({"messages": row["messages"]} if "messages" in row else {})
                   | ({"images": row["images"]} if row.get("images") else {}))
    return out
