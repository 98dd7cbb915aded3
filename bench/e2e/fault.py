"""A GPU worker killed mid-step in a multi-GPU run, and the flow resumed from its last committed step (issue 24
item 5).

    source .whl/setup.sh; python -m bench.e2e.fault --out gpu_fault.json       # 4 GPUs (bench/device_wheels.sh --all)
    python -m bench.e2e.fault --smoke --out /tmp/gpu_fault_smoke.json           # CPU, gloo: checks the script

The whole stack, as a user runs it: `rlflow run deployments/sort-tiny.yaml --set ...` (the Prefect flow with its
temporary Prefect server, a local Ray, MLflow in SQLite, the run store on local disk), on bench/e2e/grpo.py's
workload and placement `disagg2x2-sync`: two FSDP2 train ranks on GPUs 0-1, two rollout engines on GPUs 2-3, weights
broadcast over NCCL (the `distributed` transport); a checkpoint every --checkpoint-every steps.
1. The run, with RLFLOW_FAULT (tasks/faults.py) SIGKILLing train rank 1 --delay seconds into step --kill-step's
   train stage, while both ranks compute: rank 0 is left in an NCCL collective with a peer that is gone. The run
   must fail (not hang) within --timeout.
2. The same command again. The flow must resume from the newest committed checkpoint and finish.
Checked and reported: the failed run's exit and how long it took to end after the kill, the newest committed step
it left, the step the second run resumed from (its log), that every step 0..steps-1 is in the one MLflow run
exactly once, the steps trained twice (those after the checkpoint), the kill landing inside the train stage (the
delay against the earlier steps' train time), the GPU memory in use after each run (nvidia-smi: nothing left
behind by the killed run's processes), and each checkpoint's stage time (with `--set checkpoint.async_save=true`
also its background write's: checkpoint_s, checkpoint_write_s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from mlflow.tracking import MlflowClient

from bench import harness
from bench.e2e.grpo import MODES, build_workload_model, workload_overrides
from rlflow.engines.core.config import StorageConfig
from rlflow.engines.store.run_store import RunStore

MODE = "disagg2x2-sync"
RESUMED = re.compile(r"resuming run \S+ from committed step (\d+)")


def nvidia_smi(field: str) -> list[str] | None:
    """One line per GPU of nvidia-smi's `field` (None without nvidia-smi). Asked of nvidia-smi, not torch: the bench
    makes no CUDA context of its own (one took 623 MiB of GPU 0 in the first run), so the memory in use after a run
    is what its processes left behind."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_memory_used_mib() -> list[int] | None:
    used = nvidia_smi("memory.used")
    return [int(v) for v in used] if used is not None else None


def run_flow(args: list[str], fault: str | None, timeout: float, log: Path) -> dict:
    """`rlflow run ...` in its own process group (all of it is killed on a timeout); exit code, seconds, log tail."""
    env = {k: v for k, v in os.environ.items() if k not in ("RLFLOW_FAULT", "PREFECT_API_URL")}
    env |= {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PREFECT_LOGGING_LEVEL": "INFO"}
    if fault:
        env["RLFLOW_FAULT"] = fault
    t0 = time.monotonic()
    with log.open("w") as out:
        p = subprocess.Popen([sys.executable, "-m", "rlflow.flows.cli", "run", *args], env=env, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code = None
    text = log.read_text(errors="replace")
    if shutil.which("ray"):  # what a killed or hung run leaves (its local Ray's workers hold GPU memory)
        subprocess.run(["ray", "stop", "--force"], capture_output=True)
    return {"exit": code, "timed_out": code is None, "seconds": time.monotonic() - t0, "log": text,
            "gpu_memory_used_mib_after": gpu_memory_used_mib()}


def mlflow_history(tracking_uri: str, experiment: str) -> tuple[int, dict[str, list[tuple[int, float]]]]:
    """(MLflow runs in the experiment, {metric: its (step, value) points, in logging order} of the first run)."""
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    history = {key: [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key)]
               for key in runs[0].data.metrics} if runs else {}
    return len(runs), history


def run_status(store: RunStore) -> str | None:
    """status.json's status (running, failed, finished), None before the run wrote one."""
    try:
        return store.read_json("status.json")["status"]
    except FileNotFoundError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1.5b", choices=["1.5b", "7b"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=2, help="the step whose train stage loses train rank 1")
    ap.add_argument("--delay", type=float, default=1.0, help="seconds into the train stage")
    ap.add_argument("--prompts", type=int, default=16, help="prompts a step (x 8 samples)")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="caps the workload's 64-1,792-token responses")
    ap.add_argument("--timeout", type=float, default=400, help="seconds each of the two runs may take")
    harness.add_smoke(ap)
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY.PATH=VALUE",
                    help="a recipe change after the bench's own (e.g. checkpoint.async_save=true)")
    ap.add_argument("--out", default="gpu_fault.json")
    a = ap.parse_args()
    shape = "smoke" if a.smoke else a.shape
    delay = 0.0 if a.smoke else a.delay  # a toy's train stage lasts a fraction of a second: the kill opens it
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    if device == "cuda" and torch.cuda.device_count() < MODES[MODE][0]:
        sys.exit(f"bench.e2e.fault: {MODE} needs {MODES[MODE][0]} GPUs, {torch.cuda.device_count()} here")
    work = Path(tempfile.mkdtemp(prefix="rlflow-gpu-fault-"))
    model = build_workload_model(shape, work / "model")
    name, tracking = "gpu-fault", f"sqlite:///{work}/mlflow.db"
    max_new = 8 if a.smoke else a.max_new_tokens  # the toy's 512 positions hold the 256-token prompt too
    sets = [*workload_overrides(work, model, MODE, a.prompts, a.steps, device, max_new),
            f"name={name}", f"checkpoint.every={a.checkpoint_every}", "checkpoint.keep_last=2",
            f"tracking.uri={tracking}", f"tracking.experiment={name}", *a.overrides]
    args = ["deployments/sort-tiny.yaml", *[arg for s in sets for arg in ("--set", s)]]
    fault = f"train:{a.kill_step}:during@{delay}:train@1"
    # no CUDA context here (nvidia_smi): the GPU names come from nvidia-smi
    report = harness.report_header(__spec__.name, None, name_device=False) | {
              "gpus": nvidia_smi("name") or [], "shape": shape, "mode": MODE, "steps": a.steps, "fault": fault,
              "checkpoint_every": a.checkpoint_every, "overrides": a.overrides,
              "gpu_memory_used_mib_before": gpu_memory_used_mib()}

    store = RunStore(StorageConfig(uri=f"file://{work}/runs"), name)
    killed = run_flow(args, fault, a.timeout, work / "killed.log")
    _, before = mlflow_history(tracking, name)
    train_s = [t for _, t in before.get("time/train", [])]
    report["killed"] = {k: v for k, v in killed.items() if k != "log"} | {
        "committed_step": store.latest_step(), "status": run_status(store),
        "steps_logged": [step for step, _ in before.get("time/step", [])], "train_s_of_logged_steps": train_s,
        "log_tail": killed["log"][-2500:]}
    print(f"[gpu_fault] killed run: {json.dumps(report['killed'])[:1500]}", flush=True)
    harness.write_json(a.out, report)

    resumed = run_flow(args, None, a.timeout, work / "resumed.log")
    match = RESUMED.search(resumed["log"])
    runs, after = mlflow_history(tracking, name)
    logged = [step for step, _ in after.get("time/step", [])]
    report["resumed"] = {k: v for k, v in resumed.items() if k != "log"} | {
        "resumed_from": int(match.group(1)) if match else None, "committed_step": store.latest_step(),
        "status": run_status(store), "mlflow_runs": runs, "steps_logged": logged,
        # the checkpoint stage's seconds, and with checkpoint.async_save the background write's after it returned
        "checkpoint_s": after.get("time/checkpoint"), "checkpoint_write_s": after.get("time/checkpoint_write"),
        "log_tail": resumed["log"][-2500:]}
    report["checks"] = {
        "killed_run_failed": killed["exit"] not in (0, None),
        "killed_run_ended_within_timeout": not killed["timed_out"],
        "kill_inside_train_stage": bool(train_s) and delay < min(train_s),
        # None for both: nothing was committed (an async_save write still in flight at the kill), a fresh start
        "resumed_from_newest_committed_step": report["resumed"]["resumed_from"] == report["killed"]["committed_step"],
        "resumed_run_finished": resumed["exit"] == 0 and report["resumed"]["status"] == "finished",
        "one_mlflow_run": runs == 1,
        "every_step_logged_once": sorted(logged) == list(range(a.steps)),
        "no_metric_logged_twice": all(len(v) == len({step for step, _ in v}) for v in after.values()),
    }
    committed = report["killed"]["committed_step"]
    # the killed step and the finished ones after the checkpoint: their work is done again after the resume
    report["steps_rerun"] = list(range(0 if committed is None else committed + 1, a.kill_step + 1))
    report["passed"] = all(report["checks"].values())
    print(f"[gpu_fault] checks: {json.dumps(report['checks'])} passed={report['passed']}", flush=True)
    harness.write_json(a.out, report)
    if not report["passed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
