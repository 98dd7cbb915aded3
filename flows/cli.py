"""The `rlflow` command: run, validate, and make built-in task data.

    rlflow run deployments/sort-tiny.yaml [--set train.steps=20 --set tracking.uri=...]
    rlflow sft deployments/sort-tiny-sft.yaml            supervised fine-tuning (flows/sft.py)
    rlflow rejection-sample deployments/sort-tiny-sft.yaml   generate, keep verified, SFT (flows/rejection_sampling.py)
    rlflow validate deployments/sort-tiny.yaml [--offline]   also tries the run store and MLflow
    rlflow runs [--store s3://bucket/runs]
    rlflow resume RUN [--store ...] [--set train.steps=200]
    rlflow export RUN OUT_DIR [--step N] [--store ...] [--adapter]   --adapter: a LoRA run's PEFT adapter
    rlflow run RECIPE --debug rollout_only [--trace-every 1]
    rlflow run RECIPE --debug train_only --replay OTHER_RUN [--replay-store s3://...]
    rlflow trace render FILE_OR_RUN --out timeline.png [--step N] [--store ...]
    rlflow data make --task sort --num-digits 4 --train data/sort4/train.jsonl --eval data/sort4/eval.jsonl \
        [--sft data/sort4/sft.jsonl]
    rlflow data gsm8k --input gsm8k/main/train-00000-of-00001.parquet --out data/gsm8k/train.jsonl
    rlflow init [DIR]                                     prefect.yaml + the demo recipes, into DIR (default: .)
    rlflow serve [--prefect-port 4200] [--mlflow-port 5000] [--no-deploy]   from the project directory
    rlflow lineage sort-tiny@champion [--tracking-uri http://127.0.0.1:5000]   a model version back to its base
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from rlflow.engines.core.config import (
    BuiltinTaskConfig,
    RecipeError,
    StorageConfig,
    apply_overrides,
    read_recipe,
)
from rlflow.engines.core.retry import RetryPolicy, ServiceError
from rlflow.engines.core.trace_render import load_trace, render
from rlflow.flows.project import ProjectError, init_project

# The subcommands import what only they need when they run, so `rlflow --help` and light commands start in
# a fraction of a second: torch, transformers, Ray, Prefect and MLflow take seconds to import, the run store
# (pyarrow, fsspec) and the data writers a tenth or more.


def _debug_overrides(args) -> list[str]:
    """--debug / --replay / --replay-store / --trace-every as recipe overrides (the `debug` section)."""
    out = []
    for flag, key in (("debug", "mode"), ("replay", "replay_run"), ("replay_store", "replay_store"),
                      ("trace_every", "trace_every")):
        if getattr(args, flag, None) is not None:
            out.append(f"debug.{key}={getattr(args, flag)}")
    return out


def _load(args) -> object:
    from rlflow.engines.session.preflight import check_recipe  # deferred: torch and transformers (seconds)

    return check_recipe(read_recipe(args.recipe, [*args.overrides, *_debug_overrides(args)]), args.recipe)


def cmd_validate(args) -> int:
    cfg = _load(args)
    if not args.offline:
        problems = _probe_services(cfg)
        if problems:
            raise RecipeError(args.recipe, problems)
    mode = f", debug {cfg.debug.mode}" if cfg.debug.mode else ""
    mode += f", replaying {cfg.debug.replay_run}" if cfg.debug.replay_run else ""
    mode += f"; sft: {cfg.sft.steps} steps" if cfg.sft.train_path else ""
    print(f"{args.recipe}: ok (run '{cfg.name}', {cfg.train.steps} RL steps{mode})")
    return 0


def _probe_services(cfg) -> list[str]:
    """What the run needs from outside, tried once with a short deadline: write, read and delete an object in
    the run store; one API call to the tracking server. One problem per service, naming its URI."""
    # deferred: the run store (pyarrow, fsspec) and MLflow (seconds)
    from rlflow.engines.store.run_store import RunStore, StorageError
    from rlflow.tasks.mlflow_client import TrackingUnavailable, probe_tracking

    quick = RetryPolicy(retries=1, deadline_s=min(10.0, cfg.storage.deadline_s))
    storage = cfg.storage.model_copy(update={"retries": quick.retries, "deadline_s": quick.deadline_s})
    problems = []
    try:
        RunStore(storage, cfg.name).probe()
    except StorageError as e:
        problems.append(f"storage.uri: the run store {cfg.storage.uri} cannot be used: {e}")
    try:
        probe_tracking(cfg.tracking.uri, quick, timeout_s=min(10.0, cfg.tracking.timeout_s))
    except TrackingUnavailable as e:
        problems.append(f"tracking.uri: {e}")
    return problems


def cmd_run(args) -> int:
    return _run(_load(args), takeover=args.takeover)


def cmd_sft(args) -> int:
    cfg = _load(args)
    prepare_flow_process()
    from rlflow.flows.sft import sft  # deferred: Prefect, Ray, torch (seconds), after Prefect's defaults

    return _run(cfg, sft, cfg.sft.steps, takeover=args.takeover)


def cmd_rejection_sample(args) -> int:
    cfg = _load(args)
    prepare_flow_process()
    from rlflow.flows.rejection_sampling import rejection_sampling  # deferred, as in cmd_sft

    return _run(cfg, rejection_sampling, cfg.sft.total_steps(rejection=True), takeover=args.takeover)


def _store_config(args):
    opts = {"uri": args.store}
    for text in args.overrides:
        if text.startswith("storage."):
            key, value = text.split("=", 1)
            opts[key.removeprefix("storage.")] = value
    return StorageConfig(**opts)


def cmd_resume(args) -> int:
    """Continue a run from its store: the stored recipe, with --set overrides on top."""
    # deferred: torch and transformers (preflight), pyarrow and fsspec (the run store)
    from rlflow.engines.session.preflight import check_recipe
    from rlflow.engines.store.run_store import RunStore

    store = RunStore(_store_config(args), args.run)
    if not store.exists("config.json"):
        print(f"error: no run '{args.run}' in {args.store} (no {store.uri('config.json')})", file=sys.stderr)
        return 2
    raw = apply_overrides(store.read_json("config.json"),
                          [f"storage.uri={args.store}", *args.overrides, *_debug_overrides(args)])
    cfg = check_recipe(raw, store.uri("config.json"))
    return _run(cfg, takeover=args.takeover)


def cmd_runs(args) -> int:
    from rlflow.engines.store.run_store import list_runs  # deferred: pyarrow and fsspec

    runs = list_runs(_store_config(args))
    if not runs:
        print(f"no runs in {args.store}")
    for r in runs:
        step = "-" if r["latest_step"] is None else r["latest_step"]
        print(f"{r['run']:<32} latest step {step!s:<8} {r.get('status', 'unknown')}")
    return 0


def cmd_export(args) -> int:
    """Copy a committed checkpoint's model/ (HF safetensors + config + tokenizer; a LoRA run's: merged) or, with
    --adapter, a LoRA run's adapter/ (PEFT's format) to a local directory."""
    from rlflow.engines.store.run_store import RunStore, StorageError  # deferred: pyarrow and fsspec

    store = RunStore(_store_config(args), args.run)
    try:
        step = store.committed_step(args.step)
    except StorageError as e:  # names the steps that exist
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.adapter:
        if not store.exists("checkpoints", step, "adapter", "adapter_config.json"):
            print(f"error: step {step} of '{args.run}' has no LoRA adapter (the run trains every weight: export "
                  "without --adapter)", file=sys.stderr)
            return 2
        store.download_checkpoint(step, out, only="adapter")
        print(f"exported the LoRA adapter of step {step} of '{args.run}' to {out} (load with "
              "peft.PeftModel.from_pretrained(base_model, out), or SGLang's /load_lora_adapter)")
        return 0
    store.export_model(step, out)
    config = out / "config.json"
    vision = config.is_file() and '"vision_config"' in config.read_text()  # Qwen2-VL's config has one
    auto = "AutoModelForImageTextToText and AutoImageProcessor" if vision else "AutoModelForCausalLM"
    print(f"exported step {step} of '{args.run}' to {out} (load with {auto}.from_pretrained)")
    return 0


def cmd_trace_render(args) -> int:
    """A PNG timeline of a trace file, or of a run's trace logged to MLflow (the newest, or --step)."""
    with tempfile.TemporaryDirectory() as tmp:
        if Path(args.source).is_file():
            path, title = Path(args.source), Path(args.source).name
        else:
            path = _download_trace(args, tmp)
            if path is None:
                return 2
            title = f"{args.source} {path.stem}"
        try:
            out = render(load_trace(path), args.out, title=title)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(f"wrote {out}")
    return 0


def _download_trace(args, tmp: str):
    """The run's traces/step_<N>.json from its MLflow run (found through the run store), or None."""
    # deferred: MLflow and, through tasks.stages, Prefect and torch (seconds)
    from rlflow.engines.store.run_store import RunStore
    from rlflow.tasks.mlflow_client import RetryingClient
    from rlflow.tasks.stages import trace_artifact

    store = RunStore(_store_config(args), args.source)
    if not store.exists("config.json"):
        print(f"error: {args.source} is neither a trace file nor a run in {args.store} "
              f"(no {store.uri('config.json')})", file=sys.stderr)
        return None
    tracking = store.read_json("config.json")["tracking"]["uri"]
    run_id = store.read_json("status.json").get("mlflow_run_id") if store.exists("status.json") else None
    client = RetryingClient(tracking, RetryPolicy(retries=1, deadline_s=10), timeout_s=10)  # a dead server: an error
    steps = sorted(int(a.path.rsplit("_", 1)[1].split(".")[0]) for a in client.list_artifacts(run_id, "traces")
                   ) if run_id else []
    if not steps:
        print(f"error: run {args.source} has no traces in MLflow ({tracking}); set debug.trace_every",
              file=sys.stderr)
        return None
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        print(f"error: run {args.source} has no trace of step {step}; traced steps: {steps}", file=sys.stderr)
        return None
    return Path(client.download_artifacts(run_id, trace_artifact(step), tmp))


def prepare_flow_process() -> None:
    """Settings of a process that runs flows, set before Prefect is first imported (it reads them once then),
    unless the environment sets them: quiet Prefect logs, and the temporary server's (flows/serve.py)."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # the progress bar says what the task logs would
    from rlflow.flows.serve import use_prefect_server_defaults  # deferred: httpx

    use_prefect_server_defaults()  # for the temporary server, when no PREFECT_API_URL is set


class _ServiceErrorsInOneLine(logging.Filter):
    """Prefect logs a failed flow run's exception with its traceback. A ServiceError names the service and where, a
    RecipeError (e.g. a finished run started again) the field, and `main` prints it: on the console its record
    keeps its one line, without the traceback (the Prefect run's own log keeps it: Prefect's API handler sees the
    record before the console's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], (ServiceError, RecipeError)):
            record.exc_info = record.exc_text = None
        return True


def _run(cfg, flow_fn=None, total: int | None = None, takeover: bool = False) -> int:
    """Run a flow (post_train by default) with a progress bar over its `total` steps. `takeover`: take the run's
    lease from a process that holds it (engines/store/lease.py), through the environment a flow run reads it from."""
    prepare_flow_process()
    logging.getLogger("rlflow").setLevel(logging.INFO)
    # deferred: Prefect (seconds), after the defaults above; rich.progress ~50 ms, 1/6 of `--help`
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rlflow.flows.temporary_server import guard_temporary_server, require_prefect_api, start_temporary_server_early

    guard_temporary_server()  # without PREFECT_API_URL: the temporary Prefect server dies with this process
    server_up = start_temporary_server_early()  # ... and starts while torch and the engines import
    # deferred until the server is starting: Prefect, Ray, torch (seconds)
    from rlflow.engines.cluster.termination import bound_exit_on_sigterm
    from rlflow.engines.store.lease import TAKEOVER_ENV
    from rlflow.flows.post_train import post_train
    from rlflow.tasks.run_context import STEP_LISTENERS

    server_up()
    require_prefect_api()  # with one: its server answers, or a ServiceError names it
    for handler in logging.getLogger().handlers:  # Prefect's console handler
        if not any(isinstance(f, _ServiceErrorsInOneLine) for f in handler.filters):
            handler.addFilter(_ServiceErrorsInOneLine())
    bound_exit_on_sigterm()  # SIGTERM: the run's status is written and the process ends within a deadline
    if takeover:
        os.environ[TAKEOVER_ENV] = "1"

    flow_fn = flow_fn or post_train
    total = total or cfg.train.steps

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"), transient=False,
    ) as progress:
        mode = f" [{cfg.debug.mode}]" if cfg.debug.mode else ""
        mode += f" [replay {cfg.debug.replay_run}]" if cfg.debug.replay_run else ""
        bar = progress.add_task(cfg.name + mode, total=total, info="starting engines...")
        last_eval: dict[str, float] = {}

        def on_step(step: int, m: dict) -> None:
            if "eval/reward_mean" in m:
                last_eval["eval"] = m["eval/reward_mean"]
            if "rollout/reward_mean" in m:
                info = f"reward {m['rollout/reward_mean']:.3f}  {m.get('time/step', 0):.2f}s/step"
            else:
                info = f"loss {m.get('train/loss', 0):.3f}"
            if cfg.debug.mode == "rollout_only":
                info += f"  {m.get('rollout/tokens_per_s', 0):.0f} tok/s"
            if last_eval:
                info += f"  eval {last_eval['eval']:.3f}"
            progress.update(bar, completed=step + 1, info=info)

        STEP_LISTENERS.append(on_step)
        try:
            final = flow_fn.with_options(
                retries=cfg.orchestration.flow_retries, retry_delay_seconds=cfg.orchestration.retry_delay_s
            )(cfg)
        finally:
            STEP_LISTENERS.remove(on_step)
    print(f"done: run '{cfg.name}' in store {cfg.storage.uri}; MLflow at {cfg.tracking.uri} "
          f"(experiment '{cfg.tracking.experiment}')")
    for k in ("rollout/reward_mean", "rollout/tokens_per_s", "train/loss", "rs/pool", "eval/reward_mean",
              "eval/accuracy"):
        if k in final:
            print(f"  {k} = {final[k]:.4f}")
    return 0


def cmd_data_make(args) -> int:
    from rlflow.engines.data.builtin_tasks import write_task_files  # deferred: numpy and pyarrow

    cfg = BuiltinTaskConfig(task=args.task, num_digits=args.num_digits, num_train=args.num_train,
                            num_eval=args.num_eval, seed=args.seed)
    if not (args.train or args.sft):
        print("error: data make: give --train and/or --sft (the files to write)", file=sys.stderr)
        return 2
    write_task_files(cfg, args.train, args.eval, args.sft)
    print("wrote " + ", ".join(p for p in (args.train, args.eval, args.sft) if p))
    return 0


def cmd_data_gsm8k(args) -> int:
    from rlflow.engines.data.math_reward import convert_gsm8k  # deferred: pyarrow and the math verifier

    n = convert_gsm8k(args.input, args.out, args.instruction)
    print(f"wrote {n} rows to {args.out} (prompt, label: the final answer, response: the worked solution)")
    return 0


def _takeover_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--takeover", action="store_true",
                   help="take the run over from another process that holds its lease (it stops at its next stage)")


def _debug_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("debug (the recipe's debug section; docs/debugging.md)")
    g.add_argument("--debug", choices=["rollout_only", "train_only"],
                   help="rollout_only: generate and score, no training; train_only: train on --replay's batches")
    g.add_argument("--replay", metavar="RUN", help="take each step's rollout batch from RUN's store")
    g.add_argument("--replay-store", metavar="URI", help="run store root of --replay (default: storage.uri)")
    g.add_argument("--trace-every", type=int, metavar="N", help="log a trace timeline to MLflow every N steps")


def cmd_init(args) -> int:
    """Write a starting prefect.yaml and the recipes it names into a project directory."""
    for path in init_project(Path(args.directory)):
        print(f"wrote {path}")
    print("next: `rlflow serve` in that directory (Prefect + MLflow UIs, the deployments of prefect.yaml)")
    return 0


def cmd_serve(args) -> int:
    """Prefect server + MLflow server + a process worker (and the deployments of ./prefect.yaml), until Ctrl-C or
    SIGTERM."""
    from rlflow.flows.pools import parse_limits
    from rlflow.flows.serve import serve  # deferred: httpx, and Prefect must not be imported before its defaults

    return serve(args.prefect_port, args.mlflow_port, deploy=not args.no_deploy, project=Path.cwd(),
                 pool_limits=parse_limits(args.pool_limit))


def cmd_lineage(args) -> int:
    """Print a registered version's lineage: each version back to the base model (flows/lineage.py)."""
    from rlflow.flows.lineage import DEFAULT_TRACKING_URI, print_lineage  # deferred: MLflow (seconds)

    return print_lineage(args.version, args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                         or DEFAULT_TRACKING_URI)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rlflow", description="RL post-training for LLMs on Prefect + Ray.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, fn, text in (("run", cmd_run, "run or resume a recipe"), ("validate", cmd_validate, "check a recipe"),
                           ("sft", cmd_sft, "supervised fine-tuning on the recipe's sft.train_path"),
                           ("rejection-sample", cmd_rejection_sample,
                            "generate, keep what the reward accepts, SFT on it (sft.rejection)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("recipe")
        p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY.PATH=VALUE",
                       help="override a recipe field, e.g. --set train.steps=20 (repeatable)")
        _debug_flags(p)
        if name != "validate":
            _takeover_flag(p)
        if name == "validate":
            p.add_argument("--offline", action="store_true",
                           help="check the recipe alone; do not try the run store and the tracking server")
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
            p.add_argument("--adapter", action="store_true",
                           help="a LoRA run's adapter in PEFT's format instead of the merged model")
        p.add_argument("--store", default="runs", help="run store root (default: runs)")
        p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY.PATH=VALUE",
                       help="override a field (storage.endpoint_url=..., train.steps=...)")
        if name == "resume":
            _debug_flags(p)
            _takeover_flag(p)
        p.set_defaults(fn=fn)
    trace = sub.add_parser("trace", help="rollout trace timelines").add_subparsers(dest="trace_command", required=True)
    render = trace.add_parser("render", help="draw a trace (file, or a run's trace in MLflow) as a PNG timeline")
    render.add_argument("source", metavar="FILE_OR_RUN", help="a Chrome trace JSON file, or a run name")
    render.add_argument("--out", required=True, help="PNG to write")
    render.add_argument("--step", type=int, help="traced step of the run (default: the newest)")
    render.add_argument("--store", default="runs", help="run store root of the run (default: runs)")
    render.add_argument("--set", action="append", default=[], dest="overrides", metavar="storage.KEY=VALUE",
                        help="storage options, e.g. --set storage.endpoint_url=http://minio:9000")
    render.set_defaults(fn=cmd_trace_render)
    data = sub.add_parser("data", help="built-in datasets").add_subparsers(dest="data_command", required=True)
    make = data.add_parser("make", help="write a built-in verifiable task as train/eval files")
    make.add_argument("--task", choices=["sort", "reverse", "add", "mul", "count"], required=True)
    make.add_argument("--num-digits", type=int, default=4)
    make.add_argument("--num-train", type=int, default=20000)
    make.add_argument("--num-eval", type=int, default=256)
    make.add_argument("--seed", type=int, default=1234)
    make.add_argument("--train", help="prompt/label file of the train split")
    make.add_argument("--eval", help="held-out prompt/label file")
    make.add_argument("--sft", help="the train split as SFT pairs (prompt, response: the correct answer)")
    make.set_defaults(fn=cmd_data_make)
    gsm = data.add_parser("gsm8k", help="convert GSM8K (parquet or JSONL with question/answer) to rlflow rows")
    gsm.add_argument("--input", required=True, help="GSM8K file, e.g. gsm8k/main/test-00000-of-00001.parquet")
    gsm.add_argument("--out", required=True, help=".jsonl or .parquet to write")
    gsm.add_argument("--instruction", default=None, help="text appended to each question (default: ask for "
                     "step-by-step reasoning and a final line '#### <answer>')")
    gsm.set_defaults(fn=cmd_data_gsm8k)
    init = sub.add_parser("init", help="write a starting prefect.yaml and recipes into a project directory")
    init.add_argument("directory", nargs="?", default=".", help="project directory (default: the current one)")
    init.set_defaults(fn=cmd_init)
    serve = sub.add_parser("serve", help="local Prefect server, MLflow server and worker (the UIs on a laptop), "
                           "for the project in the current directory")
    serve.add_argument("--prefect-port", type=int, default=4200,
                       help="port of the Prefect server and UI (default: 4200)")
    serve.add_argument("--mlflow-port", type=int, default=5000,
                       help="port of the MLflow tracking server and UI, where the deployments' runs log "
                       "(default: 5000)")
    serve.add_argument("--no-deploy", action="store_true",
                       help="start the services and the worker only; do not run `prefect deploy --all` on "
                       "./prefect.yaml")
    serve.add_argument("--pool-limit", action="append", default=[], metavar="POOL=N",
                       help="at most N flow runs at once on work pool POOL; more wait queued (repeatable; default: "
                       "prefect.yaml's definitions.pools)")
    serve.set_defaults(fn=cmd_serve)
    lineage = sub.add_parser("lineage", help="a registered model version's chain back to its base model")
    lineage.add_argument("version", metavar="NAME@VERSION", help="e.g. sort-tiny@3, or NAME@ALIAS: sort-tiny@champion")
    lineage.add_argument("--tracking-uri", default=None,
                         help="MLflow tracking URI of the registry (default: MLFLOW_TRACKING_URI, else "
                         "sqlite:///mlflow.db)")
    lineage.set_defaults(fn=cmd_lineage)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (RecipeError, ProjectError, ServiceError) as e:  # each names its field, file or service
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
