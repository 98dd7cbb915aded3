"""Orchestration overhead: the same recipe through the full stack (Prefect flow + Ray actors + MLflow)
and as a bare loop over the same engine classes in one process, side by side in one run.

    python -m bench.cpu.overhead deployments/sort-tiny.yaml --steps 30 --repeats 2 [--json out.json]

Step time is wall time between consecutive step ends (everything between them counts: tasks, actor
calls, metric logging). The first `--warmup` steps of each are dropped. Every run is a fresh process, bare
and full alternating `--repeats` times; prints `ratio: X`, the median full step over the median bare step
of all repeats.
It also prints the CPU seconds per step of the controller (this process: the flow, the router, the rollout
function's HTTP client, MLflow's logging threads) and of the temporary Prefect server (Linux /proc), which
is what orchestration takes from the cores the workers compute on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from prefect import flow  # noqa: E402

from bench import harness  # noqa: E402
from bench.e2e.bare_loop import run_bare  # noqa: E402
from rlflow.engines.core.config import load_recipe  # noqa: E402
from rlflow.flows.post_train import post_train  # noqa: E402
from rlflow.flows.serve import use_prefect_server_defaults  # noqa: E402
from rlflow.tasks.run_context import STEP_LISTENERS  # noqa: E402

use_prefect_server_defaults()  # the full stack as `rlflow run` starts it

STAGES = ("rollout", "reward", "advantages", "train", "sync")


def _stat_fields(stat: Path) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...; the name may hold spaces)."""
    return stat.read_text().rsplit(")", 1)[1].split()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _prefect_server_pid() -> int | None:
    """The temporary Prefect server this process started (None when PREFECT_API_URL names another)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(_stat_fields(stat)[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if parent == os.getpid() and b"prefect.server" in cmd:
            return int(stat.parent.name)
    return None


def _cpu_per_step(samples: list[dict[str, float]], warmup: int, last: int) -> dict[str, float]:
    """CPU seconds per step of each process over the steps whose times count."""
    a, b = samples[warmup], samples[last - 1]
    return {k: (b[k] - a[k]) / (last - 1 - warmup) for k in a}


def _step_times(ends: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :], strict=False)]


def _stage_medians(rows: list[dict]) -> dict[str, float]:
    """Median seconds per stage (medians: a 2-core machine has outliers), plus the train step's time
    inside the worker, so the train row splits into compute and the cost of reaching the worker."""
    out = {s: statistics.median(r[f"time/{s}"] for r in rows) for s in STAGES}
    out["train (in worker)"] = statistics.median(r["time/train_worker"] for r in rows)
    return out


def _start_prefect(settle_s: float = 10.0) -> None:
    """Start this process's Prefect API (a temporary local server unless PREFECT_API_URL is set) with a
    throwaway flow run, and let its start-up work finish: the steady state of a long-lived server is
    what a training run meets, not its first seconds."""
    flow(name="overhead-warm-up")(lambda: None)()
    time.sleep(settle_s)


def _sample_cpu(server: int | None) -> dict[str, float]:
    out = {"controller": _cpu_s(os.getpid())}
    if server is not None:
        out["prefect server"] = _cpu_s(server)
    return out


def run_full(cfg, cpu: list[dict[str, float]]) -> tuple[list[dict], list[float]]:
    history, ends = [], []
    server = _prefect_server_pid()

    def listen(step, m):
        ends.append(time.perf_counter())
        cpu.append(_sample_cpu(server))
        history.append(m)

    STEP_LISTENERS.append(listen)
    try:
        post_train(cfg)
    finally:
        STEP_LISTENERS.remove(listen)
    return history, ends


def run_one(kind: str, recipe: str, overrides: list[str], out: Path) -> None:
    """One run, in this process (a fresh one: `main` starts one per run): its step end times, CPU samples and
    stage metrics go to `out` as JSON."""
    cfg = load_recipe(recipe, overrides)
    samples: list[dict[str, float]] = []
    if kind == "bare":
        ends: list[float] = []

        def log(line: str) -> None:
            ends.append(time.perf_counter())
            samples.append(_sample_cpu(None))

        with tempfile.TemporaryDirectory() as work:
            history = run_bare(cfg, work, log=log)
    else:
        _start_prefect()
        history, ends = run_full(cfg, samples)
    out.write_text(json.dumps({"ends": ends, "cpu": samples, "history": history}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="bare/full pairs, alternating")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--one", choices=["bare", "full"], help=argparse.SUPPRESS)  # a single run (main starts these)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return run_one(args.one, args.recipe, args.overrides, args.result)

    # Each run is a fresh process: the bare loop then runs with no Prefect server and no Ray cluster on the
    # machine, and the full stack pays for its own (sharing one process, the idle services of the full runs
    # slowed the bare runs after them). Bare and full alternate, `--repeats` times: a shared machine drifts
    # (other processes, CPU steal), and alternating puts the drift on both sides.
    last = args.steps - 1  # the last step is dropped: the full stack writes its closing checkpoint there
    steps: dict[str, list[float]] = {"bare": [], "full": []}
    rows: dict[str, list[dict]] = {"bare": [], "full": []}
    per_repeat = []
    cpu: dict[str, list[dict[str, float]]] = {"bare": [], "full": []}  # CPU s per step, one dict per repeat
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            run: dict[str, dict] = {}
            for kind in ("bare", "full"):
                out = Path(tmp) / f"{kind}-{rep}.json"
                overrides = [f"train.steps={args.steps}", "eval.every=0", "checkpoint.every=0",
                             "checkpoint.every_minutes=0",
                             f"storage.uri={tmp}/runs", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
                             f"name=overhead-{kind}-{rep}", *args.overrides]
                subprocess.run([sys.executable, "-m", __spec__.name, args.recipe, "--one", kind, "--result", str(out),
                                *(a for o in overrides for a in ("--set", o))], check=True)
                run[kind] = json.loads(out.read_text())
            for kind, r in run.items():
                steps[kind] += _step_times(r["ends"][:last], args.warmup)
                rows[kind] += r["history"][args.warmup + 1 : last]
                cpu[kind].append(_cpu_per_step(r["cpu"], args.warmup, last))
            per_repeat.append(statistics.median(_step_times(run["full"]["ends"][:last], args.warmup))
                              / statistics.median(_step_times(run["bare"]["ends"][:last], args.warmup)))

    result = {
        "recipe": args.recipe,
        "steps": args.steps,
        "repeats": args.repeats,
        "bare_step_s": statistics.median(steps["bare"]),
        "full_step_s": statistics.median(steps["full"]),
        "ratio": statistics.median(steps["full"]) / statistics.median(steps["bare"]),
        "ratio_per_repeat": per_repeat,
        "bare_stages_s": _stage_medians(rows["bare"]),
        "full_stages_s": _stage_medians(rows["full"]),
        "cpu_s_per_step": {kind: {k: statistics.median(r[k] for r in reps) for k in reps[0]}
                           for kind, reps in cpu.items()},
    }
    print(f"{'stage (median)':<20}{'bare s':>10}{'full s':>10}")
    for s in result["bare_stages_s"]:
        print(f"{s:<20}{result['bare_stages_s'][s]:>10.4f}{result['full_stages_s'][s]:>10.4f}")
    print(f"{'step':<20}{result['bare_step_s']:>10.4f}{result['full_step_s']:>10.4f}")
    for kind, procs in result["cpu_s_per_step"].items():
        print(f"cpu s per step, {kind}: " + ", ".join(f"{k} {v:.3f}" for k, v in procs.items()))
    print("ratio per repeat: " + ", ".join(f"{r:.3f}" for r in per_repeat))
    print(f"ratio: {result['ratio']:.3f}")
    if args.json:
        harness.write_json(args.json, harness.report_header(__spec__.name, None) | result)


if __name__ == "__main__":
    main()
