"""deployments/mul-tool.yaml learns on CPU: two-digit multiplication through a python tool run in the sandbox,
multi-turn, token in / token out, through the environment protocol. The recipe's two phases as its comment runs
them with the CLI, here in the bare loop: SFT on tool transcripts, its weights saved as a Hugging Face folder, then
GRPO from them through the environment.

Measured (2 cores, 2026-11-29, 2.6 min in all): held-out reward (64 prompts, greedy) 0.031 before any update ->
0.965 after SFT (100 steps, ~20 s) -> 0.904, 0.926, 0.926, 0.966 at GRPO steps 5, 10, 15, 20. The rise is SFT's:
GRPO through the environment holds it (what GRPO does from a weaker SFT: docs/agents.md).
"""

from __future__ import annotations

import time

import pytest

from rlflow.engines.core.config import load_recipe
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.sft import SFTSession
from rlflow.engines.session.workers import prepare_data, prepare_model

pytestmark = pytest.mark.slow  # ~3 min on 2 cores; the default suite's twin: tests/test_env.py's tool loop


def test_mul_tool_recipe_learns_to_use_the_python_tool(tmp_path):
    cfg = load_recipe("deployments/mul-tool.yaml")
    data = tmp_path / "data"
    cfg = cfg.model_copy(update={
        "data": cfg.data.model_copy(update={"train_path": str(data / "train.jsonl"),
                                            "eval_path": str(data / "eval.jsonl")}),
        "sft": cfg.sft.model_copy(update={"train_path": str(data / "sft.jsonl")}),
        "tracking": cfg.tracking.model_copy(update={"uri": f"sqlite:///{tmp_path}/mlflow.db"}),
        "storage": cfg.storage.model_copy(update={"uri": str(tmp_path / "runs")}),
    })
    prepare_data(cfg)
    t0 = time.monotonic()
    sft = SFTSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    try:
        before = sft.rl.evaluate(0)[0]["eval/reward_mean"]
        for step in range(cfg.sft.steps):
            sft.train(step)
            sft.sync_weights(step)
        after_sft = sft.rl.evaluate(cfg.sft.steps)[0]["eval/reward_mean"]
        sft.save(str(tmp_path / "sft"), cfg.sft.steps)
    finally:
        sft.shutdown()
    session = RLSession.create(cfg, str(tmp_path / "sft" / "model"), use_ray=False)
    rewards, evals = [], []
    try:
        for step in range(cfg.train.steps):
            session.rollout(step)
            rewards.append(session.reward(step)["rollout/reward_mean"])
            session.advantages(step)
            session.train(step)
            session.sync_weights(step)
            if (step + 1) % cfg.eval.every == 0:
                evals.append(session.evaluate(step)[0]["eval/reward_mean"])
        stats = session.env.stats()[0]
    finally:
        session.shutdown()
    minutes = (time.monotonic() - t0) / 60
    print(f"held-out reward {before:.3f} -> {after_sft:.3f} (SFT) -> {evals} (GRPO); training reward {rewards}; "
          f"{minutes:.1f} min; env {stats}")
    assert before <= 0.2
    assert evals[-1] >= 0.9
    assert stats["errors"] == 0 and stats["sandbox_peak"] >= 1
    assert minutes < 10
