"""Recipes: every bad one gives one clear error naming the field; --set overrides keep their types."""

from __future__ import annotations

import re
import textwrap
import warnings

import pytest
import torch
import yaml
from pydantic import ValidationError

from rlflow.engines.core.algorithms import rl_loss
from rlflow.engines.core.config import (
    AlgorithmConfig,
    DebugConfig,
    EvalDatasetConfig,
    EvaluationConfig,
    FnRewardSource,
    RecipeError,
    RLConfig,
    apply_overrides,
    load_recipe,
    resolve_config,
)
from rlflow.engines.session.preflight import check
from rlflow.flows.cli import main
from tests.conftest import small_recipe


def write(tmp_path, raw: dict | str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return str(path)


def test_demo_recipe_is_valid():
    cfg = load_recipe("deployments/sort-tiny.yaml")
    assert cfg.rollout.prompts_per_step == 64 and cfg.rollout.samples_per_prompt == 8


def test_overrides_set_nested_fields_with_types(tmp_path):
    path = write(tmp_path, small_recipe(tmp_path))
    cfg = load_recipe(path, ["train.steps=7", "tracking.uri=http://127.0.0.1:5000", "storage.uri=s3://b/runs",
                             "algorithm.clip_high=0.28", "rollout.stop=[a, b]"])
    assert cfg.train.steps == 7 and cfg.algorithm.clip_high == 0.28 and cfg.rollout.stop == ["a", "b"]
    assert cfg.tracking.uri == "http://127.0.0.1:5000" and cfg.storage.uri == "s3://b/runs"


def test_unknown_key_names_the_field_and_the_closest_known_key(tmp_path):
    raw = small_recipe(tmp_path, train={"stpes": 3, "zzzz": 1}, trian={}, rollout={"max_new_token": 2})
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, raw))
    assert sorted(e.value.problems) == ["rollout.max_new_token: unknown key; did you mean 'max_new_tokens'?",
                                        "train.stpes: unknown key; did you mean 'steps'?",
                                        "train.zzzz: unknown key",  # nothing close: no guess
                                        "trian: unknown key; did you mean 'train'?"]


def test_tracking_uri_defaults_to_mlflow_tracking_uri(tmp_path, monkeypatch):
    """A recipe without tracking.uri logs where RLFLOW_TRACKING_URI points (what `rlflow serve` gives its worker
    and deployments), else to sqlite:///mlflow.db; a recipe's own value wins."""
    raw = small_recipe(tmp_path)
    raw.pop("tracking", None)
    monkeypatch.setenv("RLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert load_recipe(write(tmp_path, raw)).tracking.uri == "http://127.0.0.1:5999"
    assert load_recipe(write(tmp_path, raw | {"tracking": {"uri": "sqlite:///x.db"}})).tracking.uri == "sqlite:///x.db"
    monkeypatch.delenv("RLFLOW_TRACKING_URI")
    assert load_recipe(write(tmp_path, raw)).tracking.uri == "sqlite:///mlflow.db"


def test_wrong_type_names_the_field_and_value(tmp_path):
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, small_recipe(tmp_path)), ["rollout.temperature=hot"])
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith("rollout.temperature:") and "'hot'" in e.value.problems[0]


def test_all_problems_reported_at_once(tmp_path):
    raw = small_recipe(tmp_path, train={"steps": -1}, eval={"evry": 1})
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, raw))
    fields = sorted(p.split(":")[0] for p in e.value.problems)
    assert fields == ["eval.evry", "train.steps"]


def test_missing_data_file_names_field_and_file(tmp_path):
    raw = small_recipe(tmp_path)
    raw["data"] = {"train_path": str(tmp_path / "nope.jsonl")}
    cfg = load_recipe(write(tmp_path, raw))
    with pytest.raises(RecipeError) as e:
        check(cfg)
    assert e.value.problems == [f"data.train_path: data file not found: {tmp_path / 'nope.jsonl'}"]


def test_empty_tracking_uri_is_refused_naming_the_field(tmp_path):
    for empty in ("", "  "):
        with pytest.raises(RecipeError) as e:
            load_recipe(write(tmp_path, small_recipe(tmp_path, tracking={"uri": empty})))
        assert len(e.value.problems) == 1 and e.value.problems[0].startswith("tracking.uri: "), e.value.problems
        assert "empty" in e.value.problems[0] and "leave the key out" in e.value.problems[0]
    raw = small_recipe(tmp_path)
    del raw["tracking"]
    assert load_recipe(write(tmp_path, raw)).tracking.uri == "sqlite:///mlflow.db"  # left out: the default


def test_max_new_tokens_beyond_the_models_context_names_both_numbers(tmp_path):
    """model.max_seq_len 16 (small_recipe): 15 new tokens leave a 1-token prompt room, 16 none."""
    assert check(load_recipe(write(tmp_path, small_recipe(tmp_path, rollout={"max_new_tokens": 15}))))
    with pytest.raises(RecipeError) as e:
        check(load_recipe(write(tmp_path, small_recipe(tmp_path, rollout={"max_new_tokens": 40}))))
    assert e.value.problems == ["rollout.max_new_tokens: 40 does not fit a rollout sequence of 16 tokens "
                                "(model.max_seq_len), which holds the prompt too"]
    from rlflow.engines.core.config import ModelConfig
    from rlflow.engines.models.hf import build_tiny_model

    model = build_tiny_model(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                                         num_kv_heads=2, max_seq_len=24), tmp_path / "model", seed=0)
    raw = small_recipe(tmp_path, model={"path": str(model)}, rollout={"max_new_tokens": 30})
    with pytest.raises(RecipeError) as e:
        check(load_recipe(write(tmp_path, raw)))
    assert e.value.problems == [f"rollout.max_new_tokens: 30 does not fit a rollout sequence of 24 tokens "
                                f"(max_position_embeddings in {model / 'config.json'}), which holds the prompt too"]


def test_reward_import_failure_names_field(tmp_path):
    cfg = load_recipe(write(tmp_path, small_recipe(tmp_path, reward={"fn": "no_such_module:score"})))
    with pytest.raises(RecipeError) as e:
        check(cfg)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("reward.fn: ")
    assert "no_such_module" in e.value.problems[0]


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(write(tmp_path, "train: [unclosed"))
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")


def test_batch_must_split_over_workers(tmp_path):
    raw = small_recipe(tmp_path, train={"num_workers": 3})
    with pytest.raises(RecipeError, match="must divide evenly"):
        load_recipe(write(tmp_path, raw))


def test_expert_parallel_must_divide_the_data_parallel_ranks(tmp_path):
    raw = small_recipe(tmp_path, train={"backend": "megatron", "num_workers": 4},
                       megatron={"tensor_parallel": 2, "expert_parallel": 4})
    with pytest.raises(RecipeError, match=r"megatron.expert_parallel \(4\) must divide the data-parallel size, "
                                          r"train.num_workers / \(tensor_parallel x pipeline_parallel\) = 2"):
        load_recipe(write(tmp_path, raw))


def test_context_parallel_without_transformer_engine_is_refused_when_the_recipe_loads(tmp_path):
    raw = small_recipe(tmp_path, train={"backend": "megatron"}, megatron={"transformer": {"context_parallel_size": 2}})
    with pytest.raises(RecipeError, match="context_parallel_size 2 needs Transformer Engine's attention"):
        load_recipe(write(tmp_path, raw))


def test_cli_validate_exit_codes(tmp_path, capsys):
    good = write(tmp_path, small_recipe(tmp_path))
    assert main(["validate", good]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent("""
        data: {train_path: /nonexistent/x.jsonl}
        rollout: {tempreature: 1}
    """))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "rollout.tempreature: unknown key" in err


def test_validate_checks_data_and_reward_when_the_schema_fails(tmp_path, capsys):
    """Schema errors do not hide the other checks: the data file and the reward import of valid sections are
    checked too, all reported at once; a check whose section is invalid is left out (no noise)."""
    raw = small_recipe(tmp_path, train={"steps": -1}, rollout={"tempreature": 1, "fn": "nowhere:fn"},
                       reward={"fn": "no_such_module:score"})
    raw["data"] = {"train_path": str(tmp_path / "nope.jsonl")}
    def validate() -> list[str]:
        assert main(["validate", write(tmp_path, raw)]) == 2
        return [line[4:] for line in capsys.readouterr().err.splitlines() if line.startswith("  - ")]

    problems = validate()
    assert [p.split(":")[0] for p in problems] == ["rollout.tempreature", "train.steps", "data.train_path", "reward.fn"]
    assert problems[2] == f"data.train_path: data file not found: {tmp_path / 'nope.jsonl'}"

    raw["data"]["prompt_kye"] = "q"  # the data section itself invalid: its file is not checked, the reward still is
    assert [p.split(":")[0] for p in validate()] == ["data.prompt_kye", "rollout.tempreature", "train.steps",
                                                     "reward.fn"]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("rloo", {"advantage": "rloo"}),
        ("reinforce-pp", {"advantage": "reinforce_pp"}),
        ("gspo", {"policy_loss": "gspo", "clip_low": 0.05, "clip_high": 0.07, "loss_agg": "seq_mean_token_mean"}),
        ("dapo", {"clip_high": 0.28, "loss_agg": "token_mean", "overlong_buffer": 3, "overlong_penalty": 1.0}),
        ("cispo", {"policy_loss": "cispo", "clip_low": 1.0, "loss_agg": "token_mean"}),
        ("gmpo", {"policy_loss": "gmpo", "clip_low": 0.4, "clip_high": 0.4, "loss_agg": "seq_mean_token_mean"}),
        ("sapo", {"policy_loss": "sapo", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05,
                  "loss_agg": "seq_mean_token_mean"}),
        ("clip-cov", {"policy_loss": "clip_cov", "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}),
        ("kl-cov", {"policy_loss": "kl_cov", "kl_cov_coef": 1.0}),
    ],
)
def test_algorithm_recipes_are_valid(name, expected):
    cfg = load_recipe(f"deployments/sort-tiny-{name}.yaml")
    assert {k: getattr(cfg.algorithm, k) for k in expected} == expected
    assert cfg.name == f"sort-tiny-{name}"


@pytest.mark.parametrize(
    "algorithm, problem",
    [
        ({"advantage": "ppo"}, r"algorithm\.advantage: .*'grpo', 'dr_grpo', 'rloo', 'reinforce_pp'"),
        ({"kl_estimator": "k4"}, r"algorithm\.kl_estimator: .*'low_var_kl'"),
        ({"is_correction": "mis"}, r"algorithm\.is_correction: .*'none', 'tis' or 'icepop'"),
        ({"clip_ratio_c": 1.0}, r"algorithm\.clip_ratio_c: .*greater than 1"),
        ({"advantage": "rloo", "normalize_std": True},
         r"algorithm: .*normalize_std applies to grpo / dr_grpo / grpo_passk only"),
        ({"is_level": "sequence"}, r"algorithm: .*is_level / is_batch_normalize .* set is_correction to tis or icepop"),
        ({"is_batch_normalize": True}, r"algorithm: .*is_level / is_batch_normalize"),
        ({"is_correction": "tis", "is_level": "seq"}, r"algorithm\.is_level: .*'token' or 'sequence'"),
        ({"rejection": "token", "reject_low": 1.2}, r"algorithm: .*reject_low \(1.2\) must be <= 1 <= reject_high"),
        ({"rejection": "seq_sum_k1"}, r"algorithm\.rejection: .*'sequence' or 'geometric'"),
        ({"passk_k": 3}, r"algorithm: .*passk_k apply to advantage 'passk' only \(advantage is 'grpo'\)"),
        ({"advantage": "passk", "passk_k": 0}, r"algorithm\.passk_k: .*greater than or equal to 1"),
        ({"advantage": "passk", "passk_k": 5}, r"algorithm\.passk_k \(5\) must be at most rollout\.samples_per_prompt "
                                              r"\(4\)"),
        ({"kl_ctrl": "adaptive", "kl_coef": 0.1},
         r"algorithm: .*kl_ctrl: adaptive .* needs kl_in: reward and a starting kl_coef > 0"),
        ({"kl_ctrl": "adaptive", "kl_in": "reward"}, r"algorithm: .*kl_ctrl: adaptive .*kl_coef 0.0"),
        ({"kl_ctrl": "adaptive", "kl_in": "reward", "kl_coef": 0.1, "kl_horizon": 0},
         r"algorithm\.kl_horizon: .*greater than 0"),
        ({"policy_loss": "gspo", "clip_ratio_c": 3.0}, r"algorithm: .*clip_ratio_c .* 'ppo' only"),
        ({"policy_loss": "cispo", "clip_ratio_c": 3.0}, r"algorithm: .*clip_ratio_c .* 'ppo' only"),
        ({"policy_loss": "sppo"}, r"algorithm\.policy_loss: .*'cispo', 'gmpo', 'sapo', 'clip_cov' or 'kl_cov'"),
        ({"loss_agg": "sum"}, r"algorithm\.loss_agg: .*'token_sum' or 'seq_mean_token_sum'"),
        ({"policy_loss": "sapo", "sapo_tau_neg": 0.0}, r"algorithm\.sapo_tau_neg: .*greater than 0"),
        ({"sapo_tau_neg": 2.0},
         r"algorithm: .*sapo_tau_neg applies to policy_loss 'sapo' only \(policy_loss is 'ppo'\)"),
        ({"policy_loss": "sapo", "kl_cov_coef": 0.5, "kl_cov_ratio": 0.01},
         r"algorithm: .*kl_cov_ratio, kl_cov_coef apply to policy_loss 'kl_cov' only"),
        ({"policy_loss": "clip_cov", "clip_cov_ratio": 0.0}, r"algorithm\.clip_cov_ratio: .*greater than 0"),
        ({"policy_loss": "clip_cov", "clip_cov_lb": 5.0},
         r"algorithm: .*clip_cov_lb \(5.0\) must be below clip_cov_ub"),
        ({"policy_loss": "kl_cov", "kl_cov_ratio": 2.0}, r"algorithm\.kl_cov_ratio: .*less than or equal to 1"),
        ({"icepop_low": 2.0, "icepop_high": 2.0}, r"algorithm: .*icepop_low \(2.0\) must be below icepop_high"),
        ({"overlong_buffer": 5}, r"overlong_buffer \(5\) must not exceed .*max_new_tokens \(4\)"),
    ],
)
def test_bad_algorithm_settings_name_the_field(tmp_path, algorithm, problem):
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, small_recipe(tmp_path, algorithm=algorithm)))
    assert len(e.value.problems) == 1 and re.search(problem, e.value.problems[0]), e.value.problems


def test_loss_kwargs_fit_rl_loss():
    """Every backend passes AlgorithmConfig.loss_kwargs() to rl_loss: each key must be one it takes."""
    algo = AlgorithmConfig(kl_coef=0.1, kl_in="reward", policy_loss="gspo", is_correction="icepop")
    kwargs = algo.loss_kwargs()
    assert kwargs["kl_coef"] == 0.0 and kwargs["policy"] == "gspo"  # KL in the reward leaves the loss
    assert AlgorithmConfig(kl_coef=0.1).loss_kwargs()["kl_coef"] == 0.1
    lp = torch.zeros(1, 2)
    loss, m = rl_loss(lp, lp, torch.ones(1), torch.ones(1, 2), rollout_logprobs=lp, **kwargs)
    assert loss.item() == pytest.approx(-1.0) and m["is_mask_frac"].item() == 0.0
    # each policy loss's own settings reach rl_loss too
    for algo in (AlgorithmConfig(policy_loss="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0),
                 AlgorithmConfig(policy_loss="clip_cov", clip_cov_ratio=0.5, clip_cov_lb=-1.0, clip_cov_ub=2.0),
                 AlgorithmConfig(policy_loss="kl_cov", kl_cov_ratio=0.5, kl_cov_coef=0.5)):
        kwargs = algo.loss_kwargs()
        fields = AlgorithmConfig.model_fields
        changed = {k for k, f in fields.items() if getattr(algo, k) != f.default} - {"policy_loss"}
        assert changed and all(kwargs[k] == getattr(algo, k) for k in changed)
        loss, _ = rl_loss(lp, lp, torch.ones(1), torch.ones(1, 2), **kwargs)
        assert torch.isfinite(loss)


GPU = {"train": {"device": "cuda", "steps": 3, "threads": 1}, "cluster": {"use_ray": True}}


@pytest.mark.parametrize(
    "sections, problem",
    [
        ({"weight_sync": {"transport": "cuda_ipc"}},
         r"weight_sync\.transport: cuda_ipc needs train\.device and rollout\.device 'cuda'"),
        ({**GPU, "weight_sync": {"transport": "cuda_ipc"}}, r"cuda_ipc needs cluster\.colocate: true"),
        ({**GPU, "weight_sync": {"transport": "nccl"}, "cluster": {"use_ray": False}},
         r"weight_sync\.transport: nccl .* cluster\.use_ray: true"),
        ({**GPU, "weight_sync": {"transport": "nccl"}, "rollout": {"device": "cpu"}},
         r"nccl needs train\.device and rollout\.device alike"),
        ({"weight_sync": {"transport": "distributed"}, "cluster": {"use_ray": False}},
         r"weight_sync\.transport: distributed with the embedded engine needs cluster\.use_ray: true"),
        ({"weight_sync": {"transport": "distributed"}, "rollout": {"device": "cuda"}, "cluster": {"use_ray": True}},
         r"weight_sync\.transport: distributed with rollout\.device 'cuda' .* needs train\.device 'cuda'"),
        ({"cluster": {"colocate": True}}, r"cluster\.colocate: needs train\.device and rollout\.device 'cuda'"),
        ({**GPU, "cluster": {"use_ray": True, "colocate": True}, "rollout": {"num_workers": 2}},
         r"cluster\.colocate: rollout\.num_workers \(2\) must equal train\.num_workers \(1\)"),
        ({**GPU, "cluster": {"use_ray": True, "colocate": True}, "rollout": {"max_staleness": 1}},
         r"cluster\.colocate: asynchronous training \(rollout\.max_staleness: 1\) needs separate GPUs"),
        ({**GPU, "train": {**GPU["train"], "offload_during_rollout": True}},
         r"train\.offload_during_rollout: .* needs cluster\.colocate: true"),
        ({**GPU, "train": {**GPU["train"], "num_workers": 2}, "rollout": {"num_workers": 2},
          "weight_sync": {"transport": "nccl"}}, r"nccl sends train rank 0's whole parameters.* use 'distributed'"),
        ({**GPU, "train": {**GPU["train"], "cpu_offload": True}, "cluster": {"use_ray": True, "colocate": True},
          "weight_sync": {"transport": "cuda_ipc"}}, r"cuda_ipc reads the trainer's weights on its GPU; with "
                                                     r"train\.cpu_offload"),
    ],
)
def test_placement_and_gpu_transports_name_the_field(tmp_path, sections, problem):
    """GPU placement is checked when the recipe loads (no GPU needed): each wrong combination names its field."""
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, small_recipe(tmp_path, **sections)))
    assert any(re.search(problem, p) for p in e.value.problems), e.value.problems


def test_gpu_placement_recipes_load(tmp_path):
    colocated = load_recipe(write(tmp_path, small_recipe(
        tmp_path, train=GPU["train"], cluster={"use_ray": True, "colocate": True}, weight_sync={"transport": "cuda_ipc"}
    )))
    assert colocated.rollout_device == "cuda" and colocated.cluster.colocate
    assert colocated.offloads_trainer  # on by default when colocated
    kept = load_recipe(write(tmp_path, small_recipe(
        tmp_path, train={**GPU["train"], "offload_during_rollout": False}, cluster={"use_ray": True, "colocate": True}
    )))
    assert not kept.offloads_trainer
    sharded = load_recipe(write(tmp_path, small_recipe(  # verl's colocated layout: every GPU trains and generates
        tmp_path, train={**GPU["train"], "num_workers": 2}, rollout={"num_workers": 2},
        cluster={"use_ray": True, "colocate": True}, weight_sync={"transport": "cuda_ipc"}
    )))
    assert sharded.train.num_workers == sharded.rollout.num_workers == 2
    split = load_recipe(write(tmp_path, small_recipe(
        tmp_path, **GPU, rollout={"precision": "bf16", "max_staleness": 1}, weight_sync={"transport": "nccl"}
    )))
    assert split.rollout.precision == "bf16" and split.weight_sync.transport == "nccl"
    on_cpu = load_recipe(write(tmp_path, small_recipe(  # both sides on the CPU: the nccl channel runs over gloo
        tmp_path, cluster={"use_ray": True}, weight_sync={"transport": "nccl"}
    )))
    assert on_cpu.train.device == on_cpu.rollout_device == "cpu" and on_cpu.weight_sync.transport == "nccl"


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp_baseline", "opo", "grpo_passk", "passk"])
def test_a_group_estimator_with_one_sample_per_prompt_is_refused(tmp_path, advantage):
    raw = small_recipe(tmp_path, algorithm={"advantage": advantage}, rollout={"samples_per_prompt": 1})
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, raw))
    assert re.search(rf"rollout\.samples_per_prompt: algorithm\.advantage {advantage} compares the samples of one "
                     r"prompt.*use advantage reinforce_pp", e.value.problems[0]), e.value.problems
    raw["algorithm"] = {"advantage": "reinforce_pp"}  # a batch baseline needs no group
    assert load_recipe(write(tmp_path, raw)).rollout.samples_per_prompt == 1


def test_remax_settings_are_checked(tmp_path):
    """ReMax adds a greedy sample per prompt: the step's batch counts it, greedy rollouts would make every
    advantage 0, and dynamic sampling does not generate it."""
    raw = small_recipe(tmp_path, algorithm={"advantage": "remax"}, rollout={"samples_per_prompt": 1})
    cfg = load_recipe(write(tmp_path, raw))  # one sample and its greedy baseline: a valid ReMax step
    assert cfg.step_samples == 2 * cfg.rollout.prompts_per_step
    for rollout, problem in [
        ({"temperature": 0.0}, r"remax compares sampled responses with the greedy one; with rollout.temperature 0"),
        ({"dynamic_sampling": {"enabled": True}}, r"remax adds a greedy sample .* dynamic sampling"),
        ({"samples_per_prompt": 2}, r"the step's samples, rollout.prompts_per_step \* \(rollout.samples_per_prompt "
                                    r"\+ 1 greedy baseline\) = \d+, must divide evenly"),
    ]:
        raw["rollout"] = {"prompts_per_step": 8, "samples_per_prompt": 1, "max_new_tokens": 4} | rollout
        raw["train"] = {"steps": 3, "threads": 1, "mini_batches": 16}  # 8 prompts x 2 fit; 8 x (2 + 1) do not
        with pytest.raises(RecipeError) as e:
            load_recipe(write(tmp_path, raw))
        assert re.search(problem, e.value.problems[0]), e.value.problems


def test_staleness_of_two_or_more_without_a_correction_warns(tmp_path):
    """k >= 2 without algorithm.is_correction learns more slowly (tests/test_e2e.py::test_demo_learns_with_k2_async):
    the recipe still loads, with a warning that names the fix; with the correction, or at k = 1, no warning."""
    with pytest.warns(UserWarning, match=r"rollout\.max_staleness 2 .* set algorithm\.is_correction: tis"):
        load_recipe(write(tmp_path, small_recipe(tmp_path, rollout={"max_staleness": 2})))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        load_recipe(write(tmp_path, small_recipe(tmp_path, rollout={"max_staleness": 2},
                                                 algorithm={"is_correction": "tis"})))
        load_recipe(write(tmp_path, small_recipe(tmp_path, rollout={"max_staleness": 1})))


def test_off_policy_steps_reads_as_max_staleness_with_a_warning(tmp_path):
    """The field's old name still loads the same run (in the recipe or as a --set override), and says so."""
    with pytest.warns(FutureWarning, match=r"rollout\.off_policy_steps is deprecated: .*max_staleness: 1"):
        cfg = load_recipe(write(tmp_path, small_recipe(tmp_path, rollout={"off_policy_steps": 1})))
    assert cfg.rollout.max_staleness == 1 and "off_policy_steps" not in cfg.rollout.model_dump()
    with pytest.warns(FutureWarning):
        assert load_recipe(write(tmp_path, small_recipe(tmp_path)), ["rollout.off_policy_steps=1"]
                           ).rollout.max_staleness == 1
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, small_recipe(tmp_path, rollout={"off_policy_steps": 1, "max_staleness": 2})))
    assert any("rollout.off_policy_steps (1) and rollout.max_staleness (2) disagree" in p for p in e.value.problems)
    assert load_recipe(write(tmp_path, small_recipe(tmp_path, rollout={"max_staleness": 3}))).rollout.max_staleness == 3


@pytest.mark.parametrize(("train", "why"), [({"backend": "megatron"}, "train.backend megatron saves synchronously"),
                                             ({"lora": {"rank": 4}}, "a LoRA run's checkpoints")])
def test_async_checkpoints_are_refused_where_they_are_not_written_in_the_background(tmp_path, train, why):
    raw = small_recipe(tmp_path, train=train, checkpoint={"async_save": True})
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, raw))
    assert len(e.value.problems) == 1 and "checkpoint.async_save" in e.value.problems[0], e.value.problems
    assert why in e.value.problems[0]


@pytest.mark.parametrize("name", [".", "..", "..."])
def test_a_run_name_made_of_dots_is_refused_naming_the_field(tmp_path, name):
    """A run's name is its folder in the store: `..` would put the run in the store's parent (issue 49). A recipe,
    a `--set` override (the CLI) and the Prefect run form's config or overrides all reach the same check."""
    good = write(tmp_path, small_recipe(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(small_recipe(tmp_path, name=name)))
    loads = {
        "recipe": lambda: load_recipe(bad),
        "--set": lambda: load_recipe(good, [f"name='{name}'"]),  # quoted: a bare ... is YAML's document end
        "form config": lambda: resolve_config(RLConfig, {"name": name}, good, None),
        "form overrides": lambda: resolve_config(RLConfig, None, good, [f"name='{name}'"]),
    }
    for how, load in loads.items():
        with pytest.raises(RecipeError) as e:
            load()
        assert len(e.value.problems) == 1, (how, e.value.problems)
        assert e.value.problems[0].startswith(f"name: Value error, {name!r} is not a usable name"), (how, e.value)


def test_cli_refuses_a_run_name_that_leaves_the_store(tmp_path, capsys):
    assert main(["validate", write(tmp_path, small_recipe(tmp_path)), "--set", "name=.."]) == 2
    assert "name: Value error, '..' is not a usable name" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["v1.2", "run.", ".run", "a..b", "-", "_"])
def test_names_with_dots_and_something_else_still_load(tmp_path, name):
    assert load_recipe(write(tmp_path, small_recipe(tmp_path, name=name))).name == name


@pytest.mark.parametrize("model, raw, field", [
    (DebugConfig, {"replay_run": ".."}, "replay_run"),
    (EvalDatasetConfig, {"path": "e.jsonl", "name": "."}, "name"),
    (EvaluationConfig, {"name": "..", "checkpoint": "runs/a", "eval": {"datasets": [{"path": "e.jsonl"}]}}, "name"),
    (FnRewardSource, {"kind": "fn", "name": ".."}, "name"),
])
def test_every_name_field_refuses_dots_alone(model, raw, field):
    """The other names a recipe gives (a replayed run's folder, MLflow and file names) follow the run name's rule,
    and keep refusing what the pattern refuses."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(raw)
    assert [(err["loc"], "is not a usable name" in err["msg"]) for err in e.value.errors()] == [((field,), True)]
    with pytest.raises(ValidationError, match="String should match pattern"):
        model.model_validate(raw | {field: "a/b"})
    assert getattr(model.model_validate(raw | {field: "a.b"}), field) == "a.b"


def test_a_replayed_run_named_dots_is_refused_in_a_recipe(tmp_path):
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, small_recipe(tmp_path)), ["debug.mode=train_only", "debug.replay_run=.."])
    assert [p.split(":")[0] for p in e.value.problems] == ["debug.replay_run"]


def test_an_override_that_is_not_yaml_names_itself():
    with pytest.raises(RecipeError) as e:
        apply_overrides({}, ["name=..."])  # YAML reads a bare ... as the end of the document
    assert e.value.problems == ["'name=...': the value is not valid YAML (expected the node content, but found "
                                "'<document end>'); quote a string: name='...'"]
