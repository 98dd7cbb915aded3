"""The demo recipe through the whole stack: Prefect flow -> Ray actors -> MLflow + run store.

These are the acceptance runs of the CPU demo (about five minutes each on 2 cores, slow mark): the recipe in
deployments/sort-tiny.yaml must reach held-out reward >= 0.95 within its 100 steps, synchronously and
in one-step-off async mode, that run also storing on S3 (the moto server) and failing once
midway so that its Prefect flow retry resumes from the S3 checkpoint. The default suite runs their twins: the demo
recipe cut to 20 steps, checked as the 100-step run is but for the bar, and ten steps of the async run on S3 through a
failure.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from rlflow.engines.core.config import load_recipe
from rlflow.engines.store.run_store import RunStore
from rlflow.flows.post_train import post_train
from tests.conftest import step_metrics

DEMO = Path(__file__).resolve().parent.parent / "deployments" / "sort-tiny.yaml"


def _run_demo(tmp_path: Path, *overrides: str, flow_retries: int = 0, listeners=()):
    cfg = load_recipe(DEMO, [
        f"data.train_path={tmp_path}/data/train.jsonl", f"data.eval_path={tmp_path}/data/eval.jsonl",
        f"storage.uri={tmp_path}/runs", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *overrides,
    ])
    by_step, state = step_metrics(  # a retried attempt's steps replace the failed attempt's
        lambda: post_train.with_options(retries=flow_retries, retry_delay_seconds=0)(cfg, return_state=True),
        listeners)
    _run_demo.flow_run_id = state.state_details.flow_run_id
    return cfg, [by_step[k] for k in sorted(by_step)], state.result()


def _prefect_logs(flow_run_id, expect: str, timeout_s: float = 30.0) -> list[str]:
    """The messages of a flow run's logs as the Prefect UI's Logs tab shows them, once one starts with `expect`
    (the API log handler sends in batches, every two seconds)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            messages: list[str] = []
            while True:  # page through them all
                page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200,
                                        offset=len(messages))
                messages += [entry.message for entry in page]
                if len(page) < 200:
                    break
            if any(m.startswith(expect) for m in messages) or time.monotonic() > deadline:
                return messages
            time.sleep(1)


def _logged_steps(cfg, key: str = "rollout/reward_mean") -> list[int]:
    """The steps at which the run's MLflow run logged `key`, as logged (a step logged twice appears twice)."""
    client = MlflowClient(cfg.tracking.uri)
    run = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])[0]
    return [m.step for m in client.get_metric_history(run.info.run_id, key)]


def _check_demo_run(tmp_path, *overrides: str) -> tuple[list[float], list[dict]]:
    """The demo recipe through the flow: its metrics, checkpoints, MLflow run and Prefect logs; the held-out
    rewards, in order, for the caller's bar, and every step's metrics."""
    cfg, history, final = _run_demo(tmp_path, *overrides)
    steps, every = cfg.train.steps, cfg.checkpoint.every
    evals = [m["eval/reward_mean"] for m in history if "eval/reward_mean" in m]
    assert len(history) == steps and final["eval/reward_mean"] == evals[-1]
    assert history[0]["rollout/reward_mean"] < 0.3
    assert all(m["rollout/weight_version"] == i for i, m in enumerate(history))  # on-policy: synced every step
    assert all(m["train/staleness_max"] == 0 for m in history)

    store = RunStore(cfg.storage.uri, cfg.name)
    assert store.committed_steps() == [every - 1, steps - 1] and store.latest_step() == steps - 1

    client = MlflowClient(cfg.tracking.uri)
    run = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == str(cfg.train.lr)
    logged = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert [m.step for m in logged] == list(range(steps))
    for key in ("train/loss", "train/grad_norm", "time/rollout", "time/train", "eval/reward_mean"):
        assert client.get_metric_history(run.info.run_id, key), key
    # held-out evaluations at weight versions: the base model (0), then after every eval.every updates
    eval_steps = [m.step for m in client.get_metric_history(run.info.run_id, "eval/reward_mean")]
    assert eval_steps == [0, *range(cfg.eval.every, steps + 1, cfg.eval.every)], eval_steps
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"recipe.json", "samples"} <= artifacts
    mlflow.set_tracking_uri(None)

    # the run's progress is in its Prefect logs (the UI's Logs tab): a summary line per step, the checkpoints
    messages = _prefect_logs(_run_demo.flow_run_id, expect=f"step {steps - 1} ({steps} of {steps})")
    assert any(m.startswith(f"step 0 (1 of {steps}): reward ") for m in messages), messages[:20]
    assert any(m.startswith(f"step {steps - 1} ({steps} of {steps}): reward ") and "eval reward" in m
               for m in messages)
    assert any(m.startswith(f"checkpoint step {steps - 1} committed") for m in messages)
    return evals, history


@pytest.mark.slow  # ~5 min on 2 cores; the default suite's twin is the 20-step run below
def test_demo_learns_and_is_tracked(tmp_path):
    """The 100-step demo reaches the bar, learns to end its answer (an unfinished response is no answer to the
    reward: it once filled its budget with `<unk>`, truncated 100 % at step 99), and the example of
    docs/operations.md, the model logged to MLflow and asked through pyfunc for more tokens than the answer needs,
    gives the answer and nothing after it."""
    from rlflow.flows.register import log_hf_model

    evals, history = _check_demo_run(tmp_path)
    assert len(evals) == 10 and evals[-1] >= 0.95, evals
    assert history[-1]["rollout/truncated"] <= 0.05, [m["rollout/truncated"] for m in history[-10:]]

    store = RunStore(str(tmp_path / "runs"), "sort-tiny")
    tracking = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking)
    run = client.search_runs([client.get_experiment_by_name("rlflow").experiment_id])[0]
    info = log_hf_model(tracking, run.info.run_id, store.export_model(99, tmp_path / "export"), "the demo")
    model = mlflow.pyfunc.load_model(info.model_uri)
    [text] = list(model.predict(["S4821="], params={"max_new_tokens": 8}))
    assert text.removeprefix("S4821=") == "1248", text  # the pipeline may return the prompt with the answer
    mlflow.set_tracking_uri(None)


def test_demo_learns_in_twenty_steps_and_is_tracked(tmp_path):
    """The demo recipe cut to 20 steps (its cosine schedule over 20): everything the 100-step run is checked for but the
    0.95 bar. Measured (seed 0, 2 cores): held-out reward 0.43 / 0.52 at steps 10 / 20 (untrained: about 0.09); the
    100-step run's were 0.42 / 0.52 there."""
    evals, _ = _check_demo_run(tmp_path, "train.steps=20", "checkpoint.every=10")
    assert len(evals) == 2 and evals[1] > evals[0] and evals[1] >= 0.45, evals


def test_one_step_off_async_on_s3_resumes_through_a_failure(tmp_path, s3_bucket, monkeypatch):
    """One-step-off async on S3 (the moto server), made small: the first attempt fails at step 8, the flow retry
    resumes from the S3 checkpoint of step 4, and every step trains on samples from exactly one version back.
    (That this mode reaches the demo's bar is the slow test below.)"""
    root, endpoint = s3_bucket
    monkeypatch.setenv("RLFLOW_FAULT", "train:8:before:raise")
    cfg, history, _ = _run_demo(tmp_path, "rollout.max_staleness=1", "name=sort-tiny-async-small", "train.steps=10",
                                "rollout.prompts_per_step=16", "train.epochs=1", "data.generate.num_train=2000",
                                "checkpoint.every=5", "eval.every=10", "eval.max_prompts=32",
                                f"storage.uri={root}", f"storage.endpoint_url={endpoint}", flow_retries=1)

    assert len(history) == 10
    store = RunStore(cfg.storage, cfg.name)
    assert store.committed_steps() == [4, 9] and store.read_json("status.json")["status"] == "finished"
    assert [m["rollout/weight_version"] for m in history] == [0] + list(range(9))
    assert [m["train/staleness_max"] for m in history] == [0] + [1] * 9
    assert sorted(_logged_steps(cfg)) == list(range(10))  # each step once: none lost, none repeated
    mlflow.set_tracking_uri(None)


@pytest.mark.slow
def test_demo_learns_one_step_off_async_on_s3_through_a_failure(tmp_path, s3_bucket, monkeypatch):
    root, endpoint = s3_bucket
    monkeypatch.setenv("RLFLOW_FAULT", "train:57:before:raise")  # the first attempt fails at step 57
    cfg, history, final = _run_demo(tmp_path, "rollout.max_staleness=1", "name=sort-tiny-async",
                                    f"storage.uri={root}", f"storage.endpoint_url={endpoint}", flow_retries=1)

    assert len(history) == 100
    assert final["eval/reward_mean"] >= 0.95, [m.get("eval/reward_mean") for m in history]
    store = RunStore(cfg.storage, cfg.name)
    assert store.committed_steps() == [49, 99] and store.read_json("status.json")["status"] == "finished"
    # step k trains on samples from weights k-1 (step 0: the initial weights), never older
    assert [m["rollout/weight_version"] for m in history] == [0] + list(range(99))
    assert [m["train/staleness_max"] for m in history] == [0] + [1] * 99
    assert all("time/rollout_wait" in m for m in history[:-1])
    mlflow.set_tracking_uri(None)


def _stored_versions(store: RunStore, step: int) -> tuple[np.ndarray, np.ndarray]:
    table = store.load_rollout(step)
    return (np.array(table.column("weight_version").to_pylist()), np.array(table.column("last_weight_version")
                                                                           .to_pylist()))


def test_k2_async_bounds_staleness_records_versions_and_resumes(tmp_path, monkeypatch):
    """rollout.max_staleness 2 through the flow: the rollouts of the next two steps run while a step trains and
    the weights are synced under them. Every sample records its first and last weight version, and the first is
    at most 2 behind the step that trains on it. The first attempt fails at step 6; the flow retry resumes from
    the checkpoint of step 5 and reuses the batch of step 6 that was generated ahead and stored (not generated
    again), and no step is lost or logged twice. (The demo recipe, made smaller: the demo learning with k = 2 is
    the slow test below.)"""
    monkeypatch.setenv("RLFLOW_FAULT", "train:6:before:raise")
    store_of = RunStore(str(tmp_path / "runs"), "sort-tiny-k2")
    seen: dict[int, int] = {}  # first attempt: mtime of each step's stored batch once the step was done

    def snapshot(step: int, _metrics: dict) -> None:
        if step not in seen:
            seen[step] = Path(store_of.path("steps", step, "rollout.parquet")).stat().st_mtime_ns

    cfg, history, _ = _run_demo(tmp_path, "rollout.max_staleness=2", "name=sort-tiny-k2", "train.steps=8",
                                "rollout.prompts_per_step=16", "train.epochs=1", "data.generate.num_train=2000",
                                "checkpoint.every=3", "checkpoint.keep_rollouts=true", "eval.every=8",
                                "eval.max_prompts=32", flow_retries=1, listeners=[snapshot])

    assert len(history) == 8
    store = RunStore(cfg.storage.uri, cfg.name)
    assert store.committed_steps() == [5, 7] and store.read_json("status.json")["status"] == "finished"
    for step, m in enumerate(history):
        first, last = _stored_versions(store, step)
        assert first.min() >= max(0, step - 2) and (first <= last).all() and last.max() <= step, step
        assert m["train/staleness_max"] == step - first.min() <= 2  # the trainer is at version `step`
        assert m["rollout/weight_version"] == first.min() and m["rollout/weight_version_last"] == last.max()
    assert max(m["train/staleness_max"] for m in history) >= 1  # it did run ahead
    # step 6's batch was generated ahead (during step 4) and stored; the resumed attempt reused it
    assert Path(store.path("steps", 6, "rollout.parquet")).stat().st_mtime_ns == seen[6]
    assert sorted(_logged_steps(cfg)) == list(range(8))  # each step once: none lost, none repeated
    mlflow.set_tracking_uri(None)


@pytest.mark.slow
def test_demo_learns_with_k2_async(tmp_path):
    """The demo recipe with rollout.max_staleness 2 reaches the demo's bar (held-out reward >= 0.95 within its 100
    steps) with samples up to two updates stale, given the staleness correction of docs/algorithms.md
    (is_correction: tis, i.e. decoupled PPO: the trainer's own logprobs are PPO's old policy, the recorded rollout
    logprobs the behaviour policy). Without it the same run ends at 0.947 (seed 0), just under the bar: the clip
    against a two-versions-old policy holds the updates back."""
    cfg, history, final = _run_demo(tmp_path, "rollout.max_staleness=2", "algorithm.is_correction=tis",
                                    "name=sort-tiny-k2-learns")

    assert len(history) == cfg.train.steps == 100
    assert final["eval/reward_mean"] >= 0.95, [m.get("eval/reward_mean") for m in history]
    assert max(m["train/staleness_max"] for m in history) <= 2
    assert max(m["train/staleness_max"] for m in history[2:]) >= 1
    mlflow.set_tracking_uri(None)
