"""The `rlflow` command: run, validate, and make built-in task data.

    rlflow run deployments/sort-tiny.yaml [--set train.steps=20 --set tracking.uri=...]
    rlflow validate deployments/sort-tiny.yaml
    rlflow runs [--store s3://bucket/runs]
    rlflow resume RUN [--store ...] [--set train.steps=200]
    rlflow export RUN OUT_DIR [--step N] [--store ...]
    rlflow data make --task sort --num-digits 4 --train data/sort4/train.jsonl --eval data/sort4/eval.jsonl
    rlflow serve [--prefect-port 4200] [--mlflow-port 5000] [--no-deploy]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engines.config import BuiltinTaskConfig, RecipeError, load_recipe


def _load(args) -> object:
    from engines.preflight import check

    cfg = load_recipe(args.recipe, args.overrides)
    return check(cfg, args.recipe)


def cmd_validate(args) -> int:
    cfg = _load(args)
    print(f"{args.recipe}: ok (run '{cfg.name}', {cfg.train.steps} steps)")
    return 0


def cmd_run(args) -> int:
    return _run(_load(args))


def _store_config(args):
    from engines.config import StorageConfig

    opts = {"uri": args.store}
    for text in args.overrides:
        if text.startswith("storage."):
            key, value = text.split("=", 1)
            opts[key.removeprefix("storage.")] = value
    return StorageConfig(**opts)


def cmd_resume(args) -> int:
    """Continue a run from its store: the stored recipe, with --set overrides on top."""
    from engines.config import apply_overrides, config_from_dict
    from engines.preflight import check
    from tasks.run_store import RunStore

    store = RunStore(_store_config(args), args.run)
    if not store.exists("config.json"):
        print(f"error: no run '{args.run}' in {args.store} (no {store.uri('config.json')})", file=sys.stderr)
        return 2
    raw = apply_overrides(store.read_json("config.json"), [f"storage.uri={args.store}", *args.overrides])
    cfg = check(config_from_dict(raw, source=store.uri("config.json")), store.uri("config.json"))
    return _run(cfg)


def cmd_runs(args) -> int:
    from tasks.run_store import list_runs

    runs = list_runs(_store_config(args))
    if not runs:
        print(f"no runs in {args.store}")
    for r in runs:
        step = "-" if r["latest_step"] is None else r["latest_step"]
        print(f"{r['run']:<32} latest step {step!s:<8} {r.get('status', 'unknown')}")
    return 0


def cmd_export(args) -> int:
    """Copy a committed checkpoint's model/ (HF safetensors + config + tokenizer) to a local directory."""
    from pathlib import Path

    from tasks.run_store import RunStore

    store = RunStore(_store_config(args), args.run)
    step = args.step if args.step is not None else store.latest_step()
    if step is None or step not in store.committed_steps():
        print(f"error: run '{args.run}' has no committed checkpoint {'' if step is None else step}", file=sys.stderr)
        return 2
    out = Path(args.out)
    store.export_model(step, out)
    print(f"exported step {step} of '{args.run}' to {out} (load with AutoModelForCausalLM.from_pretrained)")
    return 0


def _run(cfg) -> int:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # the progress bar says what the task logs would
    logging.getLogger("rlflow").setLevel(logging.INFO)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flows.post_train import post_train
    from tasks.run_context import STEP_LISTENERS

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"), transient=False,
    ) as progress:
        bar = progress.add_task(cfg.name, total=cfg.train.steps, info="starting engines...")
        last_eval: dict[str, float] = {}

        def on_step(step: int, m: dict) -> None:
            if "eval/reward_mean" in m:
                last_eval["eval"] = m["eval/reward_mean"]
            info = f"reward {m.get('rollout/reward_mean', 0):.3f}  {m.get('time/step', 0):.2f}s/step"
            if last_eval:
                info += f"  eval {last_eval['eval']:.3f}"
            progress.update(bar, completed=step + 1, info=info)

        STEP_LISTENERS.append(on_step)
        try:
            final = post_train.with_options(
                retries=cfg.orchestration.flow_retries, retry_delay_seconds=cfg.orchestration.retry_delay_s
            )(cfg)
        finally:
            STEP_LISTENERS.remove(on_step)
    print(f"done: run '{cfg.name}' in store {cfg.storage.uri}; MLflow at {cfg.tracking.uri} "
          f"(experiment '{cfg.tracking.experiment}')")
    for k in ("rollout/reward_mean", "eval/reward_mean", "eval/accuracy"):
        if k in final:
            print(f"  {k} = {final[k]:.4f}")
    return 0


def cmd_data_make(args) -> int:
    from engines.builtin_tasks import write_task_files

    cfg = BuiltinTaskConfig(task=args.task, num_digits=args.num_digits, num_train=args.num_train,
                            num_eval=args.num_eval, seed=args.seed)
    write_task_files(cfg, args.train, args.eval)
    print(f"wrote {args.train}" + (f" and {args.eval}" if args.eval else ""))
    return 0


def cmd_serve(args) -> int:
    """Prefect server + MLflow server + a process worker (and the deployments of prefect.yaml), until Ctrl-C."""
    from flows.serve import serve

    return serve(args.prefect_port, args.mlflow_port, deploy=not args.no_deploy)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rlflow", description="RL post-training for LLMs on Prefect + Ray.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, fn, text in (("run", cmd_run, "run or resume a recipe"), ("validate", cmd_validate, "check a recipe")):
        p = sub.add_parser(name, help=text)
        p.add_argument("recipe")
        p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY.PATH=VALUE",
                       help="override a recipe field, e.g. --set train.steps=20 (repeatable)")
        p.set_defaults(fn=fn)
    for name, fn, text in (("resume", cmd_resume, "continue a run from its store"),
                           ("runs", cmd_runs, "list the runs in a store"),
                           ("export", cmd_export, "write a checkpoint as a Hugging Face model directory")):
        p = sub.add_parser(name, help=text)
        if name != "runs":
            p.add_argument("run")
        if name == "export":
            p.add_argument("out")
            p.add_argument("--step", type=int, help="checkpoint step (default: the newest committed)")
        p.add_argument("--store", default="runs", help="run store root (default: runs)")
        p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY.PATH=VALUE",
                       help="override a field (storage.endpoint_url=..., train.steps=...)")
        p.set_defaults(fn=fn)
    data = sub.add_parser("data", help="built-in datasets").add_subparsers(dest="data_command", required=True)
    make = data.add_parser("make", help="write a built-in verifiable task as train/eval files")
    make.add_argument("--task", choices=["sort", "reverse", "add"], required=True)
    make.add_argument("--num-digits", type=int, default=4)
    make.add_argument("--num-train", type=int, default=20000)
    make.add_argument("--num-eval", type=int, default=256)
    make.add_argument("--seed", type=int, default=1234)
    make.add_argument("--train", required=True)
    make.add_argument("--eval")
    make.set_defaults(fn=cmd_data_make)
    serve = sub.add_parser("serve", help="local Prefect server, MLflow server and worker (the UIs on a laptop)")
    serve.add_argument("--prefect-port", type=int, default=4200)
    serve.add_argument("--mlflow-port", type=int, default=5000)
    serve.add_argument("--no-deploy", action="store_true", help="do not run `prefect deploy --all`")
    serve.set_defaults(fn=cmd_serve)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
