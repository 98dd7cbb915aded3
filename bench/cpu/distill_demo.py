"""The distillation demo (tests/test_distill.py's slow run) over several seeds, outside pytest.

    python -m bench.cpu.distill_demo --steps 40 50 --seeds 0 1 2 --out distill.json

For each seed: a 1.1M-parameter teacher (hidden 192, 3 layers) taught by 300 SFT steps on 4096 sorted examples,
then deployments/sort-tiny-distill.yaml's student distilled from it for each --steps (its cosine schedule over
that many), in this process, no Prefect, no Ray. Prints and writes each run's held-out reward every 10 steps: the
spread over seeds says how much margin a claimed bar has.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.e2e.bare_loop import run_bare, run_sft_bare
from rlflow.engines.core.config import config_from_dict, load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "deployments"


def sft_teacher(workdir: Path, seed: int) -> Path:
    data = [f"data.train_path={workdir}/data/train.jsonl", f"data.eval_path={workdir}/data/eval.jsonl", f"seed={seed}"]
    raw = load_recipe(RECIPES / "sort-tiny.yaml", data).model_dump(mode="json")
    raw = {**raw, "model": {**raw["model"], "hidden_size": 192, "num_layers": 3, "intermediate_size": 384},
           "cluster": {"use_ray": False},
           "sft": {"train_path": str(workdir / "data/sft.jsonl"), "batch_size": 64, "lr": 2e-3, "steps": 300,
                   "generate": {**raw["data"]["generate"], "num_train": 4096}}}
    return run_sft_bare(config_from_dict(raw), workdir / "teacher_base", workdir / "teacher")


def distill(workdir: Path, teacher: Path, steps: int, seed: int) -> dict:
    cfg = load_recipe(RECIPES / "sort-tiny-distill.yaml", [
        f"data.train_path={workdir}/data/train.jsonl", f"data.eval_path={workdir}/data/eval.jsonl", f"seed={seed}",
        f"distill.teacher_path={teacher}", "checkpoint.every=0", "cluster.use_ray=false", f"train.steps={steps}"])
    history = run_bare(cfg, str(workdir / f"student{steps}"), log=lambda line: None)
    return {"steps": steps, "seed": seed, "first_rollout_reward": history[0]["rollout/reward_mean"],
            "eval_reward": [m["eval/reward_mean"] for m in history if "eval/reward_mean" in m]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[50])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="rlflow-distill-") as tmp:
        for seed in args.seeds:
            workdir = Path(tmp) / f"seed{seed}"
            teacher = sft_teacher(workdir, seed)
            for steps in args.steps:
                results.append(distill(workdir, teacher, steps, seed))
                print(json.dumps(results[-1]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
