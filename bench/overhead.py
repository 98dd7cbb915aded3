"""Orchestration overhead: the same recipe through the full stack (Prefect flow + Ray actors + MLflow)
and as a bare loop over the same engine classes in one process, side by side in one run.

    python bench/overhead.py deployments/sort-tiny.yaml --steps 30 [--json out.json]

Step time is wall time between consecutive step ends (everything between them counts: tasks, actor
calls, metric logging). The first `--warmup` steps of each are dropped. Prints `ratio: X` (full / bare).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from bench.bare_loop import run_bare  # noqa: E402
from engines.config import load_recipe  # noqa: E402

STAGES = ("rollout", "reward", "advantages", "train", "sync")


def _step_times(ends: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :], strict=False)]


def _stage_medians(history: list[dict], warmup: int) -> dict[str, float]:
    """Median seconds per stage (medians: a 2-core machine has outliers), plus the train step's time
    inside the worker, so the train row splits into compute and the cost of reaching the worker."""
    rows = history[warmup + 1 :]
    out = {s: statistics.median(r[f"time/{s}"] for r in rows) for s in STAGES}
    out["train (in worker)"] = statistics.median(r["time/train_worker"] for r in rows)
    return out


def run_full(cfg) -> tuple[list[dict], list[float]]:
    from flows.post_train import post_train
    from tasks.run_context import STEP_LISTENERS

    history, ends = [], []

    def listen(step, m):
        ends.append(time.perf_counter())
        history.append(m)

    STEP_LISTENERS.append(listen)
    try:
        post_train(cfg)
    finally:
        STEP_LISTENERS.remove(listen)
    return history, ends


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"train.steps={args.steps}", "eval.every=0", "checkpoint.every=0",
                     f"storage.uri={tmp}/runs", f"tracking.uri=sqlite:///{tmp}/mlflow.db", *args.overrides]
        cfg = load_recipe(args.recipe, overrides)
        bare_ends: list[float] = []
        t0 = time.perf_counter()
        bare_hist = run_bare(cfg, tmp, log=lambda line: bare_ends.append(time.perf_counter()))
        bare_total = time.perf_counter() - t0
        t0 = time.perf_counter()
        full_hist, full_ends = run_full(cfg)
        full_total = time.perf_counter() - t0

    last = args.steps - 1  # drop the final step: the full stack writes its closing checkpoint there
    bare = _step_times(bare_ends[:last], args.warmup)
    full = _step_times(full_ends[:last], args.warmup)
    result = {
        "recipe": args.recipe,
        "steps": args.steps,
        "bare_step_s": statistics.median(bare),
        "full_step_s": statistics.median(full),
        "ratio": statistics.median(full) / statistics.median(bare),
        "bare_total_s": bare_total,
        "full_total_s": full_total,
        "bare_stages_s": _stage_medians(bare_hist, args.warmup),
        "full_stages_s": _stage_medians(full_hist, args.warmup),
        "bare_final_reward": bare_hist[-1]["rollout/reward_mean"],
        "full_final_reward": full_hist[-1]["rollout/reward_mean"],
    }
    print(f"{'stage (median)':<20}{'bare s':>10}{'full s':>10}")
    for s in result["bare_stages_s"]:
        print(f"{s:<20}{result['bare_stages_s'][s]:>10.4f}{result['full_stages_s'][s]:>10.4f}")
    print(f"{'step':<20}{result['bare_step_s']:>10.4f}{result['full_step_s']:>10.4f}")
    print(f"start-up + {args.steps} steps: bare {bare_total:.1f}s, full {full_total:.1f}s")
    print(f"ratio: {result['ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
