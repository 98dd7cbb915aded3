"""Evaluation metrics by hand, the evaluate flow on a run-store checkpoint and on an HF directory, the
registration gates, and registering a checkpoint's HF export in an MLflow registry (SQLite)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlflow.engines.core.config import (
    EvaluationConfig,
    RecipeError,
    RegisterConfig,
    RLConfig,
    StorageConfig,
    resolve_config,
)
from rlflow.engines.session.evaluation import pass_at_k, score
from rlflow.engines.store.run_store import RunStore, StorageError, locate_checkpoint
from rlflow.flows.register import should_register
from tests.conftest import small_recipe


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 1, 1, 0.25),        # 1 - C(3,1)/C(4,1) = 1 - 3/4
    (4, 1, 2, 0.5),         # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),         # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (10, 3, 5, 1 - 21 / 252),  # C(7,5) = 21, C(10,5) = 252
    (4, 0, 4, 0.0),
    (4, 2, 3, 1.0),         # only 2 wrong: every 3 of 4 holds a correct one
    (3, 3, 1, 1.0),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_score_by_hand():
    # prompt 1: one correct of 4; prompt 2: two correct of 4 (0.5 is a partial reward, not correct)
    m = score([1, 0, 0, 0, 1, 1, 0.5, 0], [2, 3, 3, 4, 1, 1, 1, 1], n=4, ks=[1, 2])
    assert m["accuracy"] == pytest.approx(3 / 8)
    assert m["reward_mean"] == pytest.approx(3.5 / 8)
    assert m["response_len_mean"] == pytest.approx(2.0)
    assert m["pass_at_1"] == pytest.approx((0.25 + 0.5) / 2)
    assert m["pass_at_2"] == pytest.approx((0.5 + (1 - 1 / 6)) / 2)
    with pytest.raises(ValueError, match="groups of 4"):
        score([1, 0, 0], [1, 1, 1], n=4)


@pytest.mark.parametrize(("value", "best", "threshold", "beat_best", "ok"), [
    (0.6, None, 0.5, True, True),     # first version, above the bar
    (0.4, None, 0.5, True, False),    # below the bar
    (0.6, 0.7, None, True, False),    # does not beat the best
    (0.7, 0.7, None, True, False),    # a tie does not beat it
    (0.8, 0.7, 0.5, True, True),
    (0.6, 0.7, 0.5, False, True),     # best not asked for
    (0.1, 0.9, None, False, True),    # no gate at all
])
def test_should_register(value, best, threshold, beat_best, ok):
    assert should_register(value, best, RegisterConfig(threshold=threshold, beat_best=beat_best))[0] is ok


def test_resolve_config_from_recipe_or_tree(tmp_path):
    recipe = Path(__file__).resolve().parent.parent / "deployments" / "sort-tiny.yaml"
    cfg = resolve_config(RLConfig, None, str(recipe), ["train.steps=3"])
    assert cfg.train.steps == 3 and cfg.name == "sort-tiny"
    tree = RLConfig.model_validate(small_recipe(tmp_path, storage={"uri": "s3://b/r", "secret": "s3cr3t", "key": "k"}))
    again = resolve_config(RLConfig, tree, None, ["train.lr=0.5"])
    assert again.train.lr == 0.5 and again.storage.secret.get_secret_value() == "s3cr3t"
    assert resolve_config(RLConfig, tree, None, None) is tree
    assert resolve_config(RLConfig, tree, str(recipe), None) is tree  # a deployment's default recipe yields
    with pytest.raises(RecipeError, match="one of them is required"):
        resolve_config(RLConfig, None, None, ["train.steps=3"])
    with pytest.raises(RecipeError, match="train.stepz: unknown key"):
        resolve_config(RLConfig, None, str(recipe), ["train.stepz=3"])


def fake_checkpoint(store: RunStore, step: int, model_dir: str, mlflow_run_id: str = "abc") -> str:
    """Commit a checkpoint whose model/ is a real HF directory, as a training run would."""
    with tempfile.TemporaryDirectory() as local:
        shutil.copytree(model_dir, Path(local) / "model")
        store.commit_checkpoint(step, local, {"step": step, "next_step": step + 1, "mlflow_run_id": mlflow_run_id})
    return store.uri("checkpoints", step)


def test_locate_checkpoint(storage, tiny_model_dir):
    store = RunStore(storage, "r1")
    fake_checkpoint(store, 3, tiny_model_dir)
    fake_checkpoint(store, 7, tiny_model_dir)
    root = storage.uri.rstrip("/")
    found, step = locate_checkpoint(f"{root}/r1", storage)
    assert (found.run, step) == ("r1", 7)
    assert locate_checkpoint(f"{root}/r1/checkpoints/3/", storage)[1] == 3
    with pytest.raises(StorageError, match="no committed checkpoint at step 5"):
        locate_checkpoint(f"{root}/r1/checkpoints/5", storage)
    with pytest.raises(StorageError, match="has no committed checkpoint"):
        locate_checkpoint(f"{root}/nope", storage)


def eval_config(tmp_path: Path, checkpoint: str, **kw) -> EvaluationConfig:
    from rlflow.engines.core.config import BuiltinTaskConfig
    from rlflow.engines.data.builtin_tasks import write_task_files

    write_task_files(BuiltinTaskConfig(task="sort", num_digits=3, num_train=10, num_eval=6), tmp_path / "tr.jsonl",
                     tmp_path / "ev.jsonl")
    return EvaluationConfig.model_validate({
        "name": "ev", "checkpoint": checkpoint,
        "eval": {"datasets": [{"path": str(tmp_path / "ev.jsonl"), "name": "sort3"},
                              {"path": str(tmp_path / "ev.jsonl"), "name": "again"}],
                 "samples_per_prompt": 3, "pass_k": [1, 3], "max_new_tokens": 4, "threads": 1},
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"}, **kw,
    })


def test_evaluate_flow_on_a_store_checkpoint(tmp_path, tiny_model_dir):
    """The flow through Prefect (a temporary local server) on a committed checkpoint: metrics in its own MLflow
    run, linked to the training run, with the report; a second dataset is scored on its own."""
    from rlflow.flows.evaluate import evaluate

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    training = client.create_run(client.create_experiment("rlflow"), run_name="train").info.run_id
    store = RunStore(StorageConfig(uri=str(tmp_path / "runs")), "r")
    uri = fake_checkpoint(store, 4, tiny_model_dir, mlflow_run_id=training)
    metrics = evaluate(eval_config(tmp_path, f"file://{tmp_path}/runs/r"))

    assert set(metrics) == {f"{d}/{k}" for d in ("sort3", "again") for k in
                            ("accuracy", "reward_mean", "response_len_mean", "num_prompts", "pass_at_1", "pass_at_3")}
    assert metrics["sort3/num_prompts"] == 6 and 0 < metrics["sort3/response_len_mean"] <= 4
    assert metrics["sort3/pass_at_1"] == pytest.approx(metrics["sort3/accuracy"])  # pass@1 is the mean accuracy
    exp = client.get_experiment_by_name("rlflow").experiment_id
    run = client.search_runs([exp], "tags.`rlflow.kind` = 'evaluation'")[0]
    assert run.data.tags["rlflow.training_run_id"] == training and run.data.tags["rlflow.checkpoint"] == uri
    assert run.data.metrics["sort3.pass_at_3"] == pytest.approx(metrics["sort3/pass_at_3"])
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"report.md", "recipe.json", "samples"}
    report = Path(client.download_artifacts(run.info.run_id, "report.md", str(tmp_path))).read_text()
    assert "| sort3 |" in report and "(step 4)" in report
    samples = json.loads(Path(client.download_artifacts(run.info.run_id, "samples/eval.json", str(tmp_path))
                              ).read_text())
    assert len(samples["data"]) == 2 * 6  # samples_logged (8) capped by the 6 prompts, per dataset


def test_evaluate_flow_on_an_hf_directory(tmp_path, tiny_model_dir):
    from rlflow.flows.evaluate import evaluate

    metrics = evaluate(eval_config(tmp_path, tiny_model_dir, training_run_id=None))
    assert metrics["again/num_prompts"] == 6


def test_register_logs_the_hf_export_and_gates_versions(tmp_path, tiny_model_dir):
    from rlflow.flows.register import register_model

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    eval_run = client.create_run(client.create_experiment("rlflow"), run_name="ev").info.run_id
    storage = StorageConfig(uri=str(tmp_path / "runs"))
    store = RunStore(storage, "r")
    first, second = fake_checkpoint(store, 1, tiny_model_dir), fake_checkpoint(store, 2, tiny_model_dir)
    cfg = RegisterConfig(model_name="m", threshold=0.2, beat_best=True)

    out = register_model(first, "ev/accuracy", 0.5, eval_run, cfg, uri, storage)
    assert out["registered"] and out["version"] == 1
    assert register_model(first, "ev/accuracy", 0.5, eval_run, cfg, uri, storage)["reason"] == "already registered"
    assert not register_model(second, "ev/accuracy", 0.4, eval_run, cfg, uri, storage)["registered"]  # not best
    assert not register_model(second, "ev/accuracy", 0.1, eval_run, cfg.model_copy(update={"beat_best": False}),
                              uri, storage)["registered"]  # below the threshold
    assert register_model(second, "ev/accuracy", 0.6, eval_run, cfg, uri, storage)["version"] == 2

    versions = {v.version: v for v in client.search_model_versions("name = 'm'")}
    assert set(versions) == {1, 2} and versions[2].tags["rlflow.metric_value"] == "0.6"
    local = Path(client.download_artifacts(eval_run, "model", str(tmp_path / "dl")))
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in Path(tiny_model_dir).iterdir())
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(local)  # the registered files load as they are
