"""The whole stack on the tiny model: Prefect flow -> Ray actors -> MLflow + run store. Reward must rise."""

from __future__ import annotations

import mlflow
from mlflow.tracking import MlflowClient

from flows.post_train import post_train
from tasks.run_context import STEP_LISTENERS
from tasks.run_store import RunStore


def test_post_train_flow_learns_and_tracks(recipe, tmp_path):
    cfg = recipe(
        name="e2e",
        model={"hidden_size": 96, "intermediate_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4},
        data={"generate": {"task": "sort", "num_digits": 4, "num_train": 5000, "num_eval": 64}},
        rollout={"prompts_per_step": 64, "samples_per_prompt": 8, "max_new_tokens": 5},
        algorithm={"clip_high": 0.28},
        train={"steps": 24, "lr": 1e-3, "mini_batches": 4, "threads": 2},
        checkpoint={"every": 12},
        eval={"every": 12, "max_prompts": 64},
    )
    history: list[dict] = []
    STEP_LISTENERS.append(lambda step, m: history.append(m))
    try:
        final = post_train(cfg)
    finally:
        STEP_LISTENERS.clear()

    rewards = [m["rollout/reward_mean"] for m in history]
    assert len(rewards) == 24
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.05, rewards
    assert all(m["rollout/weight_version"] == i for i, m in enumerate(history))  # on-policy: synced every step
    assert "eval/reward_mean" in final

    store = RunStore(cfg.storage.uri, cfg.name)
    assert store.committed_steps() == [11, 23] and store.latest_step() == 23

    client = MlflowClient(cfg.tracking.uri)
    run = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.001"
    logged = client.get_metric_history(run.info.run_id, "rollout.reward_mean")
    assert [m.step for m in logged] == list(range(24))
    for key in ("train.loss", "train.grad_norm", "time.rollout", "time.train", "eval.reward_mean"):
        assert client.get_metric_history(run.info.run_id, key), key
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"recipe.json", "samples"} <= artifacts
    mlflow.set_tracking_uri(None)
