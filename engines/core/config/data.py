"""data: the prompt files, how they are read, and the built-in tasks that can write them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlflow.engines.core.config.base import Section


class BuiltinTaskConfig(Section):
    task: Literal["sort", "reverse", "add", "mul", "count"] = Field(
        ..., description="Which built-in verifiable task to generate (mul: a tool task, with model.extra_chars '*'; "
        "count: pictures of red squares to count, for a vision-language model, parquet files, num_digits the "
        "largest count).")
    num_digits: int = Field(4, gt=0, le=12)
    num_train: int = Field(20000, gt=0)
    num_eval: int = Field(256, gt=0)
    seed: int = 1234


class DataConfig(Section):
    train_path: str = Field(
        ..., description="Prompt file for training: .jsonl, .json or .parquet; a path or an s3:// URL (reached with "
        "`storage`'s endpoint and credentials). Plain, verl and TRL rows (docs/data.md).")
    eval_path: str | None = Field(None, description="Held-out prompt file; empty disables eval.")
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    label_key: str = Field("label", description="Column holding what the reward checks against.")
    shuffle: bool = True
    seed: int = 0
    chat_template: bool = Field(
        False,
        description="Wrap each prompt as one user message in the tokenizer's chat template (with the generation "
        "prompt) before tokenizing; for instruct models. False: the prompt text is tokenized as it is.",
    )
    max_image_pixels: int = Field(
        4_000_000, gt=0, description="Largest image of a vision-language prompt, in pixels (width x height) as stored: "
        "a bigger one is refused, naming the file and row (the processor would resize it, but decoding it costs "
        "memory first).")
    generate: BuiltinTaskConfig | None = Field(
        None, description="Write a built-in task to train_path/eval_path first, if those files are missing."
    )
