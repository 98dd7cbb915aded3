"""The RL loop with no Prefect and no Ray: the same engine classes, called in this process.

It is the baseline of bench/overhead.py and the first tool for debugging a recipe:
    python bench/bare_loop.py deployments/sort-tiny.yaml --set train.steps=20
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from engines.config import RLConfig, load_recipe
from engines.rl import RLSession, prepare_data, prepare_model


def run_bare(cfg: RLConfig, workdir: str, log=print) -> list[dict]:
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, workdir), use_ray=False)
    history = []
    for step in range(cfg.train.steps):
        t0, m = time.perf_counter(), {"step": step}
        # (session method, timing name): the same time/* names the flow's tasks log
        for stage, label in (("rollout", "rollout"), ("reward", "reward"), ("advantages", "advantages"),
                             ("train", "train"), ("sync_weights", "sync")):
            ts = time.perf_counter()
            m |= getattr(session, stage)(step)
            m[f"time/{label}"] = time.perf_counter() - ts
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
            m |= session.evaluate(step)[0]
        m["time/step"] = time.perf_counter() - t0
        history.append(m)
        log(json.dumps({k: round(v, 4) for k, v in m.items() if not k.startswith("sync/")}))
    session.shutdown()
    return history


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        run_bare(load_recipe(args.recipe, args.overrides), d)
