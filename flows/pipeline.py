"""post-train -> evaluate -> register, each stage its own flow run.

Training and evaluation are started through their deployments (`run_deployment`), not called as
subflows: each runs in its own process on a worker (its own memory, Ray, MLflow run), shows in the UI
as a child of this pipeline run, and, being a deployment run, can be retried alone from the UI. A stage
is started with an idempotency key made of this pipeline run's id and the stage, so a retried pipeline
run reuses a stage run that completed (also one retried by hand) and starts a new one only for a stage
that failed. Registration is quick and needs nothing but MLflow, so it runs as a subflow in this process.
See docs/operations.md.
"""

from __future__ import annotations

from mlflow.tracking import MlflowClient
from prefect import flow
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.runtime import flow_run

from rlflow.engines.core.config import (
    EvalDatasetConfig,
    EvaluationConfig,
    PipelineConfig,
    RLConfig,
    load_recipe,
    public_tree,
    resolve_config,
)
from rlflow.engines.store.run_store import RunStore
from rlflow.flows.register import register_model

POLL_S = 2.0  # how often the pipeline asks the API whether a stage run has finished


class StageFailed(RuntimeError):
    """A stage's flow run did not complete; the message says which run and how to go on."""


def run_stage(deployment: str, parameters: dict, stage: str, name: str) -> FlowRun:
    """Start (or, for a retried pipeline run, reuse) the stage's flow run of `deployment`, named `name` in the UI
    (e.g. sort-tiny-train, sort-tiny-eval-step99), and wait for it."""
    key = f"{flow_run.id}:{stage}"
    run = run_deployment(deployment, parameters=parameters, idempotency_key=key, poll_interval=POLL_S,
                         flow_run_name=name)
    if not run.state.is_completed() and flow_run.run_count > 1:
        # an earlier attempt of this pipeline run left the stage failed: run it again (training resumes)
        run = run_deployment(deployment, parameters=parameters, idempotency_key=f"{key}:{flow_run.run_count}",
                             poll_interval=POLL_S, flow_run_name=name)
    if not run.state.is_completed():
        raise StageFailed(f"stage {stage}: flow run {run.name} ({run.id}) of {deployment} ended {run.state.name}; "
                          "retry it from the UI and then this pipeline run, or retry this pipeline run")
    return run


def eval_config(cfg: PipelineConfig, train: RLConfig, checkpoint: str) -> EvaluationConfig:
    """The evaluation of the trained checkpoint: the pipeline's eval settings, with the training recipe's
    reward, tracking, store, held-out data and prompt rendering (data.chat_template) filling what the pipeline
    leaves empty."""
    e = cfg.eval
    datasets = e.datasets
    if not datasets:
        if not train.data.eval_path:
            raise ValueError(f"eval.datasets: empty, and {cfg.train_recipe} has no data.eval_path to evaluate on")
        datasets = [EvalDatasetConfig(path=train.data.eval_path, prompt_key=train.data.prompt_key,
                                      label_key=train.data.label_key)]
    chat = train.data.chat_template if e.chat_template is None else e.chat_template  # prompts rendered as in training
    e = e.model_copy(update={"datasets": datasets, "max_new_tokens": e.max_new_tokens or train.rollout.max_new_tokens,
                             "chat_template": chat})
    return EvaluationConfig(name=f"{train.name}-eval", checkpoint=checkpoint, eval=e, reward=train.reward,
                            tracking=train.tracking, storage=train.storage)


def eval_mlflow_run(tracking_uri: str, experiment: str, prefect_flow_run_id: str):
    """The MLflow run the evaluate flow run logged to (it tags it with its Prefect flow run id)."""
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{prefect_flow_run_id}'",
                              order_by=["attributes.start_time DESC"], max_results=1) if exp else []
    if not runs:
        raise StageFailed(f"stage evaluate: no MLflow run tagged with flow run {prefect_flow_run_id} in {tracking_uri}")
    return runs[0]


@flow(name="pipeline", log_prints=True, validate_parameters=False)  # a part of `config` is no PipelineConfig
def pipeline(
    config: PipelineConfig | None = None, recipe: str | None = None, overrides: list[str] | None = None
) -> dict:
    """Train a recipe, evaluate its last checkpoint, register it if the metric earns it.

    Args:
        config: The configuration tree (PipelineConfig), whole or in part: deep-merged over `recipe`
            (docs/deployments.md). A deployment's run form opens with its recipe here.
        recipe: A recipe file relative to the working directory, read as the CLI reads it
            (e.g. deployments/pipeline-sort-tiny.yaml): the base that `config` merges into.
        overrides: KEY.PATH=VALUE changes applied last (e.g. registry.threshold=0.8).
    """
    cfg = resolve_config(PipelineConfig, config, recipe, overrides)
    train = load_recipe(cfg.train_recipe, cfg.train_overrides)  # the same file the training stage reads
    train.reward.only_fn(f"the pipeline's evaluate stage ({cfg.train_recipe})")  # fail before training, not after

    run_stage(cfg.train_deployment, {"config": None, "recipe": cfg.train_recipe, "overrides": cfg.train_overrides},
              "train", f"{train.name}-train")
    store = RunStore(train.storage, train.name)
    step = store.latest_step()
    if step is None:
        raise StageFailed(f"stage train: run {train.name} has no committed checkpoint in {train.storage.uri}")
    checkpoint = store.uri("checkpoints", step)

    evaluation = eval_config(cfg, train, checkpoint)
    params = public_tree(evaluation)  # credentials: the worker's environment
    eval_run = run_stage(cfg.eval_deployment, {"config": params, "recipe": None, "overrides": None}, "evaluate",
                         f"{train.name}-eval-step{step}")
    mlflow_run = eval_mlflow_run(train.tracking.uri, train.tracking.experiment, str(eval_run.id))

    dataset = cfg.registry.dataset or evaluation.eval.datasets[0].key
    metric_key = f"eval/{dataset}/{cfg.registry.metric}"  # as the evaluate flow names it
    logged = mlflow_run.data.metrics
    if metric_key not in logged:
        raise ValueError(f"registry.metric: {metric_key!r} was not measured; the evaluation logged {sorted(logged)}")
    value = logged[metric_key]
    register = register_model.with_options(flow_run_name=f"{train.name}-register-step{step}")
    result = register(checkpoint, metric_key, value, mlflow_run.info.run_id, cfg.registry, train.tracking.uri,
                      train.storage, mlflow_run.data.tags.get("rlflow.training_run_id"))
    return {"checkpoint": checkpoint, metric_key: value, **result}
