"""deployments/mul-tool.yaml learns on CPU: two-digit multiplication through a python tool run in the sandbox,
multi-turn, token in / token out, through the environment protocol. The recipe's two phases as its comment runs
them with the CLI, here in the bare loop: SFT on tool transcripts, its weights saved as a Hugging Face folder, then
GRPO from them through the environment.

Measured (2 cores, 2026-11-29, 6.7 min in all): held-out reward (64 prompts, greedy) 0.031 before any update ->
0.680 after a short SFT (50 steps) -> 0.79, 0.81, 0.90, 0.90, 0.91, 0.92, 0.95, 0.94 every 10 GRPO steps through
the environment (training reward 0.33 -> 0.84): GRPO carries it over 0.9.
"""

from __future__ import annotations

import pytest

from rlflow.engines.core.config import load_recipe
from tests.learning import in_tmp, sft_then_grpo

pytestmark = pytest.mark.slow  # ~7 min on 2 cores; the default suite's twin: tests/test_env.py's tool loop


def test_mul_tool_recipe_learns_to_use_the_python_tool(tmp_path):
    cfg = in_tmp(load_recipe("deployments/mul-tool.yaml"), tmp_path, "train.jsonl", "eval.jsonl", "sft.jsonl")
    run = sft_then_grpo(cfg, tmp_path, inspect=lambda session: session.env.stats()[0])
    stats = run.extra
    print(f"held-out reward {run.before:.3f} -> {run.after_sft:.3f} (SFT) -> {run.evals} (GRPO); training reward "
          f"{run.rewards}; {run.minutes:.1f} min; env {stats}")
    assert run.before <= 0.2
    assert run.after_sft <= 0.75  # the SFT is short: what crosses 0.9 is the RL through the environment
    assert run.evals[-1] >= 0.9
    assert stats["errors"] == 0 and stats["sandbox_peak"] >= 1
    assert run.minutes < 10
