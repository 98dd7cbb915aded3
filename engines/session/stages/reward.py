"""The reward stage: every sample's response text and reward (the recipe's reward.fn or reward.sources, for the
samples whose rollout function did not score them), and the step's reward metrics. Dynamic sampling and
evaluation score through the same two helpers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlflow.engines.models.hf import decode_responses
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.session.stages.healing import replace_dead_reward_workers
from rlflow.engines.session.step_state import StepState


def run(s: RunEngines, st: StepState) -> dict[str, float]:
    healed = replace_dead_reward_workers(s)
    b = st.batch
    responses = response_texts(s, b.split("output_ids"), b.text, b.stopped)
    metas = [st.rows[g].get("meta", {}) for g in b.group]  # the rows' other columns, for the reward
    st.batch = b.with_rewards(responses, fill_rewards(s, b.prompt, responses, b.label, b.fn_reward, metas))
    all_rewards = torch.tensor(st.batch.reward, dtype=torch.float32)
    rewards = all_rewards[torch.as_tensor(~b.baseline)]  # ReMax's greedy baselines are not the policy's samples
    metrics = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "rollout/accuracy": float((rewards >= 1.0).float().mean()),
    }
    if b.baseline.any():
        metrics["rollout/greedy_reward_mean"] = float(all_rewards[torch.as_tensor(b.baseline)].mean())
    return metrics | s.rewards.take_metrics() | healed


def response_texts(s: RunEngines, output_ids: list, texts: list[str | None], stopped: Sequence[bool]) -> list[str]:
    """The text the reward sees: what the rollout function gave, else the response tokens decoded as a user of
    the model gets them (models.hf.decode_responses: special tokens visible but the final stop token)."""
    todo = [i for i, t in enumerate(texts) if t is None]
    if not todo:
        return list(texts)
    with s.tokenizer_lock:
        decoded = decode_responses(s.tokenizer, [output_ids[i] for i in todo], [bool(stopped[i]) for i in todo])
    out = list(texts)
    for i, text in zip(todo, decoded, strict=True):
        out[i] = text
    return out


def fill_rewards(s: RunEngines, prompts: list[str], responses: list[str], labels: list, given: np.ndarray,
                 metas: list[dict], record: bool = True) -> list[float]:
    """The recipe's reward for every sample whose rollout function did not score it (NaN in `given`); `metas`:
    each sample's row's other columns. `record`: the sources' figures count in the step's reward metrics."""
    todo = np.flatnonzero(np.isnan(given)).tolist()
    out = given.astype(float).tolist()
    if todo:
        scored = s.rewards.score([prompts[i] for i in todo], [responses[i] for i in todo],
                                 [labels[i] for i in todo], [metas[i] for i in todo], record=record)
        for i, r in zip(todo, scored, strict=True):
            out[i] = r
    return out
