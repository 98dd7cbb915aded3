"""prefect.yaml end to end: a Prefect server (SQLite) and an MLflow server started here, `prefect deploy --all`,
a process worker, and the pipeline deployment triggered through the API: post-train -> evaluate -> register.

The worker runs flows in this checkout (RLFLOW_HOME), as prefect.yaml's pull step says; everything a run
writes goes under the test's tmp directory through the parameters (store, data, MLflow server).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.config import EvaluationConfig, PipelineConfig, RLConfig, load_recipe, public_tree
from rlflow.flows.serve import (
    REPO,
    Services,
    deploy_all,
    ensure_work_pool,
    start_mlflow_server,
    start_prefect_server,
    start_worker,
)

DEPLOYMENTS = ("post-train/post-train", "evaluate/evaluate", "pipeline/pipeline")
FLOW_CONFIGS = {"rlflow.flows.post_train:post_train": RLConfig, "rlflow.flows.evaluate:evaluate": EvaluationConfig,
                "rlflow.flows.pipeline:pipeline": PipelineConfig}


POOLS = ("rlflow-process", "rlflow-control")  # prefect.yaml's: training and evaluation, and the pipeline


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A Prefect server (SQLite in a temporary PREFECT_HOME) with the deployments of prefect.yaml."""
    tmp = tmp_path_factory.mktemp("stack")
    svc = Services()
    try:
        api = start_prefect_server(svc, free_port(), home=tmp / "prefect", log=tmp / "prefect.log")
        for pool in POOLS:
            ensure_work_pool(api, pool)
        deploy_all(api)
        yield {"api": api, "tmp": tmp, "services": svc}
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def stack(deployed):
    """... plus an MLflow server and a process worker running flows in this checkout."""
    tmp, svc = deployed["tmp"], deployed["services"]
    mlflow_uri = start_mlflow_server(svc, free_port(), f"sqlite:///{tmp}/mlflow.db", tmp / "mlartifacts",
                                     log=tmp / "mlflow.log")
    env = os.environ | {"PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_HOME": str(tmp / "prefect"),
                        "PREFECT_LOGGING_LEVEL": "INFO"}
    for pool in POOLS:
        start_worker(svc, deployed["api"], REPO, pool, env=env, log=tmp / f"worker-{pool}.log")
    return deployed | {"mlflow": mlflow_uri}


def client_for(api: str):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(api)


def test_deployments_and_their_parameter_schema(deployed):
    """prefect.yaml deployed: training and evaluation on the process pool, the pipeline on the control pool (it
    waits for the runs it starts), each with the checkout pull step, a default recipe, and the config tree (types,
    defaults, descriptions) as its parameter schema."""
    with client_for(deployed["api"]) as client:
        deployments = {name: client.read_deployment_by_name(name) for name in DEPLOYMENTS}
    for name, d in deployments.items():
        assert d.work_pool_name == ("rlflow-control" if name.startswith("pipeline/") else "rlflow-process"), name
        assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory":
                                 {"directory": "{{ $RLFLOW_HOME }}"}}]
        assert (REPO / d.parameters["recipe"]).is_file()
        # the run form's prefill: the recipe, read by the build step at deploy time (docs/deployments.md)
        model = FLOW_CONFIGS[d.entrypoint]
        assert d.parameters["config"] == public_tree(load_recipe(REPO / d.parameters["recipe"], model=model))
        assert not d.enforce_parameter_schema  # a part of `config` is merged by the flow, not refused by the server
    schemas = {name: d.parameter_openapi_schema for name, d in deployments.items()}
    train = schemas["post-train/post-train"]
    assert set(train["properties"]) == {"config", "recipe", "overrides"}
    defs = train["definitions"]
    rl = defs["RLConfig"]["properties"]
    assert {"model", "data", "rollout", "algorithm", "train", "storage", "tracking"} <= set(rl)
    steps = defs["TrainConfig"]["properties"]["steps"]
    assert steps["type"] == "integer" and steps["default"] == 100 and steps["description"] == "RL iterations."
    assert defs["RolloutConfig"]["properties"]["temperature"]["type"] == "number"
    assert defs["AlgorithmConfig"]["properties"]["advantage"]["enum"][0] == "grpo"
    assert defs["DataConfig"]["required"] == ["train_path"]
    assert defs["StorageConfig"]["properties"]["secret"]["anyOf"][0]["format"] == "password"
    ev = schemas["evaluate/evaluate"]["definitions"]
    assert ev["EvaluationConfig"]["properties"]["checkpoint"]["type"] == "string"
    assert ev["EvalSamplingConfig"]["properties"]["samples_per_prompt"]["type"] == "integer"
    pipe = schemas["pipeline/pipeline"]["definitions"]
    assert pipe["PromoteConfig"]["properties"]["threshold"]["anyOf"][0]["type"] == "number"
    assert pipe["PromoteConfig"]["properties"]["min_delta"]["minimum"] == 0
    assert pipe["PipelineConfig"]["properties"]["train_recipe"]["type"] == "string"


def prefect_cli(deployed: dict, *args: str) -> subprocess.CompletedProcess:
    """`prefect ARGS` as a user types it (the environment's `prefect` script) against the test's server."""
    script = Path(sys.executable).with_name("prefect")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "prefect"]
    env = os.environ | {"PREFECT_API_URL": deployed["api"], "PREFECT_HOME": str(deployed["tmp"] / "prefect"),
                        "COLUMNS": "250"}  # rich's tables: wide enough that no name is cut
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300)


def test_prefect_cli_lists_and_read_logs(deployed):
    """The Prefect CLI's listings and the client's read_logs() work against the server: Prefect 3.8.8's client
    sends `null` for every body field it leaves unset (limit, sort, filters), which FastAPI >= 0.151 answers
    with 422 (constraints.txt pins 0.150; docs/operations.md, Deploy)."""
    import fastapi
    from prefect.client.schemas.actions import LogCreate
    from prefect.states import Cancelled

    with client_for(deployed["api"]) as client:
        deployment = client.read_deployment_by_name("evaluate/evaluate")
        # a final state: a worker (the slow test's, on this server) must not run it
        run = client.create_flow_run_from_deployment(deployment.id, name="cli-listed-run", state=Cancelled())
        try:
            client.create_logs([LogCreate(name="rlflow.test", level=20, message="cli-listed log",
                                          timestamp=datetime.now(UTC), flow_run_id=run.id)])
            assert "cli-listed log" in [log.message for log in client.read_logs()]  # no limit, offset nor filter
            listings = {
                "deployment ls": ("post-train/post-train", "evaluate/evaluate", "pipeline/pipeline"),
                "flow-run ls": ("cli-listed-run", "evaluate"),
                "work-pool ls": ("rlflow-process",),
            }
            for command, names in listings.items():
                done = prefect_cli(deployed, *command.split())
                assert done.returncode == 0, (f"prefect {command} (fastapi {fastapi.__version__}):\n"
                                              f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
                for name in names:
                    assert name in done.stdout, (command, name, done.stdout)
        finally:
            client.delete_flow_run(run.id)  # the slow test below counts the server's flow runs


def tiny_pipeline(tmp: Path, mlflow_uri: str) -> dict:
    """The demo recipe cut to two steps of a one-layer model, everything written under tmp."""
    return {
        "train_recipe": "deployments/sort-tiny.yaml",
        "train_overrides": [
            "name=e2e", f"data.train_path={tmp}/data/train.jsonl", f"data.eval_path={tmp}/data/eval.jsonl",
            "data.generate.num_train=200", "data.generate.num_eval=16", "model.hidden_size=32",
            "model.intermediate_size=64", "model.num_layers=1", "rollout.prompts_per_step=8",
            "rollout.samples_per_prompt=4", "train.steps=2", "train.mini_batches=1", "train.epochs=1",
            "train.threads=1", "eval.every=1", "eval.max_prompts=8", "checkpoint.every=0",
            f"storage.uri={tmp}/runs", f"tracking.uri={mlflow_uri}", "cluster.use_ray=false",
        ],
        "eval": {"samples_per_prompt": 4, "pass_k": [1, 4], "max_prompts": 8, "threads": 1},
        "registry": {"model_name": "e2e-model"},
        "promote": {"metric": "accuracy", "threshold": 0.0, "min_delta": 0.0},
    }


def wait_final(client, flow_run_id, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state.is_final():
            return run
        time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} not finished after {timeout} s (state {run.state.name})")


@pytest.mark.slow  # ~3 min on a loaded 2-core machine: three flow-run processes start (tests/test_evaluation.py
# runs the evaluate and register flows in the default suite)
def test_pipeline_deployment_trains_evaluates_registers(stack, tmp_path):
    import httpx
    from prefect.client.schemas.objects import Artifact
    from prefect.client.schemas.sorting import FlowRunSort

    with client_for(stack["api"]) as client:
        deployment = client.read_deployment_by_name("pipeline/pipeline")
        params = {"config": tiny_pipeline(tmp_path, stack["mlflow"])}  # beside the deployment's default recipe
        run = client.create_flow_run_from_deployment(deployment.id, parameters=params)
        run = wait_final(client, run.id, timeout=300)
        runs = client.read_flow_runs(sort=FlowRunSort.ID_DESC, limit=50)
        states = {client.read_flow(r.flow_id).name: r.state.type.value for r in runs}
        log = (stack["tmp"] / "worker-rlflow-process.log").read_text()[-3000:]
        assert run.state.is_completed(), (run.state, states, log)
        assert states == {"pipeline": "COMPLETED", "post-train": "COMPLETED", "evaluate": "COMPLETED",
                          "register": "COMPLETED"}, states
        assert {r.name for r in runs} >= {"e2e-train", "e2e-eval-step1", "e2e-register-step1"}  # named in the UI

        def artifacts(key: str) -> list[Artifact]:
            # the API directly, newest first (before the FastAPI pin, the client's null fields got a 422 here)
            body = {"artifacts": {"key": {"any_": [key]}}, "sort": "UPDATED_DESC", "limit": 10, "offset": 0}
            response = httpx.post(f"{stack['api']}/artifacts/filter", json=body, timeout=30)
            response.raise_for_status()
            return [Artifact.model_validate(a) for a in response.json()]

        metrics = artifacts("e2e-eval-metrics")
        assert metrics and metrics[0].type == "table" and "pass_at_4" in str(metrics[0].data)
        report = artifacts("e2e-eval-report")
        assert report and report[0].type == "markdown" and "| data |" in report[0].data  # data/eval.jsonl: "data"
        promotion = artifacts("e2e-promotion")
        assert promotion and promotion[0].type == "markdown" and "e2e-model@1: promoted" in promotion[0].data
        assert artifacts("e2e-progress")[0].type == "progress" and artifacts("e2e-progress")[0].data == 100.0
        assert artifacts("e2e-checkpoint")[0].type == "markdown" and "step 1" in artifacts("e2e-checkpoint")[0].data
        assert artifacts("e2e-samples")[0].type == "table"

    ml = MlflowClient(stack["mlflow"])
    versions = ml.search_model_versions("name = 'e2e-model'")
    assert len(versions) == 1
    v = versions[0]
    # the evaluate flow logs eval/<dataset>/<metric>; the recipe's one eval file, <tmp>/data/eval.jsonl, is "data"
    assert v.tags["rlflow.metric"] == "eval/data/accuracy" and v.tags["rlflow.checkpoint"].endswith("e2e/checkpoints/1")
    # the first version, above the threshold: champion and challenger, with its lineage and the export check
    aliases = {k: int(x) for k, x in ml.get_registered_model("e2e-model").aliases.items()}
    assert aliases == {"champion": 1, "challenger": 1}
    assert v.tags["rlflow.promotion"] == "promoted" and v.tags["rlflow.export_check"].startswith("passed")
    assert v.tags["rlflow.parent_model"].startswith("builtin:llama-32x1") and v.tags["rlflow.step"] == "1"
    assert len(v.tags["rlflow.lineage.data.train"]) == 64 and len(v.tags["rlflow.eval_hash"]) == 64
    eval_run = ml.get_run(v.run_id)
    assert {f"eval/data/{k}" for k in ("accuracy", "reward_mean", "pass_at_1", "pass_at_4", "response_len_mean")} <= \
        set(eval_run.data.metrics)
    training = ml.get_run(eval_run.data.tags["rlflow.training_run_id"])
    assert training.info.run_name == "e2e" and eval_run.data.tags["mlflow.parentRunId"] == training.info.run_id
    # MLflow 3 keeps a logged model's files with the logged model, not in its run's artifacts; the version's source
    # names it (models:/<model id>; its registry store leaves the version's model_id empty)
    assert v.source.startswith("models:/m-"), v.source
    location = ml.get_logged_model(v.source.removeprefix("models:/")).artifact_location
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=str(tmp_path / "version"),
                                                     tracking_uri=stack["mlflow"]))
    files = {p.name for p in local.rglob("*") if p.is_file()}
    assert {"MLmodel", "model.safetensors", "config.json", "tokenizer.json"} <= files, files
    assert not any(f.endswith((".pkl", ".pt", ".bin")) for f in files)
