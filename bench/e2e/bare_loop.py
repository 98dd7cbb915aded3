"""The RL loop with no Prefect and no Ray: the same engine classes, called in this process.

It is the baseline of bench/cpu/overhead.py and the first tool for debugging a recipe:
    python -m bench.e2e.bare_loop deployments/sort-tiny.yaml --set train.steps=20
    python -m bench.e2e.bare_loop deployments/sort-tiny.yaml --set debug.mode=rollout_only --trace-dir traces/
Debug modes and replay (the recipe's `debug` section) work here as in the flow; traced steps' timelines
are written to --trace-dir instead of MLflow.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlflow.engines.core.config import RLConfig, load_recipe
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.schedule import RolloutSchedule
from rlflow.engines.session.sft import SFTSession
from rlflow.engines.session.workers import prepare_data, prepare_model


def _timed(session: RLSession, stage: str, step: int, label: str) -> dict:
    t0 = time.perf_counter()
    with session.stage_span(stage, step):
        metrics = getattr(session, stage.replace("-", "_"))(step)
    return metrics | {f"time/{label}": time.perf_counter() - t0}  # the same time/* names the flow's tasks log


def run_bare(cfg: RLConfig, workdir: str, log=print, use_ray: bool = False, trace_dir: str | None = None) -> list[dict]:
    """`use_ray`: the engines in Ray actors (as the flow has them) with this loop instead of Prefect."""
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, workdir), use_ray=use_ray)
    try:
        return run_steps(session, cfg, log, trace_dir)
    finally:
        session.shutdown()


def run_steps(session: RLSession, cfg: RLConfig, log=print, trace_dir: str | None = None) -> list[dict]:
    """The loop itself, on a session the caller made (and shuts down)."""
    history = []
    pool = ThreadPoolExecutor(max(cfg.rollout.max_staleness, 1))  # the rollouts running ahead (max_staleness)

    def rollout_after(step: int, after) -> dict:  # `after`: the rollout it waits for (dynamic sampling chains)
        if after is not None:
            after.result()
        return _timed(session, "rollout", step, "rollout")

    def submit(step: int, after):
        return pool.submit(rollout_after, step, after)

    rollouts = RolloutSchedule(cfg.rollout.max_staleness, cfg.train.steps - 1,
                               lambda step: _timed(session, "rollout", step, "rollout"), submit,
                               lambda: session.weight_version, chain=cfg.rollout.dynamic_sampling.enabled)
    stages = (("reward", "reward"),)
    if cfg.debug.trains:
        stages += ((("teacher", "teacher"),) if cfg.distill.enabled else ()) + (
            ("advantages", "advantages"), ("train", "train"))
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        m = {"step": step} | rollouts.take(step)
        for stage, label in stages:
            m |= _timed(session, stage, step, label)
        if cfg.debug.trains:
            m |= rollouts.before_sync(step)  # k = 1: waits for the rollout in flight; k >= 2 syncs under it
            m |= _timed(session, "sync-weights", step, "sync")
        if cfg.debug.mode is None and cfg.eval.every and (step + 1) % cfg.eval.every == 0:
            m |= session.evaluate(step)[0]
        m["time/step"] = time.perf_counter() - t0
        if trace_dir and cfg.debug.traced(step):
            tt = time.perf_counter()
            out = Path(trace_dir) / f"step_{step:06d}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(session.trace_events(step)))
            m["time/trace"] = time.perf_counter() - tt
        history.append(m)
        log(json.dumps({k: round(v, 4) for k, v in m.items() if not k.startswith("sync/")}))
    pool.shutdown()
    return history


def run_sft_bare(cfg: RLConfig, base_dir: str | Path, out_dir: str | Path) -> Path:
    """cfg.sft.steps SFT steps in this process (no Prefect, no Ray) on the model prepared in `base_dir`; the
    checkpoint of the last step goes to `out_dir`. Returns its HF model folder (a teacher, or a base for RL)."""
    prepare_data(cfg)
    session = SFTSession.create(cfg, prepare_model(cfg, base_dir))
    try:
        for step in range(cfg.sft.steps):
            session.train(step)
        session.save(out_dir, cfg.sft.steps - 1)
    finally:
        session.shutdown()
    return Path(out_dir) / "model"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--ray", action="store_true", help="engines in Ray actors (GPU placement needs this)")
    ap.add_argument("--trace-dir", help="write traced steps' timelines (debug.trace_every) here as Chrome trace JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        run_bare(load_recipe(args.recipe, args.overrides), d, use_ray=args.ray, trace_dir=args.trace_dir)
