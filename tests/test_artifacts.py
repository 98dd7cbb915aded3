"""Prefect artifacts of a training run: few API calls (progress in 5 % steps), and what each one holds.

Runs inside a real flow on Prefect's temporary local server; the artifact functions are wrapped only to
count and record their calls, which still reach the server.
"""

from __future__ import annotations

from prefect import flow

from rlflow.tasks import artifacts as art


def test_training_artifacts_are_few_and_complete(monkeypatch):
    calls: dict[str, list] = {"progress": [], "markdown": [], "table": []}

    def recording(kind, fn):
        def call(*args, **kwargs):
            calls[kind].append((args, kwargs))
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(art, "update_progress_artifact", recording("progress", art.update_progress_artifact))
    monkeypatch.setattr(art, "create_markdown_artifact", recording("markdown", art.create_markdown_artifact))
    monkeypatch.setattr(art, "create_table_artifact", recording("table", art.create_table_artifact))

    @flow
    def fake_training():
        a = art.TrainingArtifacts("My_Run.1", total_steps=200, start_step=0, mlflow_url="http://mlflow/#/x")
        for step in range(200):
            metrics = {"rollout/reward_mean": step / 200, "rollout/accuracy": 0.5}
            if step % 50 == 49:
                metrics |= {"eval/reward_mean": 0.7, "eval/accuracy": 0.6 if step == 199 else 0.1}
                a.samples(step, [{"kind": "eval", "prompt": "3 1 2", "response": "1 2 3", "reward": 1.0}])
            if step % 100 == 99:
                a.checkpoint(step, metrics, f"s3://b/runs/My_Run.1/checkpoints/{step}")
            a.step_done(step, metrics)

    fake_training()
    assert [args[1] for args, _ in calls["progress"]] == [5.0 * i for i in range(1, 21)]  # 20 calls in 200 steps
    assert len(calls["table"]) == 4 and calls["table"][0][1]["key"] == "my-run-1-samples"
    assert len(calls["markdown"]) == 2
    (text,), kwargs = calls["markdown"][1]
    assert kwargs["key"] == "my-run-1-checkpoint"
    for needle in ("| step | 199 of 200 |", "| eval/accuracy (latest eval) | 0.6 |", "s3://b/runs/My_Run.1/checkpoints/199",
                   "http://mlflow/#/x", "| reward (rollout mean) | 0.995 |"):
        assert needle in text, needle
