"""SFT cold start then GRPO, against GRPO alone, at an equal number of steps, through the bare loop.

    python -m bench.cpu.sft_then_grpo --sft-steps 10 --grpo-steps 20 --seeds 0,1 --json sft_grpo.json

Two arms start from the same randomly initialised model (both recipes build it from the same model section
and seed) and run side by side, each in its own process with `train.threads=1`:
  grpo      GRPO (deployments/sort-tiny.yaml) for sft_steps + grpo_steps steps;
  sft+grpo  SFT (deployments/sort-tiny-sft.yaml: 512 demonstrations) for sft_steps steps, then GRPO from the
            SFT weights for grpo_steps steps.
"Equal steps" = the same number of train-stage iterations. An SFT step is one optimizer step on sft.batch_size
(64) demonstrations and generates nothing; a GRPO step generates prompts_per_step x samples_per_prompt (512)
samples and takes mini_batches x epochs (16) optimizer steps on them, so the SFT arm does less work: the table
also gives each arm's optimizer updates, generated samples and wall time. Prints the held-out greedy reward
(eval.every steps, and right after SFT) of each arm and the difference at the last step; writes --json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import harness
from bench.e2e.bare_loop import run_bare
from rlflow.engines.core.config import load_recipe
from rlflow.engines.session.sft import SFTSession
from rlflow.engines.session.workers import prepare_data, prepare_model

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "deployments" / "sort-tiny.yaml")
SFT = str(ROOT / "deployments" / "sort-tiny-sft.yaml")
QUIET = ["train.threads=1", "checkpoint.every=0"]


def _quiet(line: str) -> None:
    pass


def sft_arm(args, workdir: str) -> dict:
    """SFT for sft_steps (bare: no Prefect, no Ray), evaluate, then GRPO from the SFT weights."""
    common = [f"seed={args.seed}", *QUIET, *args.set]
    cfg = load_recipe(SFT, [f"sft.steps={args.sft_steps}", f"eval.every={args.eval_every}", *common])
    prepare_data(cfg)
    session = SFTSession.create(cfg, prepare_model(cfg, workdir), use_ray=False)
    losses = [session.train(step)["train/loss"] for step in range(args.sft_steps)]
    session.sync_weights(args.sft_steps - 1)
    evals = {args.sft_steps: session.evaluate(args.sft_steps - 1)[0]["eval/reward_mean"]}
    session.save(f"{workdir}/sft", args.sft_steps - 1)
    session.shutdown()
    grpo = load_recipe(GRPO, [f"model.path={workdir}/sft/model", f"train.steps={args.grpo_steps}",
                              f"eval.every={args.eval_every}", *common, *args.after_sft])
    history = run_bare(grpo, workdir, log=_quiet)
    evals |= {args.sft_steps + m["step"] + 1: m["eval/reward_mean"] for m in history if "eval/reward_mean" in m}
    return {"evals": evals, "sft_loss_first_last": [losses[0], losses[-1]],
            "optimizer_updates": args.sft_steps + args.grpo_steps * grpo.train.mini_batches * grpo.train.epochs,
            "generated_samples": args.grpo_steps * grpo.rollout.prompts_per_step * grpo.rollout.samples_per_prompt}


def grpo_arm(args, workdir: str) -> dict:
    steps = args.sft_steps + args.grpo_steps
    cfg = load_recipe(GRPO, [f"train.steps={steps}", f"eval.every={args.eval_every}", f"seed={args.seed}",
                             *QUIET, *args.set])
    history = run_bare(cfg, workdir, log=_quiet)
    return {"evals": {m["step"] + 1: m["eval/reward_mean"] for m in history if "eval/reward_mean" in m},
            "optimizer_updates": steps * cfg.train.mini_batches * cfg.train.epochs,
            "generated_samples": steps * cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt}


def run_arm(arm: str, seed: int, args, datadir: str) -> dict:
    """One arm and seed in its own process (its own torch thread, its own model directory; run in `datadir`, where
    the recipes' relative data paths resolve, with this checkout importable)."""
    out = harness.run_child(
        ["-m", __spec__.name, "--arm", arm, "--seed", str(seed), "--sft-steps", str(args.sft_steps),
         "--grpo-steps", str(args.grpo_steps), "--eval-every", str(args.eval_every),
         *[a for s in args.set for a in ("--set", s)], *[a for s in args.after_sft for a in ("--after-sft", s)]],
        cwd=datadir, env=os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    seconds = round(out.pop("wall_s"), 1)
    if "error" not in out:
        out["evals"] = {int(k): v for k, v in out["evals"].items()}
    return {"arm": arm, "seed": seed, "seconds": seconds, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft-steps", type=int, default=10)
    ap.add_argument("--grpo-steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10, help="also the SFT step count should be a multiple")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--parallel", type=int, default=2, help="arm processes at once (1 torch thread each)")
    ap.add_argument("--set", action="append", default=[], help="extra override for every recipe")
    ap.add_argument("--after-sft", action="append", default=[], metavar="KEY=VALUE",
                    help="override for the GRPO phase that follows SFT only (e.g. algorithm.entropy_coef=0.02)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--arm", choices=["grpo", "sft+grpo"], help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:  # child: run one arm in this process and answer with its result
        with tempfile.TemporaryDirectory() as workdir:
            harness.emit_result((sft_arm if args.arm == "sft+grpo" else grpo_arm)(args, workdir))
        return
    if args.sft_steps % args.eval_every:
        ap.error("--sft-steps must be a multiple of --eval-every, so both arms are evaluated at the same steps")
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(arm, seed) for seed in seeds for arm in ("grpo", "sft+grpo")]
    with tempfile.TemporaryDirectory() as datadir, ThreadPoolExecutor(args.parallel) as pool:
        # both recipes' relative data paths resolve in datadir: write the task files once, before the arms
        subprocess.run([sys.executable, "-c", "import sys; from rlflow.engines.core.config import load_recipe; "
                        "from rlflow.engines.session.workers import prepare_data; "
                        "prepare_data(load_recipe(sys.argv[1]))", SFT],
                       cwd=datadir, env=os.environ | {"PYTHONPATH": str(ROOT)}, check=True)
        futures = [pool.submit(run_arm, arm, seed, args, datadir) for arm, seed in jobs]
        results = [f.result() for f in futures]
    total = args.sft_steps + args.grpo_steps
    print(f"held-out greedy reward by step (sft+grpo: {args.sft_steps} SFT + {args.grpo_steps} GRPO steps"
          f"{' with ' + ', '.join(args.after_sft) if args.after_sft else ''}; grpo: {total} GRPO steps)")
    for r in results:
        if "error" in r:
            print(f"{r['arm']:<9} seed {r['seed']}  FAILED ({r['error']})\n{r['tail']}")
            continue
        evals = "  ".join(f"{k}:{v:.3f}" for k, v in sorted(r["evals"].items()))
        print(f"{r['arm']:<9} seed {r['seed']}  {r['seconds']:>6.0f}s  updates {r['optimizer_updates']:>4}  "
              f"samples {r['generated_samples']:>6}  {evals}")
    diffs = []
    for seed in seeds:
        by_arm = {r["arm"]: r for r in results if r["seed"] == seed and "error" not in r}
        if len(by_arm) == 2:
            d = by_arm["sft+grpo"]["evals"][total] - by_arm["grpo"]["evals"][total]
            diffs.append(d)
            print(f"seed {seed}: at step {total} sft+grpo - grpo = {d:+.3f}")
    if diffs:
        print(f"mean difference at step {total}: {sum(diffs) / len(diffs):+.3f} over {len(diffs)} seed(s)")
    if args.json:
        harness.write_json(args.json, harness.report_header(__spec__.name, None) | {
            "sft_steps": args.sft_steps, "grpo_steps": args.grpo_steps, "set": args.set, "after_sft": args.after_sft,
            "results": results, "differences": diffs})


if __name__ == "__main__":
    main()
