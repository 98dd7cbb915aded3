"""Evaluation metrics of a model on held-out prompts: accuracy, mean reward, pass@k, response length.

`score` turns rewards of n samples per prompt into metrics (the training loop's eval stage and the
evaluate flow both use it). For the evaluate flow, `generate_and_reward` generates one shard of a dataset's
prompts with the embedded rollout engine and rewards it with the recipe's reward function, returning plain
lists; `merge_and_score` joins a dataset's shards and scores them once. Nothing here generates or verifies on
its own, and nothing here knows where a shard runs.
"""

from __future__ import annotations

from math import comb

import numpy as np

from rlflow.engines.core.config import EvalDatasetConfig, EvalSamplingConfig
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.data.prompts import load_prompts
from rlflow.engines.data.rewards import RewardFn, compute_rewards
from rlflow.engines.models.hf import decode_responses, encode_prompt, prompt_input
from rlflow.engines.models.vision_language import VisionProcessor, encode_row, is_vision_language
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend, split_packed

CORRECT = 1.0  # a sample is correct when its reward reaches this (the built-in rewards give 1.0 for a match)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c correct among n samples: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def score(rewards: list[float], lengths: list[int] | np.ndarray, n: int, ks: list[int] = ()) -> dict[str, float]:
    """Metrics of `len(rewards) // n` prompts with n samples each (prompt-major order)."""
    r = np.asarray(rewards, dtype=np.float64)
    if len(r) == 0 or len(r) % n:
        raise ValueError(f"score: {len(r)} rewards are not a whole number of groups of {n}")
    correct = (r >= CORRECT).reshape(-1, n).sum(axis=1)
    out = {
        "reward_mean": float(r.mean()),
        "accuracy": float((r >= CORRECT).mean()),
        "response_len_mean": float(np.mean(lengths)),
        "num_prompts": float(len(correct)),
    }
    for k in ks:
        out[f"pass_at_{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
    return out


def eval_rows(dataset: EvalDatasetConfig, cfg: EvalSamplingConfig, storage_options: dict | None = None) -> list[dict]:
    """The prompts of `dataset` that are evaluated (the first `max_prompts`), with their labels."""
    return load_prompts(dataset.path, dataset.prompt_key, dataset.label_key, storage_options)[: cfg.max_prompts]


def shard_bounds(num_prompts: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) prompt ranges of near-equal size, at most `shards`, none empty (unless there are
    no prompts): every prompt's n samples stay in one shard, so merged shards keep the unsharded prompt-major order."""
    shards = max(1, min(shards, num_prompts))
    edges = [num_prompts * i // shards for i in range(shards + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def generate_and_reward(engine: TorchRolloutBackend, reward_fn: RewardFn, reward_kwargs: dict, dataset_key: str,
                        rows: list[dict], first_prompt: int, cfg: EvalSamplingConfig, max_new_tokens: int) -> dict:
    """Generate n responses for each of `rows` (prompts first_prompt, first_prompt + 1, ... of the dataset) and
    reward them: {"rewards", "lengths", "samples"}, plain lists, prompt-major, for `merge_and_score`.

    Sample j of prompt p draws from the engine's generator (cfg.seed, p * n + j) wherever it runs, and a sample's
    tokens do not depend on its batch-mates, so shards merged give the tokens of one unsharded call at any
    temperature (up to float rounding between batch shapes, which the engine's tests hold to 1e-5 in logprobs;
    a sample could differ only where two tokens tie to that precision).

    Prompts are rendered by models.hf.encode_prompt, the function the RL loop renders them with, with the chat
    template or not as `cfg.chat_template` says (the evaluate flow resolves an empty value before this)."""
    n = cfg.samples_per_prompt
    tok = engine.tokenizer
    vision = _vision_processor(engine, rows, dataset_key)
    prompt_ids, images = [], []
    for i, r in enumerate(rows, start=first_prompt + 1):
        pictures = r.get("images") or []
        ids = (encode_row(vision, r, pictures, f"evaluation dataset {dataset_key}: row {i}") if pictures
               else encode_prompt(tok, prompt_input(r), bool(cfg.chat_template)))
        prompt_ids += [ids] * n
        images += [list(pictures)] * n
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p)
    gen = engine.generate_packed(prompt_ids, params, seed=cfg.seed, first_index=first_prompt * n,
                                 image_data=images if vision is not None else None)
    responses = decode_responses(tok, split_packed(gen, "output_ids"), gen["stopped"])  # as the training reward
    prompts = [r["prompt"] for r in rows for _ in range(n)]
    labels = [r["label"] for r in rows for _ in range(n)]
    metas = [r.get("meta", {}) for r in rows for _ in range(n)]
    rewards = compute_rewards(reward_fn, prompts, responses, labels, reward_kwargs, metas)
    logged = range(max(0, min(len(rows), cfg.samples_logged - first_prompt)))  # the dataset's first samples_logged
    samples = [
        {"dataset": dataset_key, "prompt": prompts[i * n], "response": responses[i * n], "label": str(labels[i * n]),
         "reward": float(rewards[i * n])}
        for i in logged
    ]
    return {"rewards": [float(r) for r in rewards], "lengths": [int(x) for x in gen["lengths"]], "samples": samples}


def _vision_processor(engine: TorchRolloutBackend, rows: list[dict], dataset_key: str) -> VisionProcessor | None:
    """The model's processor when the shard's rows have images (None for text rows); a named error when the model
    is text-only (encoded as text, the images would be dropped without a word)."""
    if not any(r.get("images") for r in rows):
        return None
    if not is_vision_language(engine.model_path):
        raise ValueError(f"evaluation dataset {dataset_key}: its rows have images, and the model at "
                         f"{engine.model_path} is not a vision-language model (Qwen2-VL or Qwen2.5-VL)")
    return VisionProcessor(engine.model_path, engine.tokenizer)


def merge_and_score(parts: list[dict], cfg: EvalSamplingConfig) -> tuple[dict[str, float], list[dict]]:
    """Metrics and sample rows of a dataset from its shards' results, in prompt order. Scored once on all samples:
    pass@k and means are not averages of per-shard metrics, so they equal an unsharded evaluation's."""
    rewards = [r for p in parts for r in p["rewards"]]
    lengths = [x for p in parts for x in p["lengths"]]
    return score(rewards, lengths, cfg.samples_per_prompt, cfg.pass_k), [s for p in parts for s in p["samples"]]

