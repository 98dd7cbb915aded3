"""Prompt files (.jsonl or .parquet) and a resumable, deterministic walk over them in batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file and what was expected."""


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    rows = []
    offset = 0  # of the line in the file, in bytes: where a bad byte is, for a hex editor or `dd`
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {lineno} is not UTF-8: byte {raw[e.start]:#04x} at offset "
                                f"{offset + e.start} of the file ({e.reason}); data files must be UTF-8 "
                                "(convert with e.g. `iconv -f latin1 -t utf-8`)") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: bad JSON on line {lineno}: {e.msg} (column {e.colno})") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    try:
        table = pq.read_table(str(path))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file: {e}") from None
    return [(i, row) for i, row in enumerate(table.to_pylist(), start=1)]


def _row(path: Path, where: str, obj: Any, prompt_key: str, label_key: str) -> dict:
    if not isinstance(obj, dict):
        raise DataError(f"{path}: {where}: expected a JSON object, got {type(obj).__name__}")
    for key in (prompt_key, label_key):
        if key not in obj:
            present = ", ".join(f'"{k}"' for k in obj) or "none"
            raise DataError(f'{path}: missing key "{key}" in {where}; keys present: {present}')
    prompt = obj[prompt_key]
    if not isinstance(prompt, str):
        raise DataError(f'{path}: {where}: "{prompt_key}" must be a string, got {type(prompt).__name__}')
    meta = {k: v for k, v in obj.items() if k not in (prompt_key, label_key)}
    return {"prompt": prompt, "label": obj[label_key], "meta": meta}


def load_prompts(path: str, prompt_key: str = "prompt", label_key: str = "label") -> list[dict]:
    """Rows as {"prompt", "label", "meta"}; "meta" holds the other columns. Raises DataError naming file and row."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file not found: {path}")
    if p.suffix == ".jsonl":
        raw, unit = _read_jsonl(p), "line"
    elif p.suffix == ".parquet":
        raw, unit = _read_parquet(p), None
    else:
        raise DataError(f"{path}: unknown extension {p.suffix!r}; expected .jsonl or .parquet")
    if not raw:
        raise DataError(f"{path}: data file is empty, expected at least one row")
    out = []
    for row_no, (pos, obj) in enumerate(raw, start=1):
        where = f"row {row_no}" + (f" (line {pos})" if unit else "")
        out.append(_row(p, where, obj, prompt_key, label_key))
    return out


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


def load_pairs(path: str, prompt_key: str = "prompt", response_key: str = "response") -> list[dict]:
    """SFT rows as {"prompt", "response"} (both strings). Raises DataError naming the file, row and key."""
    out = []
    for i, row in enumerate(load_prompts(path, prompt_key, response_key), start=1):
        if not isinstance(row["label"], str):
            raise DataError(f'{path}: row {i}: "{response_key}" must be a string, got {type(row["label"]).__name__}')
        out.append({"prompt": row["prompt"], "response": row["label"]})
    return out
