"""Data rows -> the rollout function's prompts: encoded, checked against the context, seeded; and the sampling
parameters and seeds a step generates with. The rollout stage, dynamic sampling and evaluation all go through it.
"""

from __future__ import annotations

from rlflow.engines.data.prompts import DataError
from rlflow.engines.models.hf import encode_prompt, prompt_input
from rlflow.engines.rollout.functions import PromptSample
from rlflow.engines.session.run_engines import RunEngines


def prompt_samples(s: RunEngines, rows: list[dict], n: int, seed: int) -> list[PromptSample]:
    """One PromptSample per row, asking for n samples; sample j of prompt i draws seed + i * n + j. A prompt that
    leaves no room for a response in the rollout context is refused, naming its data row."""
    samples = [PromptSample(index=i, prompt=r["prompt"], label=r["label"], prompt_ids=encode(s, prompt_input(r)),
                            n=n, seed=seed + i * n, row=r, tokenizer=s.fn_tokenizer,
                            record_routing=s.cfg.algorithm.routing_replay == "r3")
               for i, r in enumerate(rows)]
    for p in samples:
        if len(p.prompt_ids) >= s.context_len:
            raise DataError(f"{data_row(s, p.row)}: the prompt is {len(p.prompt_ids)} tokens; a rollout "
                            f"sequence holds {s.context_len} ({s.context_source}), the response "
                            "included: shorten or drop the prompt, or use a model with a longer context")
    return samples


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
