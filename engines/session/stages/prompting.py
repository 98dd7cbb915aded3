"""Data rows -> the rollout function's prompts: encoded, checked against the context, seeded; and the sampling
parameters and seeds a step generates with. The rollout stage, dynamic sampling and evaluation all go through it.

A row with images (vision-language models, docs/multimodal.md) is encoded by the model's VisionProcessor, so its
prompt_ids hold one image pad token per merged patch; its images go to the run store once, by digest, and the
PromptSample carries the digests and the images as data URIs (what /generate's image_data takes).
"""

from __future__ import annotations

from rlflow.engines.data.prompts import DataError
from rlflow.engines.models.hf import encode_prompt, prompt_input
from rlflow.engines.models.vision_language import data_uri, encode_row
from rlflow.engines.rollout.functions import PromptSample
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.store.run_store import RunStore


def prompt_samples(s: RunEngines, rows: list[dict], n: int, seed: int) -> list[PromptSample]:
    """One PromptSample per row, asking for n samples; sample j of prompt i draws seed + i * n + j. A prompt that
    leaves no room for a response in the rollout context is refused, naming its data row."""
    samples = [_sample(s, i, r, n, seed) for i, r in enumerate(rows)]
    for p in samples:
        if len(p.prompt_ids) >= s.context_len:
            raise DataError(f"{data_row(s, p.row)}: the prompt is {len(p.prompt_ids)} tokens; a rollout "
                            f"sequence holds {s.context_len} ({s.context_source}), the response "
                            "included: shorten or drop the prompt, or use a model with a longer context")
    return samples


def _sample(s: RunEngines, i: int, r: dict, n: int, seed: int) -> PromptSample:
    images = r.get("images") or []
    if images and s.vision is None:
        raise DataError(f"{data_row(s, r)}: the row has {len(images)} image(s), but model.path {s.model_path} is "
                        "not a vision-language model (Qwen2-VL or Qwen2.5-VL): use one, or data without images")
    return PromptSample(index=i, prompt=r["prompt"], label=r["label"],
                        prompt_ids=encode_with_images(s, r, images) if images else encode(s, prompt_input(r)),
                        n=n, seed=seed + i * n, row=r, tokenizer=s.fn_tokenizer,
                        record_routing=s.cfg.algorithm.routing_replay == "r3",
                        images=[store_image(s, data) for data in images],
                        image_data=[data_uri(data) for data in images])


def encode_with_images(s: RunEngines, row: dict, images: list[bytes]) -> list[int]:
    """A row's prompt ids by the model's VisionProcessor: its messages (a plain prompt as one user message) with
    the images placed, each image's pad token repeated once per merged patch."""
    try:
        with s.tokenizer_lock:
            return encode_row(s.vision, row, images)
    except ValueError as e:
        raise DataError(f"{data_row(s, row)}: {e}") from None


def store_image(s: RunEngines, data: bytes) -> str:
    """The image's digest, its bytes in the run store (written once per run: the session remembers what it
    stored, so a prompt taken again costs no store round trip)."""
    digest = RunStore.image_digest(data)
    if digest not in s.stored_images:
        s.image_store.put_image(data)
        s.stored_images.add(digest)
    return digest


def encode(s: RunEngines, prompt: str | list[dict]) -> list[int]:
    with s.tokenizer_lock:
        return encode_prompt(s.tokenizer, prompt, s.cfg.data.chat_template)


def data_row(s: RunEngines, row: dict) -> str:
    """'<file>: row <n>' of a row this session loaded (the first equal one: searched only on the error path;
    rows are normalized anew each time they are read, so identity would not find it)."""
    for path, rows in ((s.cfg.data.train_path, s.prompts.rows), (s.cfg.data.eval_path, s.eval_rows)):
        pos = next((i for i, r in enumerate(rows or []) if r == row), None)
        if pos is not None:
            return f"{path}: row {pos + 1}"
    return f"{s.cfg.data.train_path}: a row carried over by dynamic sampling"


def sampling(s: RunEngines, temperature: float) -> dict:
    """SGLang sampling_params for a rollout function."""
    r = s.cfg.rollout
    return {"max_new_tokens": r.max_new_tokens, "temperature": temperature, "top_p": r.top_p,
            "top_k": r.top_k or -1, "stop": list(r.stop)}


def step_seed(s: RunEngines, step: int) -> int:
    """The first sampling seed of the step's prompts (greedy baselines and evaluation draw theirs apart from it)."""
    return s.cfg.seed * 1_000_003 + step * 7919
