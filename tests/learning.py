"""The two phases of a recipe that learns on CPU (SFT, then GRPO), in the bare loop: what the slow learning tests of
the tool-use and vision-language demos run, as their recipes' comments run them with the CLI."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlflow.engines.core.config import RLConfig
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.sft import SFTSession
from rlflow.engines.session.workers import prepare_data, prepare_model


@dataclass
class Learning:
    before: float  # held-out reward of the starting model
    after_sft: float
    evals: list[float] = field(default_factory=list)  # every eval.every GRPO steps
    rewards: list[float] = field(default_factory=list)  # each GRPO step's training reward
    minutes: float = 0.0
    extra: Any = None  # what `inspect` returned from the GRPO session before it shut down


def in_tmp(cfg: RLConfig, tmp_path: Path, train: str, eval_: str, sft: str) -> RLConfig:
    """The recipe with its data files (named train/eval/sft under tmp_path/data), store and tracking in tmp_path."""
    data = tmp_path / "data"
    return cfg.model_copy(update={
        "data": cfg.data.model_copy(update={"train_path": str(data / train), "eval_path": str(data / eval_)}),
        "sft": cfg.sft.model_copy(update={"train_path": str(data / sft)}),
        "tracking": cfg.tracking.model_copy(update={"uri": f"sqlite:///{tmp_path}/mlflow.db"}),
        "storage": cfg.storage.model_copy(update={"uri": str(tmp_path / "runs")}),
    })


def sft_then_grpo(cfg: RLConfig, tmp_path: Path, inspect: Callable[[RLSession], Any] | None = None) -> Learning:
    """SFT for cfg.sft.steps, its weights saved as a Hugging Face folder, then cfg.train.steps of GRPO from them."""
    prepare_data(cfg)
    t0 = time.monotonic()
    sft = SFTSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    try:
        before = sft.rl.evaluate(0)[0]["eval/reward_mean"]
        for step in range(cfg.sft.steps):
            sft.train(step)
            sft.sync_weights(step)
        out = Learning(before, sft.rl.evaluate(cfg.sft.steps)[0]["eval/reward_mean"])
        sft.save(str(tmp_path / "sft"), cfg.sft.steps)
    finally:
        sft.shutdown()
    session = RLSession.create(cfg, str(tmp_path / "sft" / "model"), use_ray=False)
    try:
        for step in range(cfg.train.steps):
            session.rollout(step)
            out.rewards.append(session.reward(step)["rollout/reward_mean"])
            session.advantages(step)
            session.train(step)
            session.sync_weights(step)
            if (step + 1) % cfg.eval.every == 0:
                out.evals.append(session.evaluate(step)[0]["eval/reward_mean"])
        out.extra = inspect(session) if inspect else None
    finally:
        session.shutdown()
    out.minutes = (time.monotonic() - t0) / 60
    return out
