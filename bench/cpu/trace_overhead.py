"""What the trace timeline costs: the bare loop with debug.trace_every 0 (off) and 1 (every step),
side by side in one run, on the same recipe and seeds.

    python -m bench.cpu.trace_overhead deployments/sort-tiny.yaml --steps 8 --repeats 2

Step time is wall time between consecutive step ends, so it includes recording (rollout workers and
stage spans) and collecting each step's trace (draining the workers, merging, writing the JSON). The
first `--warmup` steps of each run are dropped. Prints the median step with tracing over the median
without (`ratio`), the mean trace size and event count per step, and the median time spent collecting
(draining, merging) and writing one step's trace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.e2e.bare_loop import run_bare
from rlflow.engines.core.config import load_recipe


def _run(recipe: str, overrides: list[str], every: int, workdir: Path, warmup: int) -> tuple[list[float], list[float]]:
    """Step times, and the time each step spent collecting and writing its trace."""
    cfg = load_recipe(recipe, [*overrides, f"debug.trace_every={every}"])
    ends: list[float] = []
    hist = run_bare(cfg, str(workdir), log=lambda line: ends.append(time.perf_counter()),
                    trace_dir=str(workdir / "traces") if every else None)
    steps = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :], strict=False)]
    return steps, [m["time/trace"] for m in hist[warmup + 1 :] if "time/trace" in m]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args()
    overrides = [*args.overrides, f"train.steps={args.steps}", "cluster.use_ray=false", "eval.every=0"]
    times: dict[int, list[float]] = {0: [], 1: []}
    sizes, events, collect = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        base = [*overrides, f"data.train_path={tmp}/data/train.jsonl", f"data.eval_path={tmp}/data/eval.jsonl"]
        for r in range(args.repeats):
            for every in (0, 1):
                work = Path(tmp) / f"r{r}-every{every}"
                steps, trace_s = _run(args.recipe, base, every, work, args.warmup)
                times[every] += steps
                collect += trace_s
                for f in sorted((work / "traces").glob("*.json")) if every else []:
                    sizes.append(f.stat().st_size)
                    events.append(len(json.loads(f.read_text())["traceEvents"]))
    off, on = statistics.median(times[0]), statistics.median(times[1])
    print(f"step, trace off: {off:.3f} s   trace every step: {on:.3f} s   ratio: {on / off:.3f}")
    print(f"trace per step: {statistics.mean(sizes) / 1e3:.0f} KB, {statistics.mean(events):.0f} events, "
          f"collected and written in {statistics.median(collect) * 1e3:.1f} ms (median)")


if __name__ == "__main__":
    main()
