"""Register an evaluated checkpoint in the MLflow model registry, if its metric earns it.

The model version is the checkpoint's Hugging Face export (what `rlflow export` writes) logged with MLflow's
transformers flavor as a text-generation model of the evaluation run: safetensors weights and tokenizer files
(no pickle) with an MLmodel, so `mlflow.transformers.load_model` gives a pipeline and `mlflow.pyfunc.load_model`
a model whose `predict(prompts, params={"max_new_tokens": n})` generates.
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

from rlflow.engines.core.config import RegisterConfig, StorageConfig
from rlflow.engines.models.hf import load_tokenizer
from rlflow.engines.store.run_store import locate_checkpoint

# prompts in, generated text out; generation settings per call (the pipeline's generate() keyword arguments)
SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
    params=ParamSchema([ParamSpec("max_new_tokens", "long", 64), ParamSpec("do_sample", "boolean", False),
                        ParamSpec("temperature", "double", 1.0)]),
)


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


def should_register(value: float, best: float | None, cfg: RegisterConfig) -> tuple[bool, str]:
    """Every configured gate must pass: the threshold (if any) and beating the best registered version (if asked)."""
    if cfg.threshold is not None and value < cfg.threshold:
        return False, f"{value:.4g} is below the threshold {cfg.threshold:.4g}"
    if cfg.beat_best and best is not None and value <= best:
        return False, f"{value:.4g} does not beat the best registered version ({best:.4g})"
    why = [f"{value:.4g} >= threshold {cfg.threshold:.4g}"] if cfg.threshold is not None else []
    why += ["no version registered yet" if best is None else f"beats the best version ({best:.4g})"] if cfg.beat_best \
        else []
    return True, "; ".join(why) or "no gate configured"


def registered_versions(client: MlflowClient, name: str) -> list[ModelVersion]:
    try:
        return list(client.search_model_versions(f"name = '{name}'"))
    except MlflowException:
        return []


def best_value(versions: list[ModelVersion], metric_key: str) -> float | None:
    values = [float(v.tags["rlflow.metric_value"]) for v in versions if v.tags.get("rlflow.metric") == metric_key]
    return max(values) if values else None


@flow(name="register", log_prints=True)
def register_model(
    checkpoint: str, metric_key: str, value: float, eval_run_id: str, cfg: RegisterConfig, tracking_uri: str,
    storage: StorageConfig, training_run_id: str | None = None,
) -> dict:
    """Register `checkpoint` as a new version of `cfg.model_name` when `value` of `metric_key` passes the gates.

    Idempotent: a checkpoint already registered under this name is not registered twice."""
    client = MlflowClient(tracking_uri)
    versions = registered_versions(client, cfg.model_name)
    for v in versions:
        if v.tags.get("rlflow.checkpoint") == checkpoint:
            print(f"{checkpoint} is already version {v.version} of {cfg.model_name}")
            return {"registered": True, "version": int(v.version), "reason": "already registered"}
    ok, reason = should_register(value, best_value(versions, metric_key), cfg)
    if not ok:
        print(f"not registering {checkpoint}: {metric_key} {reason}")
        return {"registered": False, "version": None, "reason": reason}
    store, step = locate_checkpoint(checkpoint, storage)
    with tempfile.TemporaryDirectory() as tmp:
        logged = log_hf_model(tracking_uri, eval_run_id, store.export_model(step, tmp),
                              f"rlflow checkpoint {checkpoint}: {metric_key} = {value:.4g}")
    if not any(m.name == cfg.model_name for m in client.search_registered_models(f"name = '{cfg.model_name}'")):
        client.create_registered_model(cfg.model_name, description="Hugging Face exports of rlflow checkpoints")
    tags = {"rlflow.checkpoint": checkpoint, "rlflow.metric": metric_key, "rlflow.metric_value": str(value),
            "rlflow.eval_run_id": eval_run_id, "rlflow.format": "mlflow-transformers"}
    if training_run_id:
        tags["rlflow.training_run_id"] = training_run_id
    mv = client.create_model_version(cfg.model_name, logged.model_uri, run_id=eval_run_id, tags=tags,
                                     description=f"{checkpoint}: {metric_key} = {value:.4g} ({reason})",
                                     model_id=logged.model_id)
    print(f"registered {checkpoint} as version {mv.version} of {cfg.model_name}: {metric_key} {reason}")
    return {"registered": True, "version": int(mv.version), "reason": reason}
