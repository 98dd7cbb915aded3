"""LoRA RL against full fine-tuning from the same SFT'd base, on the sort demo, through the bare loop.

    python -m bench.cpu.lora_sort --sft-steps 30 --steps 100 --json lora_sort.json

The base: sort-tiny's random model after `--sft-steps` SFT steps (deployments/sort-tiny-sft.yaml, 512
demonstrations), made once. Then the arms run side by side, each in its own process with `train.threads=1`,
from that base with deployments/sort-tiny-lora.yaml's recipe:
  lora   the recipe as it is (rank-16 adapters on every linear, the base frozen, the adapter transport);
  full   the same recipe without train.lora (every weight trains, the default transport), at `--full-lr`.
Prints the held-out greedy reward of the base and of each arm every eval.every steps; writes --json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import harness
from bench.e2e.bare_loop import run_bare
from rlflow.engines.core.config import load_recipe
from rlflow.engines.session.sft import SFTSession
from rlflow.engines.session.workers import prepare_data, prepare_model

ROOT = Path(__file__).resolve().parents[2]
LORA = str(ROOT / "deployments" / "sort-tiny-lora.yaml")
SFT = str(ROOT / "deployments" / "sort-tiny-sft.yaml")
QUIET = ["train.threads=1", "checkpoint.every=0", "cluster.use_ray=false"]


def make_base(args, workdir: str) -> float:
    """SFT for sft_steps into <workdir>/sft/model; returns its held-out reward."""
    cfg = load_recipe(SFT, [f"sft.steps={args.sft_steps}", *QUIET, *_data(workdir)])
    prepare_data(cfg)
    session = SFTSession.create(cfg, prepare_model(cfg, f"{workdir}/random"), use_ray=False)
    try:
        for step in range(args.sft_steps):
            session.train(step)
        session.sync_weights(args.sft_steps - 1)
        reward = session.evaluate(args.sft_steps - 1)[0]["eval/reward_mean"]
        session.save(f"{workdir}/sft", args.sft_steps - 1)
    finally:
        session.shutdown()
    return reward


def _data(workdir: str) -> list[str]:
    return [f"data.train_path={workdir}/data/train.jsonl", f"data.eval_path={workdir}/data/eval.jsonl",
            f"sft.train_path={workdir}/data/sft.jsonl"]


def arm(args, workdir: str) -> dict:
    """One arm from the base, in this process."""
    over = [f"model.path={workdir}/sft/model", f"train.steps={args.steps}", *QUIET, *_data(workdir)[:2],
            f"weight_sync.disk_dir={workdir}/sync-{args.arm}"]
    if args.arm == "full":
        over += ["train.lora=null", "weight_sync.transport=ray", f"train.lr={args.full_lr}"]
    cfg = load_recipe(LORA, over)
    t0 = time.perf_counter()
    history = run_bare(cfg, f"{workdir}/{args.arm}", log=lambda line: None)
    return {"evals": {m["step"] + 1: m["eval/reward_mean"] for m in history if "eval/reward_mean" in m},
            "sync_bytes": history[-1]["sync/bytes"], "lr": cfg.train.lr, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--full-lr", type=float, default=5e-4, help="full fine-tuning's rate (the demo after SFT)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--arm", choices=["lora", "full"], help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        harness.emit_result(arm(args, args.workdir))
        return
    with tempfile.TemporaryDirectory() as workdir:
        result = harness.report_header(__spec__.name, None) | {"sft_steps": args.sft_steps, "steps": args.steps,
                  "base_reward": make_base(args, workdir)}
        print(f"base after {args.sft_steps} SFT steps: held-out {result['base_reward']:.3f}", flush=True)

        def child(name: str) -> dict:
            return harness.run_child(["-m", __spec__.name, "--arm", name, "--workdir", workdir,
                                      "--steps", str(args.steps), "--full-lr", str(args.full_lr)])

        with ThreadPoolExecutor(2) as pool:
            result |= dict(zip(("lora", "full"), pool.map(child, ("lora", "full")), strict=True))
    for name in ("lora", "full"):
        r = result[name]
        print(name, r.get("error") or {k: round(v, 3) for k, v in r["evals"].items()}, flush=True)
    if args.json:
        harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
