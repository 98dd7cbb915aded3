"""The demo's CPU step time at several commits, to find the one that changed it.

    python -m bench.cpu.step_by_commit fddc5cc 0d73a8b HEAD --steps 8 --parallel 1 --out steps.json

Each commit is checked out in a temporary git worktree and runs that checkout's own bare loop (no Prefect, no Ray;
bench/e2e/bare_loop.py, bench/bare_loop.py before the bench reshuffle) on that checkout's deployments/sort-tiny.yaml,
with `rlflow.*` mapped onto the checkout's folders as the editable install maps them (older commits import their
top-level `engines` straight from the checkout): the checkout comes first on sys.path and its `rlflow` modules are
registered before anything imports, so an installed rlflow or a PYTHONPATH shim never stands in for it.
Reported per commit: the median time/train, time/rollout and time/step over the steps after the first (which pays
for warm-up). `--parallel` runs that many commits at once (each with OMP_NUM_THREADS=2): on a 2-core machine keep
it at 1; times are only comparable within one call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# run as `python -c BOOT <checkout> <module> args...`: the module of that checkout as __main__
BOOT = """
import importlib.util, os, runpy, sys, types
root, module = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
package = types.ModuleType("rlflow"); package.__path__ = []; sys.modules["rlflow"] = package
for name in ("engines", "tasks", "flows", "examples"):
    init = os.path.join(root, name, "__init__.py")
    if os.path.exists(init):
        spec = importlib.util.spec_from_file_location("rlflow." + name, init,
                                                      submodule_search_locations=[os.path.join(root, name)])
        sub = importlib.util.module_from_spec(spec); sys.modules[spec.name] = sub; spec.loader.exec_module(sub)
        setattr(package, name, sub)
os.chdir(root)
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def git(*args: str, cwd: str | Path = ".") -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def measure(repo: Path, commit: str, steps: int, workdir: Path, timeout_s: float) -> dict:
    sha = git("rev-parse", commit, cwd=repo)
    tree = workdir / sha[:12]
    git("worktree", "add", "--detach", "-f", str(tree), sha, cwd=repo)
    try:
        module = "bench.e2e.bare_loop" if (tree / "bench/e2e/bare_loop.py").exists() else "bench.bare_loop"
        env = os.environ | {"OMP_NUM_THREADS": "2", "RAY_USAGE_STATS_ENABLED": "0", "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run([sys.executable, "-c", BOOT, str(tree), module, "deployments/sort-tiny.yaml",
                               "--set", f"train.steps={steps}", "--set", "eval.every=1000"],
                              capture_output=True, text=True, env=env, timeout=timeout_s)
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{") and "time/train" in line]
        if done.returncode or len(rows) < 2:
            return {"commit": sha, "error": done.stderr[-2000:]}
        later = rows[1:]
        return {"commit": sha, "subject": git("log", "-1", "--format=%s", sha, cwd=repo)[:120],
                "steps_timed": len(later)} | {
            f"median_{key}_s": round(statistics.median(r[f"time/{key}"] for r in later), 4)
            for key in ("train", "rollout", "step")}
    finally:
        git("worktree", "remove", "--force", str(tree), cwd=repo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("commits", nargs="+")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args()
    repo = Path(git("rev-parse", "--show-toplevel"))
    with tempfile.TemporaryDirectory(prefix="rlflow-steps-") as tmp, ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda c: measure(repo, c, args.steps, Path(tmp), args.timeout_s), args.commits))
    for r in results:
        print(json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "parallel": args.parallel, "results": results},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
