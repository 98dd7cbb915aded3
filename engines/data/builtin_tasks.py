"""Built-in verifiable tasks (sort, reverse, add), small enough for a tiny character-level model on CPU.

Prompts use only the characters "0123456789+=SR", the whole vocabulary of the built-in tokenizer; mul's prompts also
"*" (model.extra_chars: "*"), and it is solved with a python tool (engines/env/python_tool.py); count's are a
picture and "=" (engines/data/visual_tasks.py: count the red squares; a vision-language model, parquet files).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlflow.engines.core.config import BuiltinTaskConfig
from rlflow.engines.data.visual_tasks import count_example, picture_key

TASKS = ("sort", "reverse", "add", "mul", "count")


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def _example(task: str, num_digits: int, rng: random.Random) -> dict:
    if task == "sort":
        d = _digits(rng, num_digits)
        return {"prompt": f"S{d}=", "label": "".join(sorted(d))}
    if task == "reverse":
        d = _digits(rng, num_digits)
        return {"prompt": f"R{d}=", "label": d[::-1]}
    if task == "add":
        a, b = rng.randrange(10**num_digits), rng.randrange(10**num_digits)
        return {"prompt": f"{a}+{b}=", "label": str(a + b)}
    if task == "mul":  # numbers of exactly num_digits digits
        low = 10 ** (num_digits - 1) if num_digits > 1 else 0
        a, b = rng.randrange(low, 10**num_digits), rng.randrange(low, 10**num_digits)
        return {"prompt": f"{a}*{b}=", "label": str(a * b)}
    if task == "count":  # num_digits: the largest count of red squares
        return count_example(num_digits, rng)
    raise ValueError(f"unknown built-in task {task!r}; expected one of {', '.join(TASKS)}")


def _stream(task: str, num_digits: int, rng: random.Random) -> Iterator[dict]:
    if task not in TASKS:
        raise ValueError(f"unknown built-in task {task!r}; expected one of {', '.join(TASKS)}")
    if num_digits <= 0:
        raise ValueError(f"num_digits must be positive, got {num_digits}")
    while True:
        yield _example(task, num_digits, rng)


def num_distinct_prompts(task: str, num_digits: int) -> int:
    """Size of the prompt space, so split sizes that cannot be disjoint are refused rather than looping."""
    if task == "mul":
        return (10**num_digits - (10 ** (num_digits - 1) if num_digits > 1 else 0)) ** 2
    if task == "count":  # pictures: placements, sizes and offsets of the squares
        return 10**12
    return 10 ** (2 * num_digits) if task == "add" else 10**num_digits


def make_examples(task: str, num_digits: int, n: int, seed: int) -> list[dict]:
    """n random examples (repeats possible); the same arguments always give the same list."""
    stream = _stream(task, num_digits, random.Random(seed))
    return [next(stream) for _ in range(n)]


def split_examples(cfg: BuiltinTaskConfig) -> tuple[list[dict], list[dict]]:
    """(train, eval): eval holds num_eval distinct prompts, and train never repeats one of them."""
    space = num_distinct_prompts(cfg.task, cfg.num_digits)
    if cfg.num_eval > space // 2:
        raise ValueError(
            f"data.generate: num_eval={cfg.num_eval} is more than half of the {space} distinct {cfg.task} prompts "
            f"with num_digits={cfg.num_digits}, leaving too few for a disjoint train split; lower num_eval or raise "
            "num_digits"
        )
    key = picture_key if cfg.task == "count" else (lambda ex: ex["prompt"])
    held_out: dict[str | bytes, dict] = {}
    for ex in _stream(cfg.task, cfg.num_digits, random.Random(f"{cfg.seed}/eval")):
        held_out.setdefault(key(ex), ex)
        if len(held_out) == cfg.num_eval:
            break
    train: list[dict] = []
    for ex in _stream(cfg.task, cfg.num_digits, random.Random(f"{cfg.seed}/train")):
        if len(train) == cfg.num_train:
            break
        if key(ex) not in held_out:
            train.append(ex)
    return train, list(held_out.values())


def _write_rows(rows: list[dict], path: Path) -> None:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), str(path))
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
            f.flush()
            os.fsync(f.fileno())


def write_rows_atomic(rows: list[dict], path: str) -> None:
    """Write JSONL (or parquet by extension) via a temp file and os.replace, so a crash never leaves half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=f".tmp{target.suffix}")
    os.close(fd)
    try:
        _write_rows(rows, Path(tmp))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_task_files(
    cfg: BuiltinTaskConfig, train_path: str | None, eval_path: str | None, sft_path: str | None = None
) -> None:
    """Write disjoint train and held-out eval splits; train is the same whether or not eval_path is given.

    sft_path gets the train split as SFT pairs: each prompt with its correct answer as "response" (sft_pairs)."""
    paths = [Path(p).resolve() for p in (train_path, eval_path, sft_path) if p is not None]
    if cfg.task == "count" and any(p.suffix != ".parquet" for p in paths):
        raise ValueError(f"data.generate: task count writes its pictures as bytes in parquet rows; name .parquet "
                         f"files, got {', '.join(str(p) for p in paths)}")
    if len(set(paths)) < len(paths):
        raise ValueError(f"data: the train, eval and SFT files must differ: {train_path}, {eval_path}, {sft_path}")
    train, held_out = split_examples(cfg)
    if eval_path is not None:
        write_rows_atomic(held_out, eval_path)
    if train_path is not None:
        write_rows_atomic(train, train_path)
    if sft_path is not None:
        write_rows_atomic([pair for r in train for pair in sft_pairs(cfg.task, r)], sft_path)


def sft_pairs(task: str, row: dict) -> list[dict]:
    """The demonstrations SFT trains on: the prompt and its answer; for mul, each model turn of the tool transcript
    of engines/env/python_tool.py with the conversation before it as its prompt ("37*12=" -> "37*12=", the tool
    call; "37*12=37*12=444R" -> "444"), so the tool's output is context, never a target, as in RL's loss mask.
    (The EOS SFT adds after a tool call is never sampled: "=" stops the turn.)"""
    prompt, label = row["prompt"], row["label"]
    if task == "count":
        return [{"prompt": prompt, "response": label, "images": row["images"]}]
    if task == "mul":
        return [{"prompt": prompt, "response": prompt}, {"prompt": f"{prompt}{prompt}{label}R", "response": label}]
    return [{"prompt": prompt, "response": label}]
