"""How long `rlflow run` takes to start and stop around a few steps, at several commits, side by side.

    python -m bench.cpu.startup 502dce0~1 502dce0 --repeats 3 --out startup.json

Each commit is checked out in a temporary git worktree and runs its own CLI (`python -m rlflow.flows.cli run`, with
`rlflow.*` mapped onto the checkout's folders through a PYTHONPATH shim, which Ray passes to its workers) on one
small recipe: the CPU suite's shape (a 2-layer, 32-wide Llama from scratch, 8 prompts x 4 samples a step), 5 steps,
a checkpoint every 2, evaluation every 2, a temporary Prefect server, a local Ray, MLflow on SQLite. Runs alternate
between the commits (ABAB...), so a drift of the machine's speed falls on both. From each run's log, seconds since
launch:
- flow_start: Prefect's "Beginning flow run" (imports done, the temporary server up);
- first_step: the first rollout task finished (Ray up, the workers constructed, one rollout);
- flow_end: the flow run finished;
- exit: the process ended (the temporary server and the local Ray stopped).
Reported per commit: the median of each over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from bench.cpu.step_by_commit import git

MARKS = {"flow_start": re.compile(r"Beginning flow run"), "first_step": re.compile(r"Task run 'rollout-0' - Finished"),
         "flow_end": re.compile(r"Flow run '[^']+' - Finished")}
FOLDERS = ("engines", "tasks", "flows", "examples", "deployments")


def recipe(workdir: Path, name: str) -> dict:
    """The CPU suite's small sort recipe (tests/conftest.py small_recipe) over 5 steps, everything under workdir.
    A copy on purpose: the timed workload must stay the same when the tests' recipe changes."""
    return {
        "name": name,
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 16},
        "data": {"train_path": str(workdir / "data/train.jsonl"), "eval_path": str(workdir / "data/eval.jsonl"),
                 "generate": {"task": "sort", "num_digits": 3, "num_train": 2000, "num_eval": 32}},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 4},
        "train": {"steps": 5, "threads": 1, "mini_batches": 2},
        "checkpoint": {"every": 2},
        "eval": {"every": 2, "max_prompts": 16},
        "tracking": {"uri": f"sqlite:///{workdir}/mlflow.db"},
        "storage": {"uri": str(workdir / "runs")},
    }


def checkout(repo: Path, commit: str, workdir: Path) -> tuple[str, Path]:
    """(sha, worktree) with a shim folder whose rlflow/ links each top-level folder of the checkout."""
    sha = git("rev-parse", commit, cwd=repo)
    tree = workdir / sha[:12]
    git("worktree", "add", "--detach", "-f", str(tree), sha, cwd=repo)
    shim = tree / ".shim" / "rlflow"
    shim.mkdir(parents=True)
    for folder in FOLDERS:
        if (tree / folder).is_dir():
            (shim / folder).symlink_to(tree / folder)
    return sha, tree


def run_once(tree: Path, workdir: Path, name: str, timeout_s: float) -> dict:
    """One `rlflow run` of the recipe from `tree`: the MARKS' times and the exit's, seconds since launch."""
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe(workdir, name)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")} | {
        "PYTHONPATH": os.pathsep.join([str(tree / ".shim"), str(tree)]), "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_HOME": str(workdir / f"prefect-{name}"), "RAY_USAGE_STATS_ENABLED": "0", "CUDA_VISIBLE_DEVICES": ""}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "rlflow.flows.cli", "run", str(path)], cwd=tree, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(timeout_s, proc.kill)  # a run that hangs silently is killed too
    watchdog.start()
    seen: dict[str, float] = {}
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        for mark, pattern in MARKS.items():
            if mark not in seen and pattern.search(line):
                seen[mark] = round(time.monotonic() - start, 2)
    rc = proc.wait()
    watchdog.cancel()
    seen["exit"] = round(time.monotonic() - start, 2)
    if rc or len(seen) < len(MARKS) + 1:
        return {"error": f"rc {rc}, marks {sorted(seen)}", "log_tail": "".join(tail)[-3000:]}
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("commits", nargs="+")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args()
    repo = Path(git("rev-parse", "--show-toplevel"))
    with tempfile.TemporaryDirectory(prefix="rlflow-startup-") as tmp:
        work = Path(tmp)
        trees = [checkout(repo, c, work) for c in args.commits]
        runs: dict[str, list[dict]] = {sha: [] for sha, _ in trees}
        try:
            for i in range(args.repeats):
                for sha, tree in trees:
                    run = run_once(tree, work, f"r{i}-{sha[:8]}", args.timeout_s)
                    print(json.dumps({"commit": sha[:12], "repeat": i} | run), flush=True)
                    runs[sha].append(run)
        finally:
            for _, tree in trees:
                git("worktree", "remove", "--force", str(tree), cwd=repo)
    results = []
    for sha, done in runs.items():
        ok = [r for r in done if "error" not in r]
        row = {"commit": sha, "subject": git("log", "-1", "--format=%s", sha, cwd=repo)[:120], "runs": len(ok),
               "failed": len(done) - len(ok)}
        if ok:
            row |= {f"median_{k}_s": round(statistics.median(r[k] for r in ok), 2) for k in (*MARKS, "exit")}
        results.append(row)
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({"repeats": args.repeats, "results": results, "runs": runs},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
