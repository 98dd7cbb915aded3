"""Promotion gates, lineage and the export check (docs/operations.md, "Promotion and lineage").

- the gate by hand: never a worse or equal candidate, min_delta, the threshold, the first version, lower-is-better;
- the export check on a checkpoint the trainer wrote, and refusing a tampered export;
- against a real MLflow server: three candidates registered with planted metrics, aliases and tags after each (a
  worse one stays challenger), the champion measured again under another evaluation, a tampered export refused,
  and `rlflow lineage` printing a version whose parent is another registered version.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import warnings
from pathlib import Path

import mlflow
import pytest
import torch
import torch.distributed as dist
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file, save_file

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.config import (
    AlgorithmConfig,
    EvalDatasetConfig,
    EvaluationConfig,
    PipelineConfig,
    PromoteConfig,
    RecipeError,
    RegisterConfig,
    StorageConfig,
    TrainConfig,
    config_from_dict,
)
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.train.export_check import TOLERANCE, ExportMismatch, verify_export
from rlflow.engines.train.torch_backend import TorchTrainBackend
from rlflow.flows import pipeline as pipeline_flow
from rlflow.flows.cli import main
from rlflow.flows.promotion import decide, evaluation_hash, evaluation_settings
from rlflow.flows.register import ChampionMeasurement, Measurement, register_model
from rlflow.flows.serve import Services, launch_mlflow_server, wait_http
from rlflow.tasks.tracking import git_commit, recipe_hash
from tests.browser import CHROMIUM, browser_page, screenshot
from tests.conftest import small_recipe

# ---- the gate -------------------------------------------------------------------------------------------------

HIGHER = PromoteConfig(min_delta=0.05, threshold=0.3)
LOWER = PromoteConfig(metric="response_len_mean", min_delta=1.0, threshold=10.0, higher_is_better=False)


@pytest.mark.parametrize(("candidate", "champion", "gate", "promoted", "why"), [
    (0.5, None, HIGHER, True, "no champion yet"),              # the first version: the threshold alone
    (0.2, None, HIGHER, False, "misses the threshold"),        # ... below it: challenger only
    (0.4, 0.5, HIGHER, False, "worse than"),                   # never a worse model
    (0.5, 0.5, HIGHER, False, "no better than"),               # nor an equal one
    (0.52, 0.5, HIGHER, False, "not enough better than"),      # better by less than min_delta
    (0.55, 0.5, HIGHER, True, "beats"),                        # by exactly min_delta (0.55 - 0.5 rounds below it)
    (0.9, 0.5, HIGHER, True, "beats"),
    (0.25, 0.1, HIGHER, False, "misses the threshold"),        # better than a weak champion, still below the bar
    (0.51, 0.5, PromoteConfig(), True, "beats"),               # min_delta 0: any strict improvement
    (float("nan"), 0.5, HIGHER, False, "not a measurement"),
    (6.0, 8.0, LOWER, True, "beats"),                          # lower is better: 2 tokens shorter
    (7.5, 8.0, LOWER, False, "not enough better than"),
    (9.0, 8.0, LOWER, False, "worse than"),
    (11.0, None, LOWER, False, "misses the threshold"),        # the threshold is a ceiling
])
def test_the_gate(candidate, champion, gate, promoted, why):
    d = decide(candidate, champion, gate, "eval/sort4/accuracy", "champion m@1")
    assert d.promoted is promoted and why in d.reason, d.reason
    if champion is not None and promoted:
        assert "champion m@1" in d.reason and f"min_delta {gate.min_delta:g}" in d.reason  # the numbers are quoted


def test_a_worse_candidate_is_never_promoted_whatever_the_gate():
    for min_delta in (0.0, 0.01, 0.5):
        for threshold in (None, 0.0, 0.3):
            for higher in (True, False):
                gate = PromoteConfig(min_delta=min_delta, threshold=threshold, higher_is_better=higher)
                for champion in (0.2, 0.4, 0.6):
                    for step in (0.0, 1e-9, 0.1):
                        worse = champion - step if higher else champion + step
                        assert not decide(worse, champion, gate).promoted, (gate, champion, worse)


def test_the_old_registry_gate_fields_move_to_promote():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = PipelineConfig.model_validate({"train_recipe": "t.yaml", "registry": {
            "model_name": "m", "metric": "pass_at_4", "threshold": 0.5, "beat_best": True}})
    assert cfg.registry == RegisterConfig(model_name="m")
    assert (cfg.promote.metric, cfg.promote.threshold, cfg.promote.min_delta) == ("pass_at_4", 0.5, 0.0)
    assert any("registry.beat_best is gone" in str(w.message) for w in caught)
    with pytest.raises(RecipeError, match="promote.min_delta: Input should be greater than or equal to 0"):
        config_from_dict({"train_recipe": "t.yaml", "promote": {"min_delta": -0.1}}, model=PipelineConfig)
    with pytest.raises(RecipeError, match=r"registry.threshold \(0.5\) and promote.threshold \(0.4\) disagree"):
        config_from_dict({"train_recipe": "t.yaml", "registry": {"threshold": 0.5}, "promote": {"threshold": 0.4}},
                         model=PipelineConfig)


@pytest.mark.parametrize(("path", "key"), [
    ("data/sort4/eval.jsonl", "sort4"), ("s3://bucket/gsm8k/test.parquet", "gsm8k"), ("data/sort4/heldout.jsonl",
    "sort4"), ("data/math500.jsonl", "math500"), ("eval.jsonl", "eval"), ("data/sort4/sort_hard.jsonl", "sort_hard"),
])
def test_a_split_named_file_takes_its_folders_name(path, key):
    assert EvalDatasetConfig(path=path).key == key
    assert EvalDatasetConfig(path=path, name="mine").key == "mine"


# ---- a real MLflow server, for the last test ------------------------------------------------------------------

class MlflowServer:
    """`mlflow server` (SQLite registry, artifacts served over HTTP) launched when the module starts, so it boots
    while the tests above run; `uri` waits for it once."""

    def __init__(self, tmp: Path):
        self.services = Services()
        self.proc, self._uri = launch_mlflow_server(self.services, free_port(), f"sqlite:///{tmp}/mlflow.db",
                                                    tmp / "artifacts", log=tmp / "mlflow.log")
        self.ready = False

    @property
    def uri(self) -> str:
        if not self.ready:
            wait_http(f"{self._uri}/health", self.proc, "mlflow server", timeout=300)
            self.ready = True
        return self._uri


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:  # no job runner (a second process importing MLflow): half the boot
        env.setenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.services.stop(timeout=5)  # a test server: no need for uvicorn's graceful 20 s


# ---- checkpoints ----------------------------------------------------------------------------------------------

def write_data(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {"train": folder / "train.jsonl", "eval": folder / "eval.jsonl"}
    for i, f in enumerate(files.values()):
        f.write_text("".join(json.dumps({"prompt": f"S{i}{j}{j + 1}=", "label": f"{i}{j}"}) + "\n" for j in range(6)))
    return files


def fake_checkpoint(store: RunStore, step: int, model_dir: str, meta: dict | None = None) -> str:
    """Commit a checkpoint whose model/ is a real HF directory, as a training run would."""
    with tempfile.TemporaryDirectory() as local:
        shutil.copytree(model_dir, Path(local) / "model")
        store.commit_checkpoint(step, local, {"step": step, "next_step": step + 1} | (meta or {}))
    return store.uri("checkpoints", step)


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory, tiny_model_dir):
    """A checkpoint written by the native trainer itself (TorchTrainBackend.save into the run store: DCP's
    consolidated model/, optimizer/, trainer state), after one optimizer step so its weights are its own."""
    tmp = tmp_path_factory.mktemp("trainer")
    storage = StorageConfig(uri=str(tmp / "runs"))
    store = RunStore(storage, "r")
    owned = not dist.is_initialized()
    backend = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1, lr=1e-2), AlgorithmConfig())
    try:
        with torch.no_grad():
            next(backend.model.parameters()).add_(0.01)  # weights no file outside the checkpoint holds
        uri = store.begin_checkpoint(3)
        backend.save(uri, storage)
        for f in Path(tiny_model_dir).glob("tokenizer*"):  # as the checkpoint stage adds the tokenizer
            store.upload_file(f, "checkpoints", 3, "model", f.name)
        store.finish_checkpoint(3, {"step": 3, "next_step": 4, "weight_version": 4})
    finally:
        del backend
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    return store, storage, uri


def tamper(model_dir: Path, name: str = "model.norm.weight", by: float = 1e-2) -> None:
    """Perturb one weight of an export's model.safetensors (as a corrupt copy or a wrong conversion would)."""
    tensors = load_file(model_dir / "model.safetensors")
    tensors[name] = tensors[name] * (1 + by)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.usefixtures("mlflow_server")  # launched here: it boots while this test runs, for the last one
def test_the_export_check_passes_on_the_trainers_checkpoint_and_fails_on_a_tampered_export(trainer_checkpoint,
                                                                                           tmp_path):
    store, storage, uri = trainer_checkpoint
    export = store.export_model(3, tmp_path / "export")
    check, reference = verify_export(export, RunStore.at(storage, uri), ["S123=", "S987="], chat_template=False)
    assert check.passed and check.max_abs_diff <= TOLERANCE and check.sequences == 4, check
    assert check.summary().startswith("passed: max |log-prob difference|") and "tolerance 0.0001" in check.summary()
    assert reference["batch"]["input_ids"].shape[0] == 4

    tamper(export)
    with pytest.raises(ExportMismatch) as err:
        verify_export(export, RunStore.at(storage, uri), ["S123=", "S987="])
    message = str(err.value)
    assert uri in message and "failed: max |log-prob difference|" in message
    assert float(message.split("difference| ")[1].split(" ")[0]) > TOLERANCE


def test_an_evaluation_hash_depends_on_what_is_measured_only(tmp_path):
    data = write_data(tmp_path / "d" / "sort3")
    moved = tmp_path / "elsewhere" / "sort3"
    moved.mkdir(parents=True)
    shutil.copy(data["eval"], moved / "eval.jsonl")

    def hashed(path: Path, **eval_kw) -> str:
        cfg = EvaluationConfig(checkpoint="c", eval={"datasets": [{"path": str(path)}], **eval_kw})
        return evaluation_hash(evaluation_settings(cfg))

    base = hashed(data["eval"])
    assert hashed(moved / "eval.jsonl") == base  # the same content under another path
    assert hashed(data["eval"], shards=3, samples_logged=0) == base  # where shards run does not change a metric
    assert hashed(data["eval"], temperature=0.5) != base
    (moved / "eval.jsonl").write_text(data["eval"].read_text() + '{"prompt": "S9=", "label": "9"}\n')
    assert hashed(moved / "eval.jsonl") != base


# ---- against the MLflow server --------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def eval_run(client: MlflowClient, metric_key: str, value: float) -> str:
    exp = client.get_experiment_by_name("promotion") or client.get_experiment(client.create_experiment("promotion"))
    run = client.create_run(exp.experiment_id, run_name="eval").info.run_id
    client.log_metric(run, metric_key, value)
    return run


def test_candidates_become_champion_only_when_they_beat_it(mlflow_server, tmp_path, tiny_model_dir, monkeypatch,
                                                           capsys):
    uri = mlflow_server.uri
    client = MlflowClient(uri)
    storage = StorageConfig(uri=str(tmp_path / "runs"))
    data = write_data(tmp_path / "data" / "sort3")
    key = "eval/sort3/accuracy"
    cfg = PipelineConfig(train_recipe="t.yaml", registry={"model_name": "m"},
                         promote={"min_delta": 0.05, "threshold": 0.3})
    train = config_from_dict(small_recipe(tmp_path, tracking={"uri": uri}))
    evaluation = EvaluationConfig(checkpoint="-", eval={"datasets": [{"path": str(data["eval"])}]},
                                  tracking={"uri": uri})

    # run a: the built-in tiny model; run b: trained from run a's checkpoint 1 (its model/ folder)
    run_a, run_b = RunStore(storage, "a"), RunStore(storage, "b")
    recipe_a = small_recipe(tmp_path, data={"train_path": str(data["train"]), "eval_path": str(data["eval"])})
    run_a.write_json(recipe_a, "config.json")
    c1 = fake_checkpoint(run_a, 1, tiny_model_dir, {"weight_version": 7})
    c2 = fake_checkpoint(run_a, 2, tiny_model_dir)
    run_b.write_json(recipe_a | {"model": {"path": f"{c1}/model"}}, "config.json")
    c3 = fake_checkpoint(run_b, 1, tiny_model_dir)
    training = client.create_run(client.create_experiment("training"), tags={
        "rlflow.recipe_hash": "r" * 64, "mlflow.source.git.commit": "c0ffee"}).info.run_id

    def register(checkpoint: str, value: float, eval_hash: str, champion, training_run_id=None) -> dict:
        measured = Measurement(metric_key=key, value=value, eval_run_id=eval_run(client, key, value),
                               eval_hash=eval_hash)
        return register_model.fn(checkpoint, measured, champion, cfg.registry, cfg.promote, uri, storage,
                                 training_run_id, ["S012=", "S123="])

    def aliases() -> dict[str, int]:
        return {a: int(v) for a, v in client.get_registered_model("m").aliases.items()}

    try:
        # 1. the first candidate: no champion, above the threshold -> champion and challenger
        assert pipeline_flow.champion_value(cfg, train, evaluation, "h1", key) is None
        first = register(c1, 0.5, "h1", None, training)
        assert (first["version"], first["promotion"]) == (1, "promoted") and "no champion yet" in first["reason"]
        assert aliases() == {"champion": 1, "challenger": 1}
        v1 = client.get_model_version("m", "1")
        t = v1.tags
        assert t["rlflow.promotion"] == "promoted" and t["rlflow.checkpoint"] == c1 and t["rlflow.eval_hash"] == "h1"
        assert t["rlflow.lineage.data.train"] == sha256(data["train"]) and t["rlflow.lineage.data.eval"] == sha256(
            data["eval"]) and t["rlflow.lineage.file.train"] == str(data["train"])
        assert (t["rlflow.recipe_hash"], t["rlflow.code_commit"]) == ("r" * 64, "c0ffee")  # the training run's
        assert t["rlflow.parent_model"] == "builtin:llama-32x2 seed=0" and t["rlflow.run_store"] == run_a.uri()
        assert (t["rlflow.step"], t["rlflow.weight_version"]) == ("1", "7") and t["rlflow.version"]
        assert t["rlflow.export_check"].startswith("passed: max |log-prob difference|")
        eval_tags = client.get_run(t["rlflow.eval_run_id"]).data.tags
        assert eval_tags["rlflow.promotion"] == "promoted" and eval_tags["rlflow.model_version"] == "m@1"
        assert register(c1, 0.5, "h1", None)["reason"].startswith("already registered")  # a retried pipeline
        assert len(client.search_model_versions("name = 'm'")) == 1

        # 2. a worse candidate, compared with the champion's recorded value (same evaluation): challenger only
        champion = pipeline_flow.champion_value(cfg, train, evaluation, "h1", key)
        assert champion == ChampionMeasurement(version=1, value=0.5, eval_run_id=t["rlflow.eval_run_id"],
                                               how="recorded")
        second = register(c2, 0.45, "h1", champion)
        assert (second["version"], second["promotion"]) == (2, "rejected")
        assert aliases() == {"champion": 1, "challenger": 2}
        reason = client.get_model_version("m", "2").tags["rlflow.promotion_reason"]
        assert reason.startswith("worse than champion m@1 (recorded)") and "0.45 vs" in reason and "-0.05" in reason
        assert client.get_model_version("m", "2").tags["rlflow.weight_version"] == "3"  # no weight_version: step + 1

        # 3. another evaluation (hash h2): the champion's checkpoint is evaluated again, through the evaluate stage
        staged = []

        def evaluate_stage(cfg_, again: EvaluationConfig, stage: str, name: str):
            staged.append((stage, again.checkpoint))
            return client.get_run(eval_run(client, key, 0.49))

        monkeypatch.setattr(pipeline_flow, "evaluate_stage", evaluate_stage)
        champion = pipeline_flow.champion_value(cfg, train, evaluation, "h2" * 32, key)
        assert staged == [("evaluate-champion-v1", c1)] and (champion.value, champion.how) == (0.49, "re-evaluated")
        assert pipeline_flow.champion_value(cfg, train, evaluation, "h2" * 32, key).how == "re-evaluated earlier"
        assert len(staged) == 1  # measured once per evaluation: the version's tag names the run

        # a tampered export is refused before anything is registered
        export = RunStore.export_model

        def tampered(self, step, local_dir):
            out = export(self, step, local_dir)
            tamper(Path(out))
            return out

        monkeypatch.setattr(RunStore, "export_model", tampered)
        with pytest.raises(ExportMismatch, match=f"the Hugging Face export of {c3} does not match"):
            register(c3, 0.58, "h2" * 32, champion)
        monkeypatch.setattr(RunStore, "export_model", export)
        assert len(client.search_model_versions("name = 'm'")) == 2

        third = register(c3, 0.58, "h2" * 32, champion)
        assert (third["version"], third["promotion"]) == (3, "promoted") and "+0.09" in third["reason"]
        assert aliases() == {"champion": 3, "challenger": 3}
        t3 = client.get_model_version("m", "3").tags
        assert t3["rlflow.parent_model"] == c1 and t3["rlflow.compared_with"] == "1"
        assert t3["rlflow.recipe_hash"] == recipe_hash(run_b.read_json("config.json"))  # no training run: computed
        assert t3["rlflow.code_commit"] == (git_commit() or "unknown")
        assert t3["rlflow.export_check"].startswith("passed")  # also: MLflow's copy loaded back, the same log-probs
    finally:
        mlflow.set_tracking_uri(None)

    # rlflow lineage: m@champion (v3) -> its parent checkpoint is v1's -> v1's parent, the built-in model
    capsys.readouterr()  # what registration printed
    assert main(["lineage", "m@champion", "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    blocks = out.split("\nm@")
    assert out.startswith("m@3  aliases: challenger, champion") and blocks[1].startswith("1  aliases: -")
    assert f"parent      {c1}  (registered: m@1)" in blocks[0]
    assert "promotion   promoted: beats champion m@1" in blocks[0]
    assert f"run store   {run_b.uri()}  step 1  weight version 2" in blocks[0]
    assert f"data        train: sha256 {sha256(data['train'])}" in blocks[1]
    assert out.rstrip().endswith("root: builtin:llama-32x2 seed=0 (not a registered version)")
    for ref, error in (("m@9", "model 'm' has no version 9"), ("m@prod", "model 'm' has no alias 'prod' in "),
                       ("nope@1", "no registered model 'nope'"), ("m", "expected NAME@VERSION or NAME@ALIAS")):
        assert main(["lineage", ref, "--tracking-uri", uri]) == 2
        assert error in capsys.readouterr().err, ref

    if CHROMIUM:
        registry_ui_shows_the_promotion(uri, "m", champion=3, rejected=2)


def registry_ui_shows_the_promotion(uri: str, name: str, champion: int, rejected: int) -> None:
    """The MLflow UI, in Chromium, as a user checks a promotion: the model's page shows the aliases on the champion,
    and the rejected version's page says why it was not promoted."""
    from playwright.sync_api import expect

    with browser_page(width=1600) as page:
        page.goto(f"{uri}/#/models/{name}", timeout=60_000)
        row = page.get_by_role("row").filter(has=page.get_by_role("link", name=f"Version {champion}", exact=True))
        expect(row).to_contain_text("@ champion", timeout=60_000)
        expect(row).to_contain_text("@ challenger")
        screenshot(page, "ui-registry-champion.png")
        page.goto(f"{uri}/#/models/{name}/versions/{rejected}", timeout=60_000)
        reason = page.get_by_role("row").filter(has_text="rlflow.promotion_reason")
        expect(reason).to_contain_text(f"worse than champion {name}@1", timeout=60_000)
        expect(page.get_by_role("row").filter(has_text="rejected").first).to_be_visible()
        screenshot(page, "ui-registry-rejected.png")
