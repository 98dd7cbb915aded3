"""Register an evaluated checkpoint as a model version, and promote it when it beats the champion.

Every candidate becomes a new version of `registry.model_name` with the alias `challenger`; `champion` moves to it
only when the gate (flows/promotion.py: `promote.*`) passes against the current champion. The decision and why,
with the numbers, go to the version's tags (`rlflow.promotion`, `rlflow.promotion_reason`), the evaluation run's
tags and the flow's return value; each version also carries its lineage (flows/lineage.py).

The version is the checkpoint's Hugging Face export (what `rlflow export` writes) logged with MLflow's transformers
flavor as a text-generation model of the evaluation run: safetensors weights and tokenizer files (no pickle) with an
MLmodel, so `mlflow.transformers.load_model` gives a pipeline and `mlflow.pyfunc.load_model` a model whose
`predict(prompts, params={"max_new_tokens": n})` generates. Before anything is registered, the export is checked
against the trainer's checkpoint and the logged model against the export (engines/train/export_check.py):
log-probs on fixed sequences within TOLERANCE, or no version.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
import mlflow.transformers
import safetensors
import tokenizers
import torch
import transformers
from huggingface_hub import ModelCard
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.models.model import ModelInfo
from mlflow.tracking import MlflowClient
from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema
from prefect import flow
from pydantic import BaseModel

from rlflow.engines.core.config import PromoteConfig, RegisterConfig, StorageConfig
from rlflow.engines.models.hf import load_tokenizer
from rlflow.engines.store.run_store import RunStore, locate_checkpoint
from rlflow.engines.train.export_check import ExportCheck, compare, hf_logprobs, verify_export
from rlflow.flows.lineage import lineage_tags
from rlflow.flows.promotion import EVAL_HASH_TAG, PROMOTED, Decision, decide
from rlflow.tasks.tracking import git_commit, recipe_hash

CHAMPION, CHALLENGER = "champion", "challenger"

# prompts in, generated text out; generation settings per call (the pipeline's generate() keyword arguments)
SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
    params=ParamSchema([ParamSpec("max_new_tokens", "long", 64), ParamSpec("do_sample", "boolean", False),
                        ParamSpec("temperature", "double", 1.0)]),
)


class Measurement(BaseModel):
    """The candidate's decisive metric, as its evaluation run logged it."""

    metric_key: str  # eval/<dataset>/<metric>
    value: float
    eval_run_id: str
    eval_hash: str  # flows/promotion.py: evaluation_hash of the evaluation that measured it


class ChampionMeasurement(BaseModel):
    """The champion's value of the same metric under the same evaluation (recorded, or measured again)."""

    version: int
    value: float
    eval_run_id: str
    how: str  # "recorded" (its own evaluation was this one) or "re-evaluated"


def log_hf_model(tracking_uri: str, run_id: str, model_dir: str | Path, description: str) -> ModelInfo:
    """Log a Hugging Face causal-LM directory as run `run_id`'s text-generation model (transformers flavor).
    Requirements are the installed versions, given rather than inferred (inference loads the model again in a
    subprocess); the model card is given so nothing is fetched from the Hub."""
    mlflow.set_tracking_uri(tracking_uri)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
    requirements = [f"{m.__name__}=={m.__version__.split('+')[0]}" for m in (transformers, torch, tokenizers,
                                                                             safetensors)]
    return mlflow.transformers.log_model(
        {"model": model, "tokenizer": load_tokenizer(model_dir)}, name="model", task="text-generation",
        signature=SIGNATURE, pip_requirements=requirements, model_card=ModelCard(description), run_id=run_id,
    )


def check_logged_model(model_uri: str, reference: dict) -> ExportCheck:
    """The model as MLflow loads it back gives the export's log-probs (same sequences, same tolerance)."""
    components = mlflow.transformers.load_model(model_uri, return_type="components")
    model = components["model"].float().eval()
    return compare(reference["logprobs"], hf_logprobs(model, reference["batch"]), reference["batch"],
                   f"the model logged to MLflow ({model_uri}) does not give the export's log-probs")


def verified_export(store: RunStore, step: int, storage: StorageConfig, measured: Measurement, tracking_uri: str,
                    prompts: list, chat_template: bool) -> tuple[ModelInfo, str]:
    """Export the checkpoint, check it against the trainer's checkpoint, log it to the evaluation run, and check the
    copy MLflow loads back against the export: (the logged model, what both checks found). ExportMismatch, before
    any version exists, if either fails."""
    uri = store.uri("checkpoints", step)
    with tempfile.TemporaryDirectory(prefix="rlflow-register-") as tmp:
        export_dir = store.export_model(step, Path(tmp) / "model")
        check, reference = verify_export(export_dir, RunStore.at(storage, uri), prompts, chat_template)
        print(f"export check of {uri}: {check.summary()}")
        logged = log_hf_model(tracking_uri, measured.eval_run_id, export_dir,
                              f"rlflow checkpoint {uri}: {measured.metric_key} = {measured.value:.4g}")
        reloaded = check_logged_model(logged.model_uri, reference)
    return logged, f"{check.summary()}; MLflow's copy loaded back vs the export: max {reloaded.max_abs_diff:.3g}"


def ensure_registered_model(client: MlflowClient, name: str) -> None:
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="Hugging Face exports of rlflow checkpoints")


def version_of(client: MlflowClient, name: str, checkpoint: str) -> ModelVersion | None:
    """The version of `name` already made from `checkpoint` (a retried pipeline run registers it once)."""
    for v in client.search_model_versions(f"name = '{name}'"):
        if v.tags.get("rlflow.checkpoint") == checkpoint:
            return v
    return None


def alias_version(client: MlflowClient, name: str, alias: str) -> int | None:
    """The version `alias` points at, None if it points nowhere."""
    try:
        return int(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def settle_aliases(client: MlflowClient, name: str, version: int, promoted: bool, compared_with: int | None) -> None:
    """`challenger` to this version unless a newer candidate has it; `champion` to it if it was promoted against the
    champion that still holds the alias. Safe to repeat: a retry after a crash ends with the same aliases."""
    challenger = alias_version(client, name, CHALLENGER)
    if challenger is None or challenger <= version:
        client.set_registered_model_alias(name, CHALLENGER, str(version))
    if promoted and alias_version(client, name, CHAMPION) in (compared_with, version):
        client.set_registered_model_alias(name, CHAMPION, str(version))


def decision_for(measured: Measurement, champion: ChampionMeasurement | None, promote: PromoteConfig,
                 current: int | None, name: str) -> tuple[Decision, int | None]:
    """The gate against the champion the pipeline measured, provided it still is the champion: one promoted by
    another pipeline meanwhile was not compared, so this candidate is not promoted over it."""
    measured_against = champion.version if champion is not None else None
    if current != measured_against:
        was = f"{name}@{measured_against}" if measured_against is not None else "no champion"
        now = f"{name}@{current}" if current is not None else "none"
        reason = f"the champion changed while this candidate was evaluated ({was} -> {now}); run the pipeline again"
        return Decision(False, reason, measured.value), current
    champion_name = f"champion {name}@{champion.version} ({champion.how})" if champion else "the champion"
    return decide(measured.value, champion.value if champion else None, promote, measured.metric_key,
                  champion_name), measured_against


def training_provenance(client: MlflowClient, store: RunStore, training_run_id: str | None) -> tuple[str, str | None]:
    """The recipe hash and code commit the training run recorded (its MLflow tags), else computed here: the hash of
    the run's stored config.json and this checkout's commit."""
    tags = {}
    if training_run_id:
        try:
            tags = client.get_run(training_run_id).data.tags
        except MlflowException:
            tags = {}
    recipe = store.read_json("config.json") if store.exists("config.json") else {}
    return (tags.get("rlflow.recipe_hash") or recipe_hash(recipe),
            tags.get("mlflow.source.git.commit") or git_commit())


def result_of(client: MlflowClient, v: ModelVersion) -> dict:
    """What the flow returns for version `v`: its decision as tagged and the aliases now."""
    aliases = client.get_registered_model(v.name).aliases
    return {"registered": True, "model": v.name, "version": int(v.version),
            "promotion": v.tags.get("rlflow.promotion"), "reason": v.tags.get("rlflow.promotion_reason"),
            "champion": int(aliases[CHAMPION]) if CHAMPION in aliases else None,
            "challenger": int(aliases[CHALLENGER]) if CHALLENGER in aliases else None,
            "export_check": v.tags.get("rlflow.export_check")}


@flow(name="register", log_prints=True)
def register_model(
    checkpoint: str, measured: Measurement, champion: ChampionMeasurement | None, registry: RegisterConfig,
    promote: PromoteConfig, tracking_uri: str, storage: StorageConfig, training_run_id: str | None = None,
    check_prompts: list[str | list[dict]] | None = None, chat_template: bool = False,
) -> dict:
    """Register `checkpoint` as a new version of `registry.model_name` (alias challenger), checked against the
    trainer's state, with its lineage; make it the champion if `promote`'s gate passes against `champion` (the
    current champion's value under the same evaluation; None: there is none).

    Idempotent: a checkpoint already registered under this name is not registered twice; its aliases are settled
    as its recorded decision says. `check_prompts`: the first eval prompts (rendered with the chat template if
    `chat_template`), part of the export check."""
    client = MlflowClient(tracking_uri)
    name = registry.model_name
    ensure_registered_model(client, name)
    store, step = locate_checkpoint(checkpoint, storage)
    uri = store.uri("checkpoints", step)  # the tag's one spelling, however `checkpoint` was written
    if (v := version_of(client, name, uri)) is not None:
        compared = v.tags.get("rlflow.compared_with", "none")
        settle_aliases(client, name, int(v.version), v.tags.get("rlflow.promotion") == PROMOTED,
                       None if compared == "none" else int(compared))
        print(f"{uri} is already version {v.version} of {name}")
        return result_of(client, v) | {"reason": f"already registered: {v.tags.get('rlflow.promotion_reason')}"}

    decision, compared_with = decision_for(measured, champion, promote, alias_version(client, name, CHAMPION), name)
    logged, export_check = verified_export(store, step, storage, measured, tracking_uri, check_prompts or [],
                                           chat_template)
    recipe, commit = training_provenance(client, store, training_run_id)
    tags = {"rlflow.checkpoint": uri, "rlflow.metric": measured.metric_key,
            "rlflow.metric_value": str(measured.value), "rlflow.eval_run_id": measured.eval_run_id,
            EVAL_HASH_TAG: measured.eval_hash, "rlflow.format": "mlflow-transformers",
            "rlflow.promotion": decision.outcome, "rlflow.promotion_reason": decision.reason,
            "rlflow.compared_with": "none" if compared_with is None else str(compared_with),
            "rlflow.export_check": export_check}
    tags |= lineage_tags(store, step, client, storage, recipe, commit)
    if training_run_id:
        tags["rlflow.training_run_id"] = training_run_id
    mv = client.create_model_version(name, logged.model_uri, run_id=measured.eval_run_id, tags=tags,
                                     description=f"{uri}: {measured.metric_key} = {measured.value:.4g}; "
                                     f"{decision.outcome}: {decision.reason}", model_id=logged.model_id)
    settle_aliases(client, name, int(mv.version), decision.promoted, compared_with)
    for key, value in (("rlflow.promotion", decision.outcome), ("rlflow.promotion_reason", decision.reason),
                       ("rlflow.model_version", f"{name}@{mv.version}")):
        client.set_tag(measured.eval_run_id, key, value)
    print(f"registered {uri} as {name}@{mv.version}: {decision.outcome}: {decision.reason}")
    return result_of(client, client.get_model_version(name, mv.version))
