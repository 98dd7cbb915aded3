"""Run several variants of a recipe through the bare loop at once and tabulate their held-out reward.

    python -m bench.cpu.sweep deployments/sort-tiny.yaml --parallel 4 \\
        --variant base= --variant lr2e-3=train.lr=2e-3 --variant big=model.hidden_size=192,train.lr=5e-4

A variant is NAME=OVERRIDES with comma-separated `--set` overrides (empty for the recipe as is).
`--seeds 0,1` runs every variant under each seed. Each run is its own process with the recipe's
`train.threads` torch threads, so `--parallel` x threads should not exceed the cores. Prints one table
row per run (eval reward at every eval step, final train reward, seconds) and writes `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import harness

ROOT = Path(__file__).resolve().parents[2]
BARE_LOOP = "bench.e2e.bare_loop"  # run as a child: its stdout is one JSON line per step


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_variant(recipe: str, name: str, overrides: list[str], seed: int, workdir: str) -> dict:
    """One bare-loop run in a subprocess; its JSON lines are the per-step metrics."""
    sets = [a for o in overrides for a in ("--set", o)] + ["--set", f"seed={seed}"]
    env = _env() | {"OMP_WAIT_POLICY": "PASSIVE"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", BARE_LOOP, recipe, *sets],
                          cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    steps = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        return {"name": name, "seed": seed, "error": proc.stderr[-2000:], "seconds": seconds}
    evals = {m["step"] + 1: m["eval/reward_mean"] for m in steps if "eval/reward_mean" in m}
    return {"name": name, "seed": seed, "overrides": overrides, "seconds": round(seconds, 1),
            "eval": evals, "train_reward_last10": sum(m["rollout/reward_mean"] for m in steps[-10:]) / len(steps[-10:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--variant", action="append", required=True, help="NAME=k=v,k=v")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()
    recipe = str(Path(args.recipe).resolve())
    jobs = []
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        jobs += [(name, [o for o in rest.split(",") if o], int(s)) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        # the recipe's relative data paths resolve in each run's cwd: write the data once, before the runs
        subprocess.run([sys.executable, "-c", "import sys; from rlflow.engines.core.config import load_recipe; "
                        "from rlflow.engines.session.workers import prepare_data; "
                        "prepare_data(load_recipe(sys.argv[1]))", recipe],
                       cwd=tmp, env=_env(), check=True)
        futures = [pool.submit(run_variant, recipe, n, o, s, tmp) for n, o, s in jobs]
        results = []
        for f in futures:
            r = f.result()
            results.append(r)
            evals = " ".join(f"{k}:{v:.3f}" for k, v in r.get("eval", {}).items())
            print(f"{r['name']:<24} seed {r['seed']}  {r['seconds']:>6.0f}s  "
                  f"{r.get('error', '').splitlines()[-1:] or ''} {evals}", flush=True)
    if args.json:
        harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
