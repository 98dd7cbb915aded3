"""post-train -> evaluate -> register and promote, each stage its own flow run.

Training and evaluation are started through their deployments (`run_deployment`), not called as
subflows: each runs in its own process on a worker (its own memory, Ray, MLflow run), shows in the UI
as a child of this pipeline run, and, being a deployment run, can be retried alone from the UI. A stage
is started with an idempotency key made of this pipeline run's id and the stage, so a retried pipeline
run reuses a stage run that completed (also one retried by hand) and starts a new one only for a stage
that failed. Registration is quick and needs nothing but MLflow, so it runs as a subflow in this process.

Promotion (flows/promotion.py) compares the candidate with the registered champion on the same metric measured by
the same evaluation: the champion's recorded value when its evaluation had this one's hash, else the champion's
checkpoint evaluated again here, through the same evaluate deployment (a stage of its own). The decision is the
register subflow's, and a markdown artifact of this run says it with its numbers. See docs/operations.md.
"""

from __future__ import annotations

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from prefect import flow
from prefect.artifacts import create_markdown_artifact
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
from rlflow.engines.models.hf import prompt_input
from rlflow.engines.session.evaluation import eval_rows
from rlflow.engines.store.run_store import RunStore, StorageError, locate_checkpoint
from rlflow.engines.train.export_check import CHECK_PROMPTS
from rlflow.flows.promotion import EVAL_HASH_TAG, evaluation_hash, evaluation_settings, fmt, remeasured_tag
from rlflow.flows.register import CHAMPION, ChampionMeasurement, Measurement, register_model
from rlflow.tasks.artifacts import artifact_key

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


def eval_mlflow_run(tracking_uri: str, experiment: str, prefect_flow_run_id: str) -> Run:
    """The MLflow run the evaluate flow run logged to (it tags it with its Prefect flow run id)."""
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{prefect_flow_run_id}'",
                              order_by=["attributes.start_time DESC"], max_results=1) if exp else []
    if not runs:
        raise StageFailed(f"stage evaluate: no MLflow run tagged with flow run {prefect_flow_run_id} in {tracking_uri}")
    return runs[0]


def logged_value(run: Run, metric_key: str, what: str) -> float:
    """`metric_key` of an evaluation run; a ValueError naming promote.metric / promote.dataset if it was not
    measured."""
    logged = run.data.metrics
    if metric_key not in logged:
        raise ValueError(f"promote.metric / promote.dataset: {metric_key!r} was not measured by {what}; the "
                         f"evaluation logged {sorted(logged)}")
    return logged[metric_key]


def evaluate_stage(cfg: PipelineConfig, evaluation: EvaluationConfig, stage: str, name: str) -> Run:
    """Run the evaluate deployment on `evaluation` as stage `stage` of this pipeline run; its MLflow run."""
    run = run_stage(cfg.eval_deployment, {"config": public_tree(evaluation), "recipe": None, "overrides": None},
                    stage, name)  # credentials: the worker's environment
    return eval_mlflow_run(evaluation.tracking.uri, evaluation.tracking.experiment, str(run.id))


def champion_value(cfg: PipelineConfig, train: RLConfig, evaluation: EvaluationConfig, eval_hash: str,
                   metric_key: str) -> ChampionMeasurement | None:
    """The current champion's `metric_key` under this very evaluation: recorded, when the champion's own evaluation
    (or an earlier re-evaluation) had this hash; else measured now by evaluating its checkpoint with the same
    settings, a stage of this pipeline run. None when the model has no champion."""
    client = MlflowClient(train.tracking.uri)
    name = cfg.registry.model_name
    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None  # no such model yet, or no champion
    version = int(champion.version)
    recorded = champion.tags.get("rlflow.eval_run_id") if champion.tags.get(EVAL_HASH_TAG) == eval_hash else None
    run_id = recorded or champion.tags.get(remeasured_tag(eval_hash))
    if run_id:
        value = logged_value(client.get_run(run_id), metric_key, f"the evaluation of champion {name}@{version}")
        return ChampionMeasurement(version=version, value=value, eval_run_id=run_id,
                                   how="recorded" if recorded else "re-evaluated earlier")
    checkpoint = champion_checkpoint(champion, train)
    again = evaluation.model_copy(update={"checkpoint": checkpoint, "training_run_id": None,
                                          "name": f"{train.name}-eval-champion-v{version}"})
    run = evaluate_stage(cfg, again, f"evaluate-champion-v{version}", f"{train.name}-eval-{name}-v{version}")
    value = logged_value(run, metric_key, f"the evaluation of champion {name}@{version}")
    client.set_model_version_tag(name, str(version), remeasured_tag(eval_hash), run.info.run_id)
    return ChampionMeasurement(version=version, value=value, eval_run_id=run.info.run_id, how="re-evaluated")


def champion_checkpoint(champion, train: RLConfig) -> str:
    """The champion's checkpoint, to evaluate it again; a StageFailed saying why it cannot be."""
    where = f"champion {champion.name}@{champion.version}"
    checkpoint = champion.tags.get("rlflow.checkpoint")
    if not checkpoint:
        raise StageFailed(f"{where} has no rlflow.checkpoint tag (registered by hand?), and its metric was not "
                          "measured by this evaluation: move the champion alias or evaluate it alike")
    try:
        locate_checkpoint(checkpoint, train.storage)
    except StorageError as e:
        raise StageFailed(f"{where} was measured by another evaluation and its checkpoint cannot be evaluated "
                          f"again ({e}); run the pipeline with the champion's evaluation settings, or move the "
                          "champion alias") from None
    return checkpoint


def check_prompts(evaluation: EvaluationConfig) -> list:
    """The first eval prompts, which the export check scores (with the evaluation's prompt rendering)."""
    first = evaluation.eval.datasets[0]
    rows = eval_rows(first, evaluation.eval, evaluation.storage.fsspec_options(first.path))[:CHECK_PROMPTS]
    return [prompt_input(r) for r in rows]


def promotion_report(checkpoint: str, measured: Measurement, champion: ChampionMeasurement | None,
                     result: dict, cfg: PipelineConfig) -> str:
    """The pipeline run's markdown artifact: the decision, its numbers and the aliases after it."""
    p = cfg.promote
    model = cfg.registry.model_name
    champ = f"{model}@{champion.version}: {fmt(champion.value)} ({champion.how})" if champion else "none"
    return "\n".join([
        f"# Promotion of {model}@{result['version']}: {result['promotion']}",
        "",
        f"{result['reason']}",
        "",
        "| | |", "| --- | --- |",
        f"| checkpoint | `{checkpoint}` |",
        f"| metric | `{measured.metric_key}` ({'higher' if p.higher_is_better else 'lower'} is better) |",
        f"| candidate | {fmt(measured.value)} |",
        f"| champion before | {champ} |",
        f"| min_delta | {fmt(p.min_delta)} |",
        f"| threshold | {fmt(p.threshold)} |",
        f"| evaluation hash | `{measured.eval_hash[:16]}` |",
        f"| aliases now | champion: {result['champion']}, challenger: {result['challenger']} |",
        f"| export check | {result['export_check']} |",
    ])


@flow(name="pipeline", log_prints=True, validate_parameters=False)  # a part of `config` is no PipelineConfig
def pipeline(
    config: PipelineConfig | None = None, recipe: str | None = None, overrides: list[str] | None = None
) -> dict:
    """Train a recipe, evaluate its last checkpoint, register it, and promote it if it beats the champion.

    Args:
        config: The configuration tree (PipelineConfig), whole or in part: deep-merged over `recipe`
            (docs/deployments.md). A deployment's run form opens with its recipe here.
        recipe: A recipe file relative to the working directory, read as the CLI reads it
            (e.g. deployments/pipeline-sort-tiny.yaml): the base that `config` merges into.
        overrides: KEY.PATH=VALUE changes applied last (e.g. promote.min_delta=0.02).
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
    mlflow_run = evaluate_stage(cfg, evaluation, "evaluate", f"{train.name}-eval-step{step}")
    eval_hash = evaluation_hash(evaluation_settings(evaluation))  # the data as evaluated (training may write it)
    dataset = cfg.promote.dataset or evaluation.eval.datasets[0].key
    metric_key = f"eval/{dataset}/{cfg.promote.metric}"  # as the evaluate flow names it
    measured = Measurement(metric_key=metric_key, value=logged_value(mlflow_run, metric_key, "the evaluation"),
                           eval_run_id=mlflow_run.info.run_id, eval_hash=eval_hash)
    champion = champion_value(cfg, train, evaluation, eval_hash, metric_key)

    register = register_model.with_options(flow_run_name=f"{train.name}-register-step{step}")
    result = register(checkpoint, measured, champion, cfg.registry, cfg.promote, train.tracking.uri, train.storage,
                      mlflow_run.data.tags.get("rlflow.training_run_id"), check_prompts(evaluation),
                      bool(evaluation.eval.chat_template))
    create_markdown_artifact(promotion_report(checkpoint, measured, champion, result, cfg),
                             key=artifact_key(train.name, "promotion"),
                             description=f"{cfg.registry.model_name}: promotion of {checkpoint}")
    return {"checkpoint": checkpoint, metric_key: measured.value,
            "champion_value": champion.value if champion else None, **result}
