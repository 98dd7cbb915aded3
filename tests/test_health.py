"""Run-health gates (engines/core/health.py, tasks/health.py) and the train/rollout log-prob difference they watch.

The pure checks run on hand-made metric sequences; the metric comes from the real train backends in a bare loop
(with and without rollout correction); one flow run on the tiny model plants a NaN (tasks/faults.py's `nan`) and a
reward collapse, and must fail naming the check, with the Prefect artifact and the MLflow tags in place, and its
resume must go on counting the collapse window from the checkpoint.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import yaml

from bench.e2e.bare_loop import run_bare
from rlflow.engines.core import algorithms as A
from rlflow.engines.core.batch import pack_samples
from rlflow.engines.core.config import AlgorithmConfig, HealthConfig, RecipeError, TrainConfig, config_from_dict
from rlflow.engines.core.health import HealthCheckFailed, HealthMonitor
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.conftest import small_recipe, step_metrics

DIFF_MAX, DIFF_MEAN = "train/rollout_logprob_diff_max", "train/rollout_logprob_diff_mean"
NAN, INF = float("nan"), float("inf")


# ---- the metric: a pure tensor function, by hand ---------------------------------------------------------------

TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -2.0, -0.4], [-INF, -1.0, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


def test_logprob_diff_by_hand():
    # kept: |(-1) - (-1.5)| = 0.5, |(-2) - (-2)| = 0, |(-1.2) - (-1)| = 0.2; the -inf rollout logprob (none given)
    # and the masked column (a difference of 5.0 and 0.1) are left out
    stats = A.logprob_diff(TRAIN, ROLLOUT, MASK)
    assert stats.tolist() == pytest.approx([0.5, 0.7, 3.0])
    m = A.logprob_diff_metrics(stats)
    assert m == {"rollout_logprob_diff_max": pytest.approx(0.5), "rollout_logprob_diff_mean": pytest.approx(0.7 / 3)}


def test_logprob_diff_parts_merge_to_the_whole():
    parts = [A.logprob_diff(TRAIN[i:i + 1], ROLLOUT[i:i + 1], MASK[i:i + 1]) for i in range(2)]
    assert torch.allclose(A.merge_logprob_diff(*parts), A.logprob_diff(TRAIN, ROLLOUT, MASK))
    assert A.logprob_diff_metrics(torch.zeros(3)) == {"rollout_logprob_diff_max": 0.0,
                                                      "rollout_logprob_diff_mean": 0.0}


def test_logprob_diff_keeps_nan_on_the_mask_only():
    off = TRAIN.clone()
    off[0, 2] = NAN  # masked: never seen
    assert A.logprob_diff(off, ROLLOUT, MASK).tolist() == pytest.approx([0.5, 0.7, 3.0])
    on = TRAIN.clone()
    on[1, 1] = NAN
    m = A.logprob_diff_metrics(A.logprob_diff(on, ROLLOUT, MASK))
    assert math.isnan(m["rollout_logprob_diff_max"]) and math.isnan(m["rollout_logprob_diff_mean"])
    merged = A.merge_logprob_diff(A.logprob_diff(TRAIN, ROLLOUT, MASK), A.logprob_diff(on, ROLLOUT, MASK))
    assert math.isnan(float(merged[0]))  # NaN wins the max


# ---- the pure checks on hand-made metric sequences ---------------------------------------------------------------

def healthy(step: int) -> dict[str, float]:
    return {"train/loss": 0.1, "train/grad_norm": 1.0, "rollout/reward_mean": 0.3 + step / 100, "adv/abs_mean": 0.5,
            DIFF_MAX: 0.02, DIFF_MEAN: 1e-3, "train/entropy": 1.5, "adv/zero_std_groups": 0.25,
            "rollout/reward_std": 0.4}


def monitor(start: int = 0, group_size: int = 4, state: dict | None = None, **checks) -> HealthMonitor:
    return HealthMonitor(HealthConfig(**checks), start, group_size, state)


def run_checks(mon: HealthMonitor, changes: dict[int, dict], steps: range) -> dict[int, list]:
    """Each step's findings over `steps` of healthy metrics with `changes` at some steps."""
    return {s: mon.observe(s, healthy(s) | changes.get(s, {})) for s in steps}


def fired(found: dict[int, list]) -> list[tuple[int, str, str]]:
    return [(s, f.check, f.action) for s, fs in found.items() for f in fs]


def test_healthy_runs_stay_quiet_with_every_check_on():
    mon = monitor(**{c: "fail" for c in HealthConfig.model_fields})
    assert fired(run_checks(mon, {}, range(30))) == []
    assert mon.state() == {"entropy_low": 0, "reward_flat": 0}


@pytest.mark.parametrize("key", ["train/loss", "train/grad_norm", "rollout/reward_mean", "adv/abs_mean", DIFF_MAX])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_fails_by_default_naming_check_step_and_value(key, bad):
    found = run_checks(monitor(), {3: {key: bad}}, range(5))
    assert fired(found) == [(3, "non_finite", "fail")]
    f = found[3][0]
    assert (f.metric, f.step) == (key, 3) and (math.isnan(f.value) if bad != bad else f.value == bad)
    message = str(HealthCheckFailed(f))
    assert message.startswith(f"health check non_finite failed at step 3: {key} = {bad}"), message


def test_non_finite_names_every_bad_metric_and_skips_missing_ones():
    found = run_checks(monitor(), {1: {"train/loss": NAN, "train/grad_norm": INF}}, range(2))
    assert "train/loss, train/grad_norm" in found[1][0].message
    mon = monitor()
    assert mon.observe(0, {"rollout/reward_mean": 0.5}) == []  # a step without training: nothing else to check


def test_first_step_checks_the_first_step_of_each_attempt_only():
    wrong = {DIFF_MEAN: 0.4}  # the engines disagree: another set of weights sampled the batch
    assert fired(run_checks(monitor(), {0: wrong}, range(3))) == [(0, "first_step", "warn")]
    assert fired(run_checks(monitor(), {1: wrong}, range(3))) == []  # later steps: not this check's
    found = run_checks(monitor(start=7, first_step="fail"), {7: wrong}, range(7, 9))  # a resumed attempt
    assert fired(found) == [(7, "first_step", "fail")]
    assert found[7][0].message.startswith("health check first_step failed at step 7: "
                                          "train/rollout_logprob_diff_mean = 0.4, allowed <= 0.1")
    tuned = monitor(first_step={"max_logprob_diff_mean": 0.5})
    assert fired(run_checks(tuned, {0: wrong}, range(1))) == []


def test_logprob_mismatch_bounds_the_max_or_the_mean():
    assert fired(run_checks(monitor(), {2: {DIFF_MAX: 2.5}}, range(4))) == [(2, "logprob_mismatch", "warn")]
    assert fired(run_checks(monitor(), {2: {DIFF_MAX: 2.0}}, range(4))) == []  # at the bound: allowed
    by_mean = monitor(logprob_mismatch={"statistic": "mean", "threshold": 0.05, "action": "fail"})
    found = run_checks(by_mean, {2: {DIFF_MAX: 9.0}, 3: {DIFF_MEAN: 0.06}}, range(4))
    assert fired(found) == [(3, "logprob_mismatch", "fail")]
    assert found[3][0].metric == DIFF_MEAN and found[3][0].value == 0.06


def test_entropy_collapse_needs_a_whole_window():
    cfg = {"entropy_collapse": {"threshold": 0.01, "window": 3}}
    low = {"train/entropy": 0.005}
    changes = {1: low, 2: low, 4: low, 5: low, 6: low, 7: low, 8: {"train/entropy": 0.01}}  # 0.01: at the bound
    found = run_checks(monitor(**cfg), changes, range(10))
    assert fired(found) == [(6, "entropy_collapse", "warn"), (7, "entropy_collapse", "warn"),
                            (8, "entropy_collapse", "warn")]
    assert found[6][0].detail == "3 steps in a row" and found[8][0].value == 0.01


def test_reward_collapse_over_all_groups_or_a_flat_batch():
    flat = {"adv/zero_std_groups": 1.0, "rollout/reward_mean": 0.0, "rollout/reward_std": 0.0}
    cfg = {"reward_collapse": {"window": 2}}
    found = run_checks(monitor(**cfg), {1: flat, 2: {"adv/zero_std_groups": 0.9}, 3: flat, 4: flat}, range(6))
    assert fired(found) == [(4, "reward_collapse", "warn")]
    assert "rollout/reward_mean = 0" in found[4][0].message
    some = monitor(reward_collapse={"window": 2, "min_zero_std_groups": 0.8})
    assert fired(run_checks(some, {0: {"adv/zero_std_groups": 0.8}, 1: {"adv/zero_std_groups": 0.9}},
                            range(2))) == [(1, "reward_collapse", "warn")]
    # one sample per prompt: every group is trivially flat, so the batch's reward std decides
    single = monitor(group_size=1, **cfg)
    assert fired(run_checks(single, {s: {"adv/zero_std_groups": 1.0} for s in range(4)}, range(4))) == []
    found = run_checks(monitor(group_size=1, **cfg), {0: flat, 1: flat}, range(2))
    assert fired(found) == [(1, "reward_collapse", "warn")] and found[1][0].metric == "rollout/reward_std"


def test_off_is_silent_and_fail_sorts_first():
    bad = {2: {"train/loss": NAN, DIFF_MAX: 5.0}}
    assert fired(run_checks(monitor(non_finite="off", logprob_mismatch="off"), bad, range(3))) == []
    found = run_checks(monitor(), bad, range(3))
    assert fired(found) == [(2, "non_finite", "fail"), (2, "logprob_mismatch", "warn")]
    warn_only = monitor(non_finite="warn")
    assert [f.action for f in run_checks(warn_only, bad, range(3))[2]] == ["warn", "warn"]
    assert warn_only.observe(3, healthy(3)) == []


def test_windows_resume_from_the_stored_state():
    cfg = {"entropy_collapse": {"threshold": 0.01, "window": 3}, "reward_collapse": {"window": 3}}
    collapsed = {"train/entropy": 0.0, "adv/zero_std_groups": 1.0}
    first = monitor(**cfg)
    assert fired(run_checks(first, {0: collapsed, 1: collapsed}, range(2))) == []
    state = first.state()
    assert state == {"entropy_low": 2, "reward_flat": 2}
    resumed = monitor(start=2, state=yaml.safe_load(yaml.safe_dump(state)), **cfg)  # as JSON in meta.json
    assert fired(run_checks(resumed, {2: collapsed}, range(2, 3))) == [(2, "entropy_collapse", "warn"),
                                                                       (2, "reward_collapse", "warn")]
    assert fired(run_checks(monitor(start=2, **cfg), {2: collapsed}, range(2, 3))) == []  # without it: counts anew


def test_recipe_section_shorthands_defaults_and_errors(tmp_path):
    cfg = config_from_dict(small_recipe(tmp_path))
    h = cfg.health
    assert (h.non_finite.action, h.first_step.action, h.logprob_mismatch.action, h.entropy_collapse.action,
            h.reward_collapse.action) == ("fail", "warn", "warn", "warn", "warn")
    raw = yaml.safe_load("health: {entropy_collapse: off, reward_collapse: fail, non_finite: {action: off},\n"
                         "         logprob_mismatch: {statistic: mean, threshold: 0.2}}")  # YAML reads `off` as false
    h = config_from_dict(small_recipe(tmp_path, **raw)).health
    assert (h.entropy_collapse.action, h.reward_collapse.action, h.non_finite.action) == ("off", "fail", "off")
    assert (h.logprob_mismatch.statistic, h.logprob_mismatch.threshold) == ("mean", 0.2)
    assert h.entropy_collapse.window == 10  # the shorthand keeps the check's other defaults
    with pytest.raises(RecipeError, match=r"health\.entropy_collapse: .*'loud' is not a check setting"):
        config_from_dict(small_recipe(tmp_path, health={"entropy_collapse": "loud"}))
    with pytest.raises(RecipeError, match=r"health\.reward_collapse\.window"):
        config_from_dict(small_recipe(tmp_path, health={"reward_collapse": {"window": 0}}))
    with pytest.raises(RecipeError, match=r"health\.first_step\.max_diff"):
        config_from_dict(small_recipe(tmp_path, health={"first_step": {"max_diff": 1}}))


# ---- publishing (tasks/health.py) ---------------------------------------------------------------------------------

class _Tracker:
    def __init__(self):
        self.tags: dict[str, str] = {}

    def set_tags(self, tags):
        self.tags |= tags


class _Artifacts:
    def __init__(self):
        self.tables: list[tuple[int, list[dict]]] = []

    def health(self, step, rows):
        self.tables.append((step, rows))


def test_check_step_tags_logs_tables_once_per_new_check_and_raises(caplog):
    from rlflow.tasks.health import check_step  # Prefect's import cost: this test only

    run = SimpleNamespace(health=monitor(entropy_collapse={"threshold": 5.0, "window": 1}), health_findings={},
                          tracker=_Tracker(), artifacts=_Artifacts())
    assert check_step(run, 0, healthy(0))[0].check == "entropy_collapse"
    check_step(run, 1, healthy(1))  # the same warning again: a tag update, no new table
    assert run.tracker.tags == {"health.entropy_collapse": "warn at step 1: train/entropy = 1.5, allowed > 5 "
                                                           "within 1 steps (2 steps in a row)"}
    assert [step for step, _ in run.artifacts.tables] == [0]
    with pytest.raises(HealthCheckFailed, match=r"non_finite failed at step 2: train/grad_norm = nan"):
        check_step(run, 2, healthy(2) | {"train/grad_norm": NAN})
    assert run.tracker.tags["health.non_finite"] == "fail at step 2: train/grad_norm = nan, allowed finite"
    step, rows = run.artifacts.tables[-1]
    assert step == 2 and [(r["check"], r["step"], r["value"]) for r in rows] == [
        ("entropy_collapse", 2, "1.5"), ("non_finite", 2, "nan")]
    assert "health check entropy_collapse warns at step 0" in caplog.text


# ---- the metric from the real train backends, every step, in each mode -----------------------------------------

@pytest.mark.parametrize("algorithm", [{}, {"is_correction": "tis"}], ids=["plain", "rollout-correction"])
def test_the_log_prob_difference_is_in_every_step(tmp_path, algorithm):
    cfg = config_from_dict(small_recipe(tmp_path, algorithm=algorithm, train={"steps": 2, "threads": 1},
                                        eval={"every": 0}, checkpoint={"every": 0}))
    history = run_bare(cfg, str(tmp_path), log=lambda line: None)
    assert len(history) == 2
    for m in history:
        # fp32 on the CPU: the rollout engine's logprobs equal the trainer's to ~1e-5 (docs/architecture.md)
        assert 0 <= m[DIFF_MEAN] <= m[DIFF_MAX] < 1e-3, m
    if algorithm:  # measured by the advantages stage, over the whole batch, beside the correction's own metrics
        assert all(m["rollout_corr/is_ratio_mean"] == pytest.approx(1.0, abs=1e-3) for m in history)


def test_the_train_step_measures_its_first_forward_against_the_rollout(tiny_model_dir):
    """Without rollout correction the train step's first optimizer step (the weights that sampled the batch)
    measures the difference, over its micro-batches, and no later one: a planted log(4) on sample 1 (first
    mini-batch) shows, the 3.0 on sample 6 (second mini-batch, after an update) does not."""
    rollout = TorchRolloutBackend(tiny_model_dir, threads=1)
    gens = rollout.generate([[1, 5, 6, 7, 15], [1, 9, 15]] * 4, SamplingParams(max_new_tokens=6), seed=5)
    batch = pack_samples([g.prompt_ids for g in gens], [g.output_ids for g in gens],
                         [g.output_logprobs for g in gens], torch.linspace(-1.5, 1.5, 8),
                         rollout.tokenizer.pad_token_id)
    mask = batch["loss_mask"]
    shift = torch.zeros(8)
    shift[1], shift[6] = math.log(4), 3.0
    planted = {**batch, "old_logprobs": batch["old_logprobs"] - shift[:, None] * mask}
    trainer = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1, mini_batches=2, micro_batch_size=3),
                                AlgorithmConfig())
    m = trainer.train_step(planted)
    assert m["rollout_logprob_diff_max"] == pytest.approx(math.log(4), abs=1e-5)
    expected_mean = math.log(4) * float(mask[1].sum() / mask[:4].sum())
    assert m["rollout_logprob_diff_mean"] == pytest.approx(expected_mean, abs=1e-5)
    corrected = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig(is_correction="tis"))
    # the session hands the train engine's logprobs in (rollout_logprobs): it measured them, the step does not
    given = {**planted, "rollout_logprobs": planted["old_logprobs"]}
    assert "rollout_logprob_diff_max" not in corrected.train_step(given)


# ---- through the flow: a planted NaN and a reward collapse, then the resume ---------------------------------------

def zero_reward(prompts, responses, labels, **kw) -> list[float]:
    """Every sample scores 0: no group has a reward spread (a reward collapse)."""
    return [0.0] * len(prompts)


def test_a_planted_nan_fails_the_flow_run_naming_the_check_and_the_resume_keeps_the_windows(tmp_path, monkeypatch):
    # Prefect's and MLflow's import cost: the flow tests only
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from rlflow.engines.store.run_store import RunStore
    from rlflow.flows.post_train import post_train
    from rlflow.tasks.faults import ENV

    cfg = config_from_dict(small_recipe(
        tmp_path, train={"steps": 4, "threads": 1}, eval={"every": 0}, checkpoint={"every": 1},
        reward={"fn": f"{__name__}:zero_reward"},
        health={"entropy_collapse": {"threshold": 100.0, "window": 1}, "reward_collapse": {"window": 2}}))
    monkeypatch.setenv(ENV, "advantages:2:after:nan")  # step 2's advantages become NaN: its loss is NaN
    by_step, state = step_metrics(lambda: post_train(cfg, return_state=True))
    assert state.is_failed()
    with pytest.raises(HealthCheckFailed, match=r"^health check non_finite failed at step 2: train/loss = nan"):
        state.result()
    assert sorted(by_step) == [0, 1] and all(m[DIFF_MAX] < 1e-3 for m in by_step.values())

    client = MlflowClient(cfg.tracking.uri)
    run = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])[0]
    assert run.info.status == "FAILED"
    tags = run.data.tags
    assert tags["health.non_finite"].startswith("fail at step 2: train/loss = nan, allowed finite"), tags
    assert tags["health.reward_collapse"] == ("warn at step 2: adv/zero_std_groups = 1, allowed < 1 within 2 steps "
                                              "(3 steps in a row, rollout/reward_mean = 0)")
    assert tags["health.entropy_collapse"].startswith("warn at step 2: train/entropy = ")
    assert [p.step for p in client.get_metric_history(run.info.run_id, DIFF_MAX)] == [0, 1, 2]

    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["t-health"])))
    ours = [a for a in artifacts if a.flow_run_id == state.state_details.flow_run_id]
    assert ours and ours[0].type == "table"
    latest = max(ours, key=lambda a: a.created)
    assert '"non_finite"' in str(latest.data) and '"step": 2' in str(latest.data), latest.data

    store = RunStore(cfg.storage.uri, cfg.name)  # what was written stays: the checkpoints and step 2's batch
    assert store.committed_steps() == [0, 1] and store.load_rollout(2) is not None

    monkeypatch.delenv(ENV)
    _, resumed = step_metrics(lambda: post_train(cfg, return_state=True))
    assert resumed.is_completed()
    tags = client.get_run(run.info.run_id).data.tags
    # the windows went on from checkpoint 1's state (2 collapsed steps), not from 0
    assert tags["health.reward_collapse"].endswith("(4 steps in a row, rollout/reward_mean = 0)"), tags
    assert tags["health.entropy_collapse"].endswith("(4 steps in a row)")
