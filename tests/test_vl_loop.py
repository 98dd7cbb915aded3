"""Vision-language models through the RL loop (issue 44): the count task's pictures go from the data file to the run
store once, through the embedded engine and the native trainer, and a weight sync moves the vision tower only when
it trains; a run killed mid-way resumes to the weights and metrics of one never interrupted (CPU, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from rlflow.engines.core.config import BuiltinTaskConfig, StorageConfig, config_from_dict
from rlflow.engines.data.builtin_tasks import write_task_files
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.store.run_store import RunStore
from tests.conftest import small_recipe
from tests.test_resume import (  # noqa: F401 - prefect_api and ray_head are fixtures used below
    STEPS,
    _assert_same_as_uninterrupted,
    _outcome,
    _rlflow,
    prefect_api,
    ray_head,
)

VL_MODEL = {"arch": "qwen2_vl", "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 2, "max_seq_len": 32}


def _vl_recipe(tmp_path: Path, data: Path, **sections) -> dict:
    return small_recipe(
        tmp_path, model=VL_MODEL,
        data={"train_path": str(data / "train.parquet"), "eval_path": str(data / "eval.parquet"),
              "generate": {"task": "count", "num_digits": 4, "num_train": 200, "num_eval": 8}},
        rollout={"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 2}, **sections)


def _visual(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The vision tower's parameters, whole (an FSDP2 trainer's are DTensors on its one rank)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters() if ".visual." in f".{n}"}


@pytest.mark.parametrize("freeze", [True, False])
def test_a_step_moves_the_pictures_once_and_syncs_the_tower_only_when_it_trains(tmp_path, freeze):
    # an entropy bonus: the random model's rewards are all 0 (no advantage), and the step must still move weights
    cfg = config_from_dict(_vl_recipe(tmp_path, tmp_path / "data", algorithm={"entropy_coef": 0.01},
                                      train={"steps": 1, "threads": 1, "lr": 0.05, "freeze_vision": freeze}))
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    try:
        trainer, engine = session.train_group.workers[0].model, session.rollout_group.workers[0].model
        start = _visual(engine)
        assert start and start.keys() == _visual(trainer).keys()
        session.rollout(0)
        batch = session.rollout_batch(0)
        digests = {d for row in batch.images for d in row}
        assert len(digests) == cfg.rollout.prompts_per_step  # one picture a prompt, shared by its group
        n = cfg.rollout.samples_per_prompt
        assert all(len({tuple(x) for x in batch.images[g * n:(g + 1) * n]}) == 1 for g in range(4))  # a group's
        session.reward(0)
        session.advantages(0)
        session.train(0)
        session.sync_weights(0)
        after_trainer, after_engine = _visual(trainer), _visual(engine)
        moved = [n for n in start if not torch.equal(start[n], after_engine[n])]
        assert all(torch.equal(after_engine[n], after_trainer[n]) for n in start)  # the engine has the trainer's
        assert (moved == []) if freeze else moved
    finally:
        session.shutdown()
    stored = RunStore(cfg.storage, cfg.name).files("images")
    assert sorted(Path(f).name for f in stored) == sorted(digests)


def test_a_killed_vision_language_run_resumes_exactly(tmp_path, prefect_api, ray_head):  # noqa: F811 - fixtures
    """The train actor killed before step 2's train stage; the same command resumes from the checkpoint of step 1
    and ends with every weight (vision tower included: it trains) and metric of a run never interrupted."""
    data = tmp_path / "data"
    data.mkdir()
    write_task_files(BuiltinTaskConfig(task="count", num_digits=4, num_train=200, num_eval=8, seed=3),
                     str(data / "train.parquet"), str(data / "eval.parquet"))
    outcomes = []
    for name, fault in (("vl-ref", None), ("vl-killed", "train:2:before:train")):
        storage = StorageConfig(uri=str(tmp_path / "store"))
        raw = _vl_recipe(tmp_path, data, name=name,
                         train={"steps": STEPS, "threads": 1, "mini_batches": 2, "freeze_vision": False},
                         checkpoint={"every": 2, "keep_last": 2}, eval={"every": 3, "max_prompts": 8},
                         cluster={"address": ray_head})
        raw["data"].pop("generate")
        raw["storage"] = {"uri": storage.uri}
        raw["tracking"] = {"uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": name}
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(yaml.safe_dump(raw))
        first = _rlflow(["run", str(recipe)], prefect_api, fault=fault)
        if fault:
            assert first.returncode != 0, f"fault {fault} did not stop the run"
            resumed = _rlflow(["run", str(recipe)], prefect_api)
            assert resumed.returncode == 0, resumed.stderr[-3000:]
        else:
            assert first.returncode == 0, first.stderr[-3000:]
        outcomes.append(_outcome(recipe, storage, name))
    reference, resumed = outcomes
    assert any(".visual." in f".{k}" for k in reference[0])
    _assert_same_as_uninterrupted(resumed, reference)


@pytest.mark.parametrize("section,change,field", [
    ("train", {"lora": {"rank": 4}}, "train.lora"),
    ("rollout", {"true_on_policy": True}, "rollout.true_on_policy"),
    ("algorithm", {"advantage": "gae"}, "a critic"),
    ("train", {"context_parallel": 2, "num_workers": 2}, "train.context_parallel"),
    ("rollout", {"env": {"cls": "rlflow.engines.env.python_tool:PythonToolEnv"}}, "rollout.env"),
])
def test_features_not_built_for_vision_language_models_are_refused_by_name(tmp_path, section, change, field):
    raw = _vl_recipe(tmp_path, tmp_path / "data")
    raw[section] = {**raw.get(section, {}), **change}
    with pytest.raises(ValueError, match=f"{field}.*not supported with a vision-language model"):
        config_from_dict(raw)


def test_a_released_engine_keeps_a_frozen_tower_that_no_sync_sends(tmp_path):
    """Colocated runs release the engine's weights for the trainer and the next sync refills them; a frozen tower is
    never sent (train.freeze_vision), so the engine keeps it resident: after release and a language-model-only sync
    it is the loaded tower, bit for bit, and its cached embeddings stay valid (an update does not clear them)."""
    from rlflow.engines.core.config import ModelConfig
    from rlflow.engines.models.hf import build_tiny_model, load_model
    from rlflow.engines.rollout.torch_backend import TorchRolloutBackend

    path = build_tiny_model(ModelConfig(**VL_MODEL), tmp_path / "m", seed=0)
    loaded = load_model(path)
    engine = TorchRolloutBackend(str(path), batch_size=4, context_len=32, frozen_vision=True)
    try:
        before = _visual(engine.model)
        assert before and all(torch.equal(before[n], t) for n, t in _visual(loaded).items())
        engine.release_memory_occupation()
        language = [(n, p.detach()) for n, p in loaded.named_parameters() if ".visual." not in f".{n}"]
        engine.update_weights(language, version=1)
        assert all(torch.equal(before[n], t) for n, t in _visual(engine.model).items())
        with pytest.raises(KeyError):  # the tower is no sync target: a trainer that sends it is misconfigured
            engine.update_weights([next((n, p.detach()) for n, p in loaded.named_parameters()
                                        if ".visual." in f".{n}")], version=2)
    finally:
        engine.close()


def test_a_train_only_replay_of_a_vision_language_run_reads_its_pictures(tmp_path):
    """debug.replay_run with a VL model: the replayed batches name the first run's pictures, which the train
    workers read from that run's store; the replay trains to the same weights, bit for bit."""
    common = dict(algorithm={"entropy_coef": 0.01}, train={"steps": 2, "threads": 1, "lr": 0.05,
                                                           "freeze_vision": False})
    first = config_from_dict(_vl_recipe(tmp_path, tmp_path / "data", name="first", **common))
    prepare_data(first)
    model = prepare_model(first, tmp_path)
    store = RunStore(first.storage, first.name)
    store.write_json(first.model_dump(mode="json"), "config.json")

    def run(cfg, keep: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        session = RLSession.create(cfg, model, use_ray=False)
        losses = []
        try:
            for step in range(cfg.train.steps):
                session.rollout(step)
                if keep:  # what the flow's rollout task persists (checkpoint.keep_rollouts)
                    store.save_rollout(step, session.rollout_table(step))
                session.reward(step)
                session.advantages(step)
                losses.append(session.train(step)["train/loss"])
                session.sync_weights(step)
            trainer = session.train_group.workers[0].model
            weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                       for n, p in trainer.named_parameters()}
        finally:
            session.shutdown()
        return losses, weights

    losses, weights = run(first, keep=True)
    replay = config_from_dict(_vl_recipe(tmp_path, tmp_path / "data", name="replayed",
                                         debug={"mode": "train_only", "replay_run": "first"}, **common))
    replay_losses, replay_weights = run(replay, keep=False)
    assert replay_losses == losses
    assert all(torch.equal(weights[n], replay_weights[n]) for n in weights)
    assert not RunStore(replay.storage, "replayed").exists("images")  # the pictures were read from the first run
