"""Debug modes, replay of stored rollout batches, and the trace timeline (docs/debugging.md).

One tiny run goes through the Prefect flow (local workers, MLflow on SQLite), keeps its rollout batches
and traces every step; a train-only run replays its batches and must end with bit-identical weights; a
rollout-only run scores batches without training. The bare loop's rollout-only run checks the rollout
engine's weights directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from bench.e2e.bare_loop import run_bare, run_steps
from rlflow.engines.core.config import RecipeError, config_from_dict
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.preflight import find_problems
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.timeline import STAGE_LANES
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.store.run_store import RunStore, replay_source
from rlflow.flows.cli import main as cli
from rlflow.flows.post_train import post_train
from tests.conftest import small_recipe, step_metrics

STEPS = 2
REQUESTS = 8 * 4  # prompts_per_step x samples_per_prompt of small_recipe


def _recipe(tmp: Path, name: str, **sections):
    base = {"name": name, "cluster": {"use_ray": False}, "train": {"steps": STEPS, "threads": 1},
            "eval": {"every": STEPS}, "checkpoint": {"keep_rollouts": True}}  # eval: the last step only
    return config_from_dict(small_recipe(tmp, **(base | sections)))


def _flow(cfg) -> list[dict]:
    try:
        by_step, _ = step_metrics(lambda: post_train(cfg))
    finally:
        mlflow.set_tracking_uri(None)
    return [by_step[k] for k in sorted(by_step)]


def _mlflow_run(cfg):
    client = MlflowClient(cfg.tracking.uri)
    run_id = RunStore(cfg.storage, cfg.name).read_json("status.json")["mlflow_run_id"]
    return client, run_id


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """The run to reproduce: two steps through the flow, batches kept, every step traced."""
    tmp = tmp_path_factory.mktemp("debug")
    cfg = _recipe(tmp, "original", debug={"trace_every": 1})
    return tmp, cfg, _flow(cfg)


def test_train_only_replay_reproduces_the_weights_bit_for_bit(original):
    tmp, orig_cfg, orig_hist = original
    cfg = _recipe(tmp, "replayed", debug={"mode": "train_only", "replay_run": "original"})
    hist = _flow(cfg)

    last = f"checkpoints/{STEPS - 1}/model/model.safetensors"
    want = load_file(RunStore(orig_cfg.storage, "original").path(last))
    got = load_file(RunStore(cfg.storage, "replayed").path(last))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)  # bit-identical, not just close
    for key in ("rollout/reward_mean", "train/loss", "train/grad_norm", "train/pg_loss", "adv/abs_mean"):
        assert [m[key] for m in hist] == [m[key] for m in orig_hist], key
    assert all(m["rollout/replayed"] == 1.0 for m in hist)
    assert all(m["train/grad_norm"] > 0 for m in hist)  # the weights did move: equal is not trivially true
    assert not any(k.startswith("eval/") for m in hist for k in m)  # no rollout engines: no eval


def test_rollout_only_scores_batches_and_trains_nothing(original):
    tmp, _, _ = original
    cfg = _recipe(tmp, "rollout-only", debug={"mode": "rollout_only"})
    hist = _flow(cfg)

    assert len(hist) == STEPS
    for m in hist:
        assert 0.0 <= m["rollout/reward_mean"] <= 1.0 and m["rollout/tokens_per_s"] > 0
        assert m["rollout/weight_version"] == 0.0  # weights never changed
        assert not any(k.startswith(("train/", "sync/", "adv/")) for k in m)
    store = RunStore(cfg.storage, cfg.name)
    assert store.committed_steps() == []  # nothing trained, nothing to checkpoint
    assert all(store.load_rollout(s) is not None for s in range(STEPS))  # batches kept for a train-only replay
    client, run_id = _mlflow_run(cfg)
    assert [m.step for m in client.get_metric_history(run_id, "rollout/reward_mean")] == list(range(STEPS))


def test_rollout_only_in_the_bare_loop_leaves_the_weights_unchanged(tmp_path):
    cfg = _recipe(tmp_path, "bare-rollout-only", debug={"mode": "rollout_only"})
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    try:
        assert len(session.train_group) == 0  # no train workers started
        before = session.rollout_group.call(TorchRolloutBackend.named_tensors)[0]
        hist = run_steps(session, cfg, log=lambda line: None)
        after = session.rollout_group.call(TorchRolloutBackend.named_tensors)[0]
    finally:
        session.shutdown()
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(before, after, strict=True))
    assert [sorted(k for k in m if k.startswith("rollout/reward")) for m in hist] == [
        ["rollout/reward_mean", "rollout/reward_std"]] * STEPS


def test_trace_timeline_is_chrome_json_in_mlflow_and_renders(original, tmp_path):
    _, cfg, _ = original
    client, run_id = _mlflow_run(cfg)
    names = sorted(a.path for a in client.list_artifacts(run_id, "traces"))
    assert names == [f"traces/step_{s:06d}.json" for s in range(STEPS)]
    trace_file = Path(client.download_artifacts(run_id, names[-1], str(tmp_path / "dl")))
    trace = json.loads(trace_file.read_text())

    events = trace["traceEvents"]
    assert all({"ph", "pid", "tid", "name"} <= e.keys() for e in events)
    assert all(isinstance(e["ts"], float | int) for e in events if e["ph"] != "M")
    assert all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    stages = {e["name"] for e in spans if e["args"].get("step") == STEPS - 1}
    assert {"rollout", "reward", "advantages", "train", "sync-weights"} <= stages <= set(STAGE_LANES)
    requests = [e for e in spans if e["name"] == "request"]
    assert len({e["pid"] for e in requests}) == 1 and {e["pid"] for e in requests} != {e["pid"] for e in spans
                                                                                     if e["name"] == "train"}
    assert all(0 < r["args"]["completion_tokens"] <= 4 for r in requests)
    # one clock for all processes: the rollout stage's span holds the step's requests, eval's span the rest
    def inside(stage: str) -> list[dict]:
        s = next(e for e in spans if e["name"] == stage and e["args"]["step"] == STEPS - 1)
        return [r for r in requests if s["ts"] <= r["ts"] and r["ts"] + r["dur"] <= s["ts"] + s["dur"]]

    evals = min(cfg.eval.max_prompts, 32)  # the last step evaluates
    assert len(inside("rollout")) == REQUESTS and len(inside("evaluate")) == evals
    assert len(requests) == REQUESTS + evals
    assert sum(e["name"] == "first_token" for e in events) == sum(e["name"] == "queued" for e in events) == len(
        requests)
    assert any(e["name"] == "weight_update" and e["args"]["version"] == STEPS for e in events)

    out = tmp_path / "timeline.png"
    assert cli(["trace", "render", cfg.name, "--store", cfg.storage.uri, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    again = tmp_path / "from_file.png"
    assert cli(["trace", "render", str(trace_file), "--out", str(again)]) == 0
    assert again.stat().st_size > 20_000
    mlflow.set_tracking_uri(None)


def test_rollout_worker_records_requests_and_weight_updates(tiny_model_dir):
    engine = TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=2, trace=True, rank=3)
    engine.generate([[1, 5, 6], [1, 7], [1, 4, 4]], SamplingParams(max_new_tokens=3), seed=0)
    engine.update_weights(engine.named_tensors(), version=7)
    events = engine.drain_trace()
    assert events[0]["name"] == "process_name" and events[0]["args"]["name"] == "rollout-3"
    requests = sorted((e for e in events if e["name"] == "request"), key=lambda e: e["ts"])
    assert len(requests) == 3 and {r["tid"] for r in requests} == {1, 2}  # two KV-cache slots, lanes 1 and 2
    queued = {e["args"]["rid"]: e["ts"] for e in events if e["name"] == "queued"}
    first = {e["args"]["rid"]: e["ts"] for e in events if e["name"] == "first_token"}
    for r in requests:  # queued <= start <= first token <= finish
        rid = r["args"]["rid"]
        assert queued[rid] <= r["ts"] <= first[rid] <= r["ts"] + r["dur"]
    # the third waited for a free slot: it starts when one of the first two ended
    assert requests[2]["ts"] >= min(r["ts"] + r["dur"] for r in requests[:2])
    assert [e["args"] for e in events if e["name"] == "weight_update"] == [{"version": 7}]
    assert engine.drain_trace() == []  # drained
    quiet = TorchRolloutBackend(tiny_model_dir, threads=1)  # tracing off: nothing recorded
    quiet.generate([[1, 5]], SamplingParams(max_new_tokens=2), seed=0)
    assert quiet.drain_trace() == []


@pytest.mark.parametrize(("debug", "extra", "error"), [
    ({"mode": "train_only"}, {}, r"debug\.replay_run: train_only needs a run"),
    ({"mode": "rollout_only", "replay_run": "x"}, {}, r"debug\.replay_run: rollout_only generates"),
    ({"mode": "rollout_only"}, {"rollout": {"max_staleness": 1}}, r"debug\.mode: rollout_only .* synchronously"),
    ({"replay_run": "t"}, {}, r"debug\.replay_run: 't' is this run"),
    ({"trace_every": -1}, {}, r"debug\.trace_every"),
])
def test_debug_recipe_errors_name_the_field(tmp_path, debug, extra, error):
    with pytest.raises(RecipeError, match=error):
        config_from_dict(small_recipe(tmp_path, debug=debug, **extra))


def test_replay_of_a_missing_run_or_batch_is_a_clear_error(original, tmp_path):
    _, orig_cfg, _ = original
    cfg = _recipe(tmp_path, "r", debug={"mode": "train_only", "replay_run": "nope"})
    with pytest.raises(FileNotFoundError, match=r"debug\.replay_run: no run 'nope'"):
        replay_source(cfg)
    assert any("debug.replay_run: no run 'nope'" in p for p in find_problems(cfg))  # rlflow validate says so
    # one step more than the original run made: the bare loop replays two steps, then names what is missing
    cfg = _recipe(tmp_path, "r", debug={"mode": "train_only", "replay_run": "original",
                                        "replay_store": orig_cfg.storage.uri}, train={"steps": STEPS + 1})
    with pytest.raises(FileNotFoundError, match=rf"no committed rollout batch for step {STEPS} .*keep_rollouts"):
        run_bare(cfg, str(tmp_path), log=lambda line: None)


def test_one_step_off_traces_keep_each_steps_rollout(tmp_path):
    """With one-step-off async, step k+1's rollout runs (and is drained) during step k; step k+1's trace
    still holds its rollout span and requests."""
    cfg = _recipe(tmp_path, "async-trace", rollout={"max_staleness": 1}, train={"steps": 3},
                  debug={"trace_every": 1})
    run_bare(cfg, str(tmp_path), log=lambda line: None, trace_dir=str(tmp_path / "traces"))
    for step in range(3):
        events = json.loads((tmp_path / "traces" / f"step_{step:06d}.json").read_text())["traceEvents"]
        own = [e for e in events if e["ph"] == "X" and e["args"].get("step") == step]
        assert {e["name"] for e in own} >= {"rollout", "reward", "train", "sync-weights"}, step
        rollout = next(e for e in own if e["name"] == "rollout")
        requests = [e for e in events if e["name"] == "request" and rollout["ts"] <= e["ts"] <= rollout["ts"]
                    + rollout["dur"]]
        assert len(requests) == REQUESTS, step
