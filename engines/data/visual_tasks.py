"""A built-in visual task with exactly checkable answers: count the red squares in a picture drawn with PIL.

The multimodal CPU demo (deployments/vl-count-tiny.yaml, docs/multimodal.md) trains a tiny Qwen2-VL on it. A picture
is 112 x 112 pixels, a 4 x 4 grid of 28-pixel cells: exactly the tiny model's merged vision tokens (14-pixel
patches merged 2 x 2), so a square lies in one token. Between 0 and `max_count` cells hold a red square and up to
three others a blue one (a distractor: the colour matters, not the shape); sizes and offsets vary inside a cell.
Rows are verl's multimodal form: the prompt a chat message with an `<image>` marker, the picture's PNG bytes in
`images`, the count as the label.
"""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw

SIZE, CELLS = 112, 4
CELL = SIZE // CELLS
RED, BLUE, WHITE = (220, 30, 30), (30, 60, 220), (255, 255, 255)
PROMPT = "<image>="  # the character tokenizer's vocabulary: the image, then "=" asks for the answer
MAX_DISTRACTORS = 3


def _square(draw: ImageDraw.ImageDraw, cell: int, colour: tuple[int, int, int], rng: random.Random) -> None:
    side = rng.randint(14, 24)
    x0 = (cell % CELLS) * CELL + rng.randint(0, CELL - side)
    y0 = (cell // CELLS) * CELL + rng.randint(0, CELL - side)
    draw.rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=colour)


def draw_picture(red: int, rng: random.Random) -> bytes:
    """PNG bytes of a picture with `red` red squares and 0-3 blue ones, each in its own cell."""
    cells = rng.sample(range(CELLS * CELLS), red + rng.randint(0, MAX_DISTRACTORS))
    image = Image.new("RGB", (SIZE, SIZE), WHITE)
    draw = ImageDraw.Draw(image)
    for i, cell in enumerate(cells):
        _square(draw, cell, RED if i < red else BLUE, rng)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def count_example(max_count: int, rng: random.Random) -> dict:
    """One row: a picture with a uniformly drawn number of red squares (0..max_count), asked for that number."""
    if not 1 <= max_count <= 9:
        raise ValueError(f"data.generate.num_digits: the count task's largest count must be 1-9, got {max_count}")
    red = rng.randint(0, max_count)
    picture = {"bytes": draw_picture(red, rng), "path": None}  # HF datasets' Image feature's fields
    return {"prompt": [{"role": "user", "content": PROMPT}], "images": [picture], "label": str(red)}


def picture_key(row: dict) -> bytes:
    """What makes two rows the same prompt (the held-out split never shares one with train): the picture."""
    return row["images"][0]["bytes"]
