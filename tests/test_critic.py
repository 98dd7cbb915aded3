"""PPO with a critic: the value model (a role of the torch train backend), its train step and checkpoints, the
GAE wiring through the stages, its config, and the flow on Ray with a data-parallel critic."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForTokenClassification

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.cluster.groups import LocalWorkerGroup, RayWorkerGroup
from rlflow.engines.core import algorithms
from rlflow.engines.core.batch import pack_samples, shard_for_workers
from rlflow.engines.core.config import (
    AlgorithmConfig,
    ClusterConfig,
    RecipeError,
    TrainConfig,
    config_from_dict,
    load_recipe,
)
from rlflow.engines.core.protocols import TrainBackend
from rlflow.engines.models.hf import load_model
from rlflow.engines.session.preflight import find_problems
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.stages.train_batch import pack
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.conftest import assert_same_update, small_recipe


def _critic(model_dir: str, lr: float = 1e-2, value_clip: float | None = None, **train) -> TorchTrainBackend:
    return TorchTrainBackend(model_dir, TrainConfig(threads=1, lr=lr, **train), AlgorithmConfig(), role="critic",
                             value_clip=value_clip)


def _value_batch(n: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random prompts and responses (vocab of the char tokenizer), rewards in [0, 1], GAE returns with V = 0."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 18, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(4, 18, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    batch = pack_samples(prompts, responses, [[0.0] * len(r) for r in responses], torch.zeros(n), pad_id=0)
    rewards = torch.rand(n, generator=g)
    mask = batch["loss_mask"]
    token_rewards = algorithms.outcome_token_rewards(rewards, mask)
    _, returns = algorithms.gae_advantages(token_rewards, torch.zeros_like(mask), mask, 1.0, 1.0)
    return {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")} | {"returns": returns}


def test_explained_variance_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])  # the masked-out 100 must not count
    returns = torch.tensor([[1.0, 2.0, 4.0, -7.0]])
    # Var(returns) = 14/9, Var(returns - values) = Var([0, 0, 1]) = 2/9: 1 - (2/9) / (14/9) = 6/7
    assert float(algorithms.explained_variance(values, returns, mask)) == pytest.approx(6 / 7)
    assert float(algorithms.explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    assert float(algorithms.explained_variance(values, torch.full_like(values, 0.5), mask)) == 0.0  # nothing to explain
    assert float(algorithms.explained_variance(values, returns, torch.zeros_like(mask))) == 0.0  # empty mask


def test_value_model_is_the_policy_body_with_a_zero_head(tiny_model_dir):
    critic = _critic(tiny_model_dir)
    policy = dict(load_model(tiny_model_dir).named_parameters())
    params = dict(critic.named_tensors())
    body = [n for n in params if n.startswith("model.")]
    assert body and all(torch.equal(params[n], policy[n]) for n in body)
    assert set(params) - set(body) == {"score.weight", "score.bias"}  # one scalar head, no LM head
    assert not params["score.weight"].any() and not params["score.bias"].any()
    batch = _value_batch()
    assert critic.forward_values(batch).shape == batch["input_ids"].shape
    assert not critic.forward_values(batch).any()  # a zero head: every value starts at exactly 0
    with pytest.raises(ValueError, match="forward_values"):
        TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig()).forward_values(batch)


def test_values_are_aligned_with_tokens(tiny_model_dir):
    """Column t is V(x_<t): changing token t changes columns after t only (like the logprobs of pack_samples)."""
    critic = _critic(tiny_model_dir)
    with torch.no_grad():
        critic.model.score.weight.normal_()
    batch = _value_batch(n=4)
    changed = {**batch, "input_ids": batch["input_ids"].clone()}
    changed["input_ids"][:, 2] = (changed["input_ids"][:, 2] + 1 - 4) % 14 + 4
    a, b = critic.forward_values(batch), critic.forward_values(changed)
    assert (a[:, 0] == 0).all()
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-6, rtol=0) and not torch.allclose(a[:, 3], b[:, 3])


@pytest.mark.parametrize("value_clip", [None, 0.5])
def test_value_steps_lower_the_value_loss(tiny_model_dir, value_clip):
    critic = _critic(tiny_model_dir, value_clip=value_clip, mini_batches=2)
    batch = _value_batch()

    def loss() -> float:
        return float(algorithms.value_loss(critic.forward_values(batch), batch["returns"], batch["returns"],
                                           batch["loss_mask"])[0])

    before = loss()
    for _ in range(8):  # each step: values computed now are the old values the clip is taken around
        metrics = critic.train_step({**batch, "old_values": critic.forward_values(batch)})
    assert {"value_loss", "vf_clip_frac", "value_mean", "grad_norm", "lr", "worker_s"} <= set(metrics)
    assert metrics["lr"] == pytest.approx(1e-2)
    after = loss()
    assert after < 0.5 * before, (before, after)


def test_critic_checkpoint_round_trip(tiny_model_dir, tmp_path):
    """save -> load gives the same values and optimizer state: the next step is bit-identical."""
    batch = _value_batch()
    a = _critic(tiny_model_dir, value_clip=0.5)
    a.train_step({**batch, "old_values": a.forward_values(batch)})
    a.save(tmp_path / "critic")
    model = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic" / "model"))  # plain transformers
    assert model.config.num_labels == 1 and model.config.architectures[0].endswith("ForTokenClassification")

    b = _critic(tiny_model_dir, value_clip=0.5)
    b.load(tmp_path / "critic")
    assert torch.equal(a.forward_values(batch), b.forward_values(batch))
    step = {**batch, "old_values": a.forward_values(batch)}
    ma, mb = a.train_step(step), b.train_step(step)
    ma.pop("worker_s"), mb.pop("worker_s")
    assert ma == mb
    for (n, p), (_, q) in zip(a.named_tensors(), b.named_tensors(), strict=True):
        assert torch.equal(p, q), n


# ----------------------------------------------------------------------------- config


def test_critic_config(tmp_path):
    cfg = config_from_dict(small_recipe(tmp_path, algorithm={"advantage": "gae"}))
    assert cfg.use_critic and not config_from_dict(small_recipe(tmp_path)).use_critic
    assert config_from_dict(small_recipe(tmp_path, critic={"enabled": True})).use_critic  # beside GRPO
    critic_train = cfg.critic.train_config(cfg.train)
    assert critic_train.lr == cfg.critic.lr and critic_train.mini_batches == cfg.train.mini_batches
    assert load_recipe("deployments/sort-tiny-ppo.yaml").use_critic

    def problems(**sections) -> list[str]:
        with pytest.raises(RecipeError) as e:
            config_from_dict(small_recipe(tmp_path, **sections))
        return e.value.problems

    assert "critic.enabled" in problems(algorithm={"advantage": "gae"}, critic={"enabled": False})[0]
    assert "critic.num_workers" in problems(algorithm={"advantage": "gae"}, critic={"num_workers": 3})[0]
    assert "train.backend" in problems(algorithm={"advantage": "gae"}, train={"backend": "megatron"})[0]
    gae = {"advantage": "gae"}
    assert "critic.freeze_policy_steps" in problems(algorithm=gae, critic={"freeze_policy_steps": 3})[0]
    assert problems(algorithm={"lam": 1.5})[0].startswith("algorithm.lam:")
    missing = config_from_dict(small_recipe(tmp_path, algorithm=gae, critic={"model_path": str(tmp_path / "nope")}))
    assert find_problems(missing) == [f"critic.model_path: no Hugging Face model (config.json) in {tmp_path}/nope"]


# ----------------------------------------------------------------------------- through the stages


def _weights(group) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in group.workers[0].named_tensors()}


def _run_steps(session: RLSession, steps: range) -> list[dict]:
    out = []
    for step in steps:
        m = session.rollout(step) | session.reward(step) | session.advantages(step)
        out.append(m | session.train(step) | session.sync_weights(step))
    return out


def test_ppo_stages_train_policy_and_critic(recipe, tmp_path):
    cfg = recipe(algorithm={"advantage": "gae", "lam": 0.9}, critic={"freeze_policy_steps": 1},
                 train={"steps": 3, "threads": 1, "mini_batches": 2})
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    policy0, critic0 = _weights(session.train_group), _weights(session.critic_group)
    history = _run_steps(session, range(1))
    st = session.steps.get(0)
    mask = pack(session, st, st.advantages)["loss_mask"]
    assert st.advantages.shape == st.values.shape == st.returns.shape == mask.shape  # token-level, packed layout
    assert abs(float(algorithms.masked_mean(st.advantages, mask))) < 1e-5  # whitened
    assert not st.values.any() and history[0]["critic/values_mean"] == 0.0  # the zero head
    assert "train/loss" not in history[0]  # freeze_policy_steps: 1 -> only the critic trained at step 0
    assert all(torch.equal(p, policy0[n]) for n, p in _weights(session.train_group).items())
    assert any(not torch.equal(p, critic0[n]) for n, p in _weights(session.critic_group).items())

    history += _run_steps(session, range(1, 3))
    for m in history[1:]:
        for key in ("critic/value_loss", "critic/vf_explained_var", "critic/values_mean", "critic/grad_norm",
                    "critic/vf_clip_frac", "critic/lr", "train/loss", "adv/abs_mean"):
            assert key in m, key
    assert history[2]["critic/values_mean"] != 0.0
    assert any(not torch.equal(p, policy0[n]) for n, p in _weights(session.train_group).items())
    session.shutdown()


def test_critic_beside_grpo_keeps_grpo_advantages(recipe, tmp_path):
    """critic.enabled with another estimator: the critic trains on GAE returns, the advantages stay GRPO's."""
    cfg = recipe(critic={"enabled": True}, train={"steps": 1, "threads": 1})
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    m = _run_steps(session, range(1))[0]
    st = session.steps.get(0)
    assert torch.equal(st.advantages, algorithms.group_advantages(torch.tensor(st.batch.reward, dtype=torch.float32),
                                                              cfg.rollout.samples_per_prompt, True))
    assert m["critic/value_loss"] > 0 and "adv/shaped_reward_mean" not in m
    session.shutdown()


def test_ppo_session_resumes_exactly(recipe, tmp_path):
    """A session restored from step 1's checkpoint takes step 2 exactly as the uninterrupted one (policy and critic)."""
    cfg = recipe(algorithm={"advantage": "gae", "lam": 0.95}, train={"steps": 3, "threads": 1, "mini_batches": 2})
    prepare_data(cfg)
    model = prepare_model(cfg, tmp_path)
    first = RLSession.create(cfg, model, use_ray=False)
    _run_steps(first, range(2))
    controller = first.save(tmp_path / "ckpt", 1)
    assert (tmp_path / "ckpt" / "critic" / "model" / "model.safetensors").is_file()
    ref = _run_steps(first, range(2, 3))[0]
    policy, critic = _weights(first.train_group), _weights(first.critic_group)
    first.shutdown()

    second = RLSession.create(cfg, model, use_ray=False)
    second.load(tmp_path / "ckpt", controller)
    again = _run_steps(second, range(2, 3))[0]
    for k in ref:
        if not k.startswith("time/") and not k.endswith("_per_s"):
            assert again[k] == ref[k], k
    assert all(torch.equal(p, policy[n]) for n, p in _weights(second.train_group).items())
    assert all(torch.equal(p, critic[n]) for n, p in _weights(second.critic_group).items())
    second.shutdown()


# ----------------------------------------------------------------------------- on Ray


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from rlflow.engines.cluster.groups import init_ray

    init_ray(ClusterConfig(num_cpus=2))
    yield
    ray.shutdown()


def test_data_parallel_critic_matches_single_worker(tiny_model_dir, ray_cluster):
    """2 gloo critic workers on half the batch each take the same steps as 1 critic on the whole batch."""
    batch = _value_batch(n=8)
    batch["old_values"] = torch.zeros_like(batch["returns"])
    train, algo = TrainConfig(threads=1, mini_batches=2, lr=1e-2), AlgorithmConfig()
    single = LocalWorkerGroup([_critic(tiny_model_dir, value_clip=0.5, mini_batches=2)])
    url = f"tcp://127.0.0.1:{free_port()}"
    pair = RayWorkerGroup(
        TorchTrainBackend, 2,
        lambda r: dict(model_path=tiny_model_dir, train=train, algorithm=algo, rank=r, world_size=2, dist_url=url,
                       role="critic", value_clip=0.5),
        num_cpus=0.5, name="critic-dp-test",
    )
    try:
        for _ in range(2):
            m1 = single.call_each(TrainBackend.train_step, [(s,) for s in shard_for_workers(batch, 1, 2)])[0]
            m2 = pair.wait(pair.submit_each(TrainBackend.train_step, [(s,) for s in shard_for_workers(batch, 2, 2)]))
        assert m1["value_loss"] > 0 and m1["value_loss"] == pytest.approx(m2[0]["value_loss"], abs=1e-6)
        assert m2[0]["value_loss"] == m2[1]["value_loss"]  # every rank reports the global loss
        start = dict(_critic(tiny_model_dir).named_tensors())
        weights = TrainBackend.named_tensors
        assert_same_update(start, single.call_rank0(weights), pair.wait(pair.submit(weights))[0])  # a gather: all join
    finally:  # its actors hold the module's Ray CPUs
        pair.shutdown()


def test_ppo_stages_on_ray_with_two_critic_workers(recipe, tmp_path, ray_cluster):
    """The stages with every worker a Ray actor and a data-parallel critic of 2; the checkpoint holds the critic.
    (The Prefect flow with a critic, MLflow and the run store: tests/test_resume.py's PPO trials.)"""
    cfg = recipe(algorithm={"advantage": "gae"}, critic={"num_workers": 2},
                 train={"steps": 2, "threads": 1, "mini_batches": 2})
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path))
    assert isinstance(session.critic_group, RayWorkerGroup) and len(session.critic_group) == 2
    history = _run_steps(session, range(2))
    assert history[-1]["critic/value_loss"] > 0 and history[-1]["critic/values_mean"] != 0.0
    session.save(tmp_path / "ckpt", 1)
    session.shutdown()
    critic = tmp_path / "ckpt" / "critic"
    assert "score.weight" in load_file(str(critic / "model" / "model.safetensors"))
    assert {f.name for f in critic.iterdir()} >= {"model", "optimizer", "trainer_rank0.json",
                                                   "trainer_rank1.json"}
