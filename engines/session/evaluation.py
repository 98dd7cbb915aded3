"""Evaluation metrics of a model on held-out prompts: accuracy, mean reward, pass@k, response length.

`score` turns rewards of n samples per prompt into metrics (the training loop's eval stage and the
evaluate flow both use it); `evaluate_dataset` generates with the embedded rollout engine and scores
with the recipe's reward function: nothing here generates or verifies on its own.
"""

from __future__ import annotations

from math import comb

import numpy as np

from rlflow.engines.core.config import EvalDatasetConfig, EvalSamplingConfig
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.data.prompts import load_prompts
from rlflow.engines.data.rewards import RewardFn, compute_rewards
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


def evaluate_dataset(engine: TorchRolloutBackend, reward_fn: RewardFn, reward_kwargs: dict,
                     dataset: EvalDatasetConfig, cfg: EvalSamplingConfig, max_new_tokens: int
                     ) -> tuple[dict[str, float], list[dict]]:
    """Generate n responses per prompt of `dataset`, reward them, and score; also a few sample rows."""
    rows = load_prompts(dataset.path, dataset.prompt_key, dataset.label_key)[: cfg.max_prompts]
    n = cfg.samples_per_prompt
    tok = engine.tokenizer
    prompt_ids = [ids for r in rows for ids in [tok(r["prompt"])["input_ids"]] * n]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p)
    gen = engine.generate_packed(prompt_ids, params, seed=cfg.seed)
    responses = tok.batch_decode(split_packed(gen, "output_ids"), skip_special_tokens=True)
    prompts = [r["prompt"] for r in rows for _ in range(n)]
    labels = [r["label"] for r in rows for _ in range(n)]
    rewards = compute_rewards(reward_fn, prompts, responses, labels, reward_kwargs)
    metrics = score(rewards, gen["lengths"], n, cfg.pass_k)
    samples = [
        {"dataset": dataset.key, "prompt": prompts[i], "response": responses[i], "label": str(labels[i]),
         "reward": float(rewards[i])}
        for i in range(0, min(len(prompts), cfg.samples_logged * n), n)
    ]
    return metrics, samples
