"""Evaluation metrics by hand, the evaluate flow on a run-store checkpoint and on an HF directory, and registering a
checkpoint's HF export in an MLflow registry (SQLite). The promotion gates: tests/test_promotion.py."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlflow.engines.core.config import (
    EvalSamplingConfig,
    EvaluationConfig,
    PipelineConfig,
    PromoteConfig,
    RecipeError,
    RegisterConfig,
    RLConfig,
    StorageConfig,
    config_from_dict,
    load_recipe,
    public_tree,
    resolve_config,
)
from rlflow.engines.data.rewards import load_reward_fn
from rlflow.engines.models.hf import load_tokenizer
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.evaluation import generate_and_reward, pass_at_k, score, shard_bounds
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data
from rlflow.engines.store.run_store import RunStore, StorageError, locate_checkpoint
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


def test_resolve_config_from_recipe_or_tree(tmp_path):
    recipe = Path(__file__).resolve().parent.parent / "deployments" / "sort-tiny.yaml"
    cfg = resolve_config(RLConfig, None, str(recipe), ["train.steps=3"])
    assert cfg.train.steps == 3 and cfg.name == "sort-tiny"
    tree = RLConfig.model_validate(small_recipe(tmp_path, storage={"uri": "s3://b/r", "secret": "s3cr3t", "key": "k"}))
    again = resolve_config(RLConfig, tree, None, ["train.lr=0.5"])
    assert again.train.lr == 0.5 and again.storage.secret.get_secret_value() == "s3cr3t"
    assert resolve_config(RLConfig, tree, None, None) is tree
    assert resolve_config(RLConfig, tree, str(recipe), None) == tree  # a whole tree sets every key of the recipe
    with pytest.raises(RecipeError, match="one of them is required"):
        resolve_config(RLConfig, None, None, ["train.steps=3"])
    with pytest.raises(RecipeError, match="train.stepz: unknown key"):
        resolve_config(RLConfig, None, str(recipe), ["train.stepz=3"])


def test_a_partial_config_deep_merges_over_the_recipe(tmp_path):
    """The merge rule of docs/deployments.md: recipe file < config (mappings key by key, anything else replaced,
    lists too) < overrides. Before it, a `config` replaced the recipe whole: `{"train": {"steps": 5}}` alone was
    an RLConfig without data, model or reward of the recipe (or no valid one at all)."""
    recipe = Path(__file__).resolve().parent.parent / "deployments" / "sort-tiny.yaml"
    base = load_recipe(recipe)
    part = {"train": {"steps": 5, "betas": [0.8, 0.9]}, "data": {"generate": {"num_train": 100}}, "seed": 7}
    cfg = resolve_config(RLConfig, part, str(recipe), ["train.steps=6"])
    assert cfg.train.steps == 6 and cfg.train.betas == (0.8, 0.9) and cfg.seed == 7  # overrides > config > recipe
    assert cfg.data.generate.num_train == 100 and cfg.data.generate.num_digits == 4  # nested: key by key
    assert cfg.train.lr == base.train.lr and cfg.model == base.model and cfg.name == "sort-tiny"  # the rest: recipe
    with_form = public_tree(base) | {"name": "exp-7"}  # the run form sends the whole tree, one field changed
    assert resolve_config(RLConfig, with_form, str(recipe), None) == base.model_copy(update={"name": "exp-7"})
    assert resolve_config(RLConfig, None, str(recipe), None) == base
    for bad, field in (("train.steps=5", "config: expected a mapping"), (3, "recipe: expected a recipe file"),
                       ("train.steps=5", "overrides: expected a list")):
        args = {"config": part, "recipe": str(recipe), "overrides": None}
        args[field.split(":")[0]] = bad
        with pytest.raises(RecipeError, match=field):
            resolve_config(RLConfig, **args)
    with pytest.raises(RecipeError, match="train.steps: Input should be a valid integer"):
        resolve_config(RLConfig, {"train": {"steps": "many"}}, str(recipe), None)


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


def eval_config(tmp_path: Path, checkpoint: str, eval_kw: dict | None = None, **kw) -> EvaluationConfig:
    from rlflow.engines.core.config import BuiltinTaskConfig
    from rlflow.engines.data.builtin_tasks import write_task_files

    write_task_files(BuiltinTaskConfig(task="sort", num_digits=3, num_train=10, num_eval=6), tmp_path / "tr.jsonl",
                     tmp_path / "ev.jsonl")
    return EvaluationConfig.model_validate({
        "name": "ev", "checkpoint": checkpoint,
        "eval": {"datasets": [{"path": str(tmp_path / "ev.jsonl"), "name": "sort3"},
                              {"path": str(tmp_path / "ev.jsonl"), "name": "again"}],
                 "samples_per_prompt": 3, "pass_k": [1, 3], "max_new_tokens": 4, "threads": 1, **(eval_kw or {})},
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

    assert set(metrics) == {f"eval/{d}/{k}" for d in ("sort3", "again") for k in
                            ("accuracy", "reward_mean", "response_len_mean", "num_prompts", "pass_at_1", "pass_at_3")}
    assert metrics["eval/sort3/num_prompts"] == 6 and 0 < metrics["eval/sort3/response_len_mean"] <= 4
    assert metrics["eval/sort3/pass_at_1"] == pytest.approx(metrics["eval/sort3/accuracy"])  # pass@1: mean accuracy
    exp = client.get_experiment_by_name("rlflow").experiment_id
    run = client.search_runs([exp], "tags.`rlflow.kind` = 'evaluation'")[0]
    assert run.data.tags["rlflow.training_run_id"] == training and run.data.tags["rlflow.checkpoint"] == uri
    # under the run's `eval` chart section in MLflow's UI, as it returns them
    assert run.data.metrics["eval/sort3/pass_at_3"] == pytest.approx(metrics["eval/sort3/pass_at_3"])
    assert run.data.tags["prefect.flow_run_id"] and len(run.data.tags["rlflow.recipe_hash"]) == 64
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"report.md", "recipe.json", "samples"}
    report = Path(client.download_artifacts(run.info.run_id, "report.md", str(tmp_path))).read_text()
    assert "| sort3 |" in report and "(step 4)" in report
    samples = json.loads(Path(client.download_artifacts(run.info.run_id, "samples/eval.json", str(tmp_path))
                              ).read_text())
    assert len(samples["data"]) == 2 * 6  # samples_logged (8) capped by the 6 prompts, per dataset


def test_evaluate_flow_on_an_hf_directory(tmp_path, tiny_model_dir):
    from rlflow.flows.evaluate import evaluate

    metrics = evaluate(eval_config(tmp_path, tiny_model_dir, training_run_id=None))
    assert metrics["eval/again/num_prompts"] == 6


def parity_reward(prompts, responses, labels, **kw) -> list[float]:
    """1.0 when a response's character codes sum to an even number: the random tiny model gets about half its
    samples right, and every character counts, so pass@k is not trivial and a sample generated differently
    scores differently half the time."""
    return [float(sum(map(ord, r)) % 2 == 0) for r in responses]


def logged_samples(client: MlflowClient, run_id: str, tmp_path: Path) -> list:
    return json.loads(Path(client.download_artifacts(run_id, "samples/eval.json", str(tmp_path / run_id))
                           ).read_text())["data"]


def test_sharded_evaluation_equals_unsharded(tmp_path, tiny_model_dir):
    """2 shards per dataset as Ray tasks (prefect-ray, a local Ray) and 4 uneven ones in threads give exactly the
    metrics and logged samples of one unsharded task, sampling at temperature 1: each sample keeps its seed
    wherever it runs, and pass@k is scored on the merged samples."""
    from rlflow.flows.evaluate import evaluate

    def run(**eval_kw) -> tuple[dict, list]:
        cfg = eval_config(tmp_path, tiny_model_dir, eval_kw={"temperature": 1.0, "samples_logged": 4, **eval_kw},
                          name=f"ev-{eval_kw.get('shard_runner', 'thread')}-{eval_kw.get('shards', 1)}",
                          reward={"fn": "tests.test_evaluation:parity_reward"})
        metrics = evaluate(cfg)
        run = client.search_runs([client.get_experiment_by_name("rlflow").experiment_id],
                                 f"attributes.run_name = '{cfg.name}'")[0]
        return metrics, logged_samples(client, run.info.run_id, tmp_path)

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    one, one_samples = run()
    assert 0 < one["eval/sort3/accuracy"] < 1 and one["eval/sort3/pass_at_1"] < one["eval/sort3/pass_at_3"]
    assert len(one_samples) == 2 * 4  # samples_logged per dataset
    on_ray, ray_samples = run(shards=2, shard_runner="ray")
    assert on_ray == one and ray_samples == one_samples
    in_threads, thread_samples = run(shards=4)
    assert in_threads == one and thread_samples == one_samples


def test_a_worker_without_the_flows_model_dir_exports_its_own(tmp_path, tiny_model_dir):
    """A Ray worker on another node does not see the flow's export: it fetches the checkpoint once for itself."""
    from rlflow.flows.evaluate import is_hf_model_dir, model_dir_here

    fake_checkpoint(RunStore(StorageConfig(uri=str(tmp_path / "runs")), "r"), 2, tiny_model_dir)
    cfg = eval_config(tmp_path, f"file://{tmp_path}/runs/r")
    assert model_dir_here(cfg, tiny_model_dir) == tiny_model_dir
    here = model_dir_here(cfg, str(tmp_path / "on-the-flows-node"))
    assert is_hf_model_dir(Path(here)) and Path(here).parent.name.startswith("rlflow-eval-ev-")  # its own export
    assert model_dir_here(cfg, str(tmp_path / "on-the-flows-node")) == here  # once per process


# unlike the demo tokenizer's template, this one changes the ids: "R" before the prompt, "=" after it
CHAT = "{{ bos_token }}{% for m in messages %}R{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


@pytest.fixture
def chat_model_dir(tmp_path, tiny_model_dir) -> str:
    out = tmp_path / "chat_model"
    shutil.copytree(tiny_model_dir, out)
    tok = load_tokenizer(out)
    tok.chat_template = CHAT
    tok.save_pretrained(out)
    return str(out)


def test_train_and_eval_render_a_prompt_alike(tmp_path, chat_model_dir):
    """With data.chat_template a row reaches the model as the same token ids in the RL loop's rollout and in the
    evaluate flow's generation, and the template is really applied (the ids are not the raw text's)."""
    cfg = config_from_dict(small_recipe(tmp_path, model={"path": chat_model_dir}, data={"chat_template": True},
                                        cluster={"use_ray": False, "colocate": False}, debug={"mode": "rollout_only"}))
    prepare_data(cfg)
    session = RLSession.create(cfg, chat_model_dir, use_ray=False)
    try:
        session.rollout(0)
        st = session.steps.get(0)
        b = st.batch
        in_training = {st.rows[int(g)]["prompt"]: ids for g, ids in zip(b.group, b.prompt_ids, strict=True)}
    finally:
        session.shutdown()

    engine = TorchRolloutBackend(chat_model_dir, threads=1)
    fed: list[list[int]] = []
    generate = engine.generate_packed
    engine.generate_packed = lambda ids, *a, **kw: fed.extend(ids) or generate(ids, *a, **kw)
    e = EvalSamplingConfig(samples_per_prompt=1, chat_template=True)  # what the evaluate flow resolves for this run
    generate_and_reward(engine, load_reward_fn(cfg.reward.fn), {}, "d", st.rows, 0, e, 4)

    assert fed == [in_training[r["prompt"]] for r in st.rows]
    tok = engine.tokenizer
    raw = tok(st.rows[0]["prompt"])["input_ids"]
    assert fed[0] == raw[:1] + tok.convert_tokens_to_ids(["R"]) + raw[1:] + tok.convert_tokens_to_ids(["="])


def test_evaluation_renders_prompts_as_the_run_trained(tmp_path, tiny_model_dir):
    """eval.chat_template left empty: a store checkpoint's run recipe decides, an HF directory is raw text, a given
    value wins; the pipeline passes its training recipe's data.chat_template."""
    from rlflow.flows.evaluate import fetch_checkpoint, with_prompt_rendering
    from rlflow.flows.pipeline import eval_config as pipeline_eval_config

    store = RunStore(StorageConfig(uri=str(tmp_path / "runs")), "r")
    fake_checkpoint(store, 2, tiny_model_dir)
    store.write_json(small_recipe(tmp_path, data={"chat_template": True}), "config.json")
    cfg = eval_config(tmp_path, f"file://{tmp_path}/runs/r")
    assert cfg.eval.chat_template is None
    source = fetch_checkpoint(cfg, tmp_path / "w1")[1]
    assert with_prompt_rendering(cfg, source).eval.chat_template is True
    assert with_prompt_rendering(eval_config(tmp_path, cfg.checkpoint, eval_kw={"chat_template": False}),
                                 source).eval.chat_template is False
    hf = eval_config(tmp_path, tiny_model_dir)
    assert with_prompt_rendering(hf, fetch_checkpoint(hf, tmp_path / "w2")[1]).eval.chat_template is False

    train = config_from_dict(small_recipe(tmp_path, data={"chat_template": True}))
    assert pipeline_eval_config(PipelineConfig(train_recipe="t.yaml"), train, "uri").eval.chat_template is True


def test_pipeline_names_its_stage_runs_after_the_run_and_step(tmp_path, tiny_model_dir, monkeypatch):
    """In the UI the pipeline's children read <name>-train, <name>-eval-step<k> and <name>-register-step<k>, not
    Prefect's random names. The two deployment runs are stood in for: training commits step 4, evaluation logs
    its metric to an MLflow run tagged with its flow run id, as the real flows do."""
    import uuid
    from types import SimpleNamespace

    import yaml
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Completed

    from rlflow.flows import pipeline as pipeline_flow

    recipe = tmp_path / "train.yaml"
    recipe.write_text(yaml.safe_dump(small_recipe(tmp_path, name="exp7")))
    store = RunStore(StorageConfig(uri=str(tmp_path / "runs")), "exp7")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    started: dict[str, str] = {}

    def run_deployment(deployment: str, flow_run_name: str | None = None, **kw) -> SimpleNamespace:
        started[deployment] = flow_run_name
        run_id = uuid.uuid4()
        if deployment == "post-train/post-train":
            prepare_data(config_from_dict(small_recipe(tmp_path, name="exp7")))  # the data training writes
            fake_checkpoint(store, 4, tiny_model_dir)
        else:
            exp = client.get_experiment_by_name("rlflow") or client.get_experiment(client.create_experiment("rlflow"))
            run = client.create_run(exp.experiment_id, tags={"prefect.flow_run_id": str(run_id)})
            client.log_metric(run.info.run_id, "eval/data/accuracy", 0.5)  # data/eval.jsonl: the dataset "data"
        return SimpleNamespace(id=run_id, name=flow_run_name, state=Completed())

    monkeypatch.setattr(pipeline_flow, "run_deployment", run_deployment)
    state = pipeline_flow.pipeline(PipelineConfig(train_recipe=str(recipe)), return_state=True)

    assert started == {"post-train/post-train": "exp7-train", "evaluate/evaluate": "exp7-eval-step4"}
    assert state.result()["registered"]
    children = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as prefect:
        assert [r.name for r in prefect.read_flow_runs(flow_run_filter=children)] == ["exp7-register-step4"]


def test_shard_bounds_cover_every_prompt_once():
    assert shard_bounds(6, 4) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert shard_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]  # no empty shard
    assert shard_bounds(5, 1) == [(0, 5)]


def test_bad_shard_settings_name_the_field(tmp_path):
    raw = {"checkpoint": "x", "eval": {"datasets": [{"path": "ev.jsonl"}], "shards": 0, "shard_runner": "dask"}}
    with pytest.raises(RecipeError) as err:
        config_from_dict(raw, model=EvaluationConfig)
    assert "eval.shards: Input should be greater than 0" in str(err.value)
    assert "eval.shard_runner: Input should be 'thread' or 'ray' (got 'dask')" in str(err.value)


def test_register_logs_the_hf_export_and_promotes_versions(tmp_path, tiny_model_dir):
    from rlflow.flows.register import ChampionMeasurement, Measurement, register_model

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    eval_run = client.create_run(client.create_experiment("rlflow"), run_name="ev").info.run_id
    storage = StorageConfig(uri=str(tmp_path / "runs"))
    store = RunStore(storage, "r")
    first, second = fake_checkpoint(store, 1, tiny_model_dir), fake_checkpoint(store, 2, tiny_model_dir)
    registry, promote = RegisterConfig(model_name="m"), PromoteConfig(threshold=0.2)

    def measured(value: float) -> Measurement:
        return Measurement(metric_key="ev/accuracy", value=value, eval_run_id=eval_run, eval_hash="h")

    out = register_model(first, measured(0.5), None, registry, promote, uri, storage)
    assert out["registered"] and (out["version"], out["promotion"], out["champion"]) == (1, "promoted", 1)
    again = register_model(first, measured(0.5), None, registry, promote, uri, storage)
    assert again["version"] == 1 and again["reason"].startswith("already registered")
    champion = ChampionMeasurement(version=1, value=0.5, eval_run_id=eval_run, how="recorded")
    out = register_model(second, measured(0.4), champion, registry, promote, uri, storage)
    assert (out["version"], out["promotion"], out["champion"], out["challenger"]) == (2, "rejected", 1, 2)

    versions = {v.version: v for v in client.search_model_versions("name = 'm'")}
    assert set(versions) == {1, 2} and versions[2].tags["rlflow.metric_value"] == "0.4"
    # a version loads back through MLflow's own loaders (it has an MLmodel): a pipeline, and a pyfunc that generates
    import mlflow

    mlflow.set_tracking_uri(uri)
    try:
        pipe = mlflow.transformers.load_model("models:/m/2")
        assert pipe.task == "text-generation" and pipe.model.num_parameters() > 0
        out = mlflow.pyfunc.load_model("models:/m@champion").predict(["S123="], params={"max_new_tokens": 3})
        assert len(out) == 1 and out[0].startswith("S123=") and 5 < len(out[0]) <= 8  # char tokenizer: <= 3 chars
        assert pipe.tokenizer.get_vocab() == load_tokenizer(tiny_model_dir).get_vocab()
    finally:
        mlflow.set_tracking_uri(None)


def verl_source_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A verl compute_score: full marks only when the row's own columns arrive with each sample."""
    return float(data_source == "openai/gsm8k" and extra_info["index"] == int(ground_truth) - 1)


def test_a_verl_parquet_file_trains_as_it_is(tmp_path, chat_model_dir):
    """verl's rows (chat-message prompts, reward_model.ground_truth, data_source, extra_info) in the RL loop: the
    messages reach the model through the chat template, and verl's compute_score gets each sample's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlflow.engines.models.hf import encode_prompt

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "system", "content": "S"},
                                                       {"role": "user", "content": f"{i}+1"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
            for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "train.parquet"))
    cfg = config_from_dict(small_recipe(
        tmp_path, model={"path": chat_model_dir}, cluster={"use_ray": False, "colocate": False},
        data={"train_path": str(tmp_path / "train.parquet"), "eval_path": None, "generate": None},
        reward={"fn": "tests.test_evaluation:verl_source_reward"}, debug={"mode": "rollout_only"}))
    session = RLSession.create(cfg, chat_model_dir, use_ray=False)
    try:
        session.rollout(0)
        assert session.reward(0)["rollout/reward_mean"] == 1.0
        st = session.steps.get(0)
        first = st.rows[int(st.batch.group[0])]
        assert st.batch.prompt_ids[0] == encode_prompt(session.tokenizer, first["messages"])
    finally:
        session.shutdown()
