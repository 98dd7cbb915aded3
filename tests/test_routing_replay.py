"""Routing replay (engines/models/routing.py): the embedded engine records every token's experts and returns them
as SGLang does, the rollout batch keeps them through Arrow, and the trainer forces them in its forward (r3) or
records its own before the update (r2). Tiny MoE models on CPU."""

from __future__ import annotations

from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from rlflow.engines.core.batch import ROUTED_EXPERTS, RolloutBatch
from rlflow.engines.core.config import AlgorithmConfig, KVCacheConfig, RLConfig, TrainConfig
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models.hf import load_model
from rlflow.engines.models.moe import routing_width
from rlflow.engines.models.routing import recording, routing_from_text, routing_to_text, select_experts, set_replay
from rlflow.engines.rollout.functions import PromptSample, sample_from_item
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.megatron_helpers import toy_batch

LAYERS, EXPERTS, TOP_K = 2, 8, 2
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def _save(out, config) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE: 2 layers of 8 experts, top 2."""
    return _save(tmp_path_factory.mktemp("moe"), Qwen3MoeConfig(
        **COMMON, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32, norm_topk_prob=True))


BF16 = dict(COMMON, num_hidden_layers=4)  # the bf16 comparison: deeper, more experts, a larger MLP share
MLP_SCALE = 16.0  # down projections scaled up: what the experts add to the residual stream matters to the logits


def _scaled(out, config, moe: bool) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            (layer.mlp.experts.down_proj if moe else layer.mlp.down_proj.weight).mul_(MLP_SCALE)
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory) -> tuple[str, str]:
    """A 4-layer Qwen3-MoE of 32 experts (top 4) and the dense Qwen3 of the same shape, MLP outputs scaled alike."""
    moe = _scaled(tmp_path_factory.mktemp("moe-bf16"), Qwen3MoeConfig(
        **BF16, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=32), moe=True)
    dense = _scaled(tmp_path_factory.mktemp("dense-bf16"), Qwen3Config(**BF16), moe=False)
    return moe, dense


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> str:
    return _save(tmp_path_factory.mktemp("dense"), Qwen3Config(**COMMON))


PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41, 42, 43, 44, 45, 46], [1, 7], [1, 70, 3, 71, 72, 90]]


def _rollout(path: str, dtype: torch.dtype, record: bool, max_new_tokens: int = 12,
             prompts: list[list[int]] = PROMPTS) -> list:
    """The prompts through the embedded server's /generate (SGLang's wire format), as rollout samples."""
    engine = TorchRolloutBackend(path, dtype=dtype, threads=1, batch_size=4, record_routing=record)
    try:
        engine.start_server()
        body = {"input_ids": prompts, "return_logprob": True, "return_routed_experts": record,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True,
                                    "sampling_seed": 3}}
        with httpx.Client(base_url=engine.server_url(), timeout=120) as http:
            r = http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return [sample_from_item(item) for item in r.json()]
    finally:
        engine.close()


def _batch(path: str, samples: list, prompt_ids: list[list[int]] = PROMPTS) -> RolloutBatch:
    prompts = [PromptSample(index=i, prompt="", label=None, prompt_ids=p, n=1, seed=0)
               for i, p in enumerate(prompt_ids)]
    return RolloutBatch.from_samples(prompts, [[s] for s in samples], routing_width(AutoConfig.from_pretrained(path)))


def _mismatch(trainer: TorchTrainBackend, batch: RolloutBatch) -> float:
    """Mean |log p_train - log p_rollout| over the response tokens."""
    train_batch = batch.to_train_batch(0, torch.zeros(len(batch)))
    train = trainer.forward_logprobs(train_batch)
    mask = train_batch["loss_mask"]
    return float(((train - train_batch["old_logprobs"]).abs() * mask).sum() / mask.sum())


def test_replay_forces_the_choice_and_keeps_the_live_weights_and_their_gradient():
    """A replayed row takes the recorded experts, weighted by the live router's probabilities there
    (renormalised), and the router still gets a gradient; a row of -1 routes live."""
    logits = torch.randn(3, 6, requires_grad=True)
    replay = torch.tensor([[5, 0], [-1, -1], [2, 3]], dtype=torch.int16)
    weights, ids = select_experts(logits, 2, True, replay)
    live_w, live_ids = select_experts(logits, 2, True)
    assert ids[0].tolist() == [5, 0] and ids[2].tolist() == [2, 3] and torch.equal(ids[1], live_ids[1])
    probs = logits.softmax(-1)
    expected = probs[0, [5, 0]] / probs[0, [5, 0]].sum()
    torch.testing.assert_close(weights[0], expected)
    torch.testing.assert_close(weights[1], live_w[1])
    (weights * torch.arange(2.0)).sum().backward()  # (their plain sum is 1 whatever the logits)
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_a_recorded_routing_replays_to_the_same_logits_and_another_one_changes_them(moe_dir):
    model = load_model(moe_dir).eval()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    with torch.no_grad(), recording(model) as rec:
        live = model(ids).logits
    record = rec[0]
    assert record.shape == (8, LAYERS, TOP_K) and record.dtype == torch.int16
    with torch.no_grad():
        set_replay(model, record)
        replayed = model(ids).logits
        set_replay(model, (record.long() + 1) % EXPERTS)
        other = model(ids).logits
        set_replay(model, None)
    assert torch.equal(replayed, live)
    assert (other - live).abs().max() > 1e-3


def test_the_engine_records_the_batch_keeps_and_the_trainer_replays_the_routing(moe_dir):
    """R3 round trip in fp32: the engine's record (SGLang's layout, [prompt + response - 1, layers, k]) is what the
    trainer routes the same tokens to; it survives Arrow; replayed, the trainer's logprobs are the engine's."""
    samples = _rollout(moe_dir, torch.float32, record=True)
    for p, s in zip(PROMPTS, samples, strict=True):
        assert s.routed_experts.shape == ((len(p) + len(s.response_ids) - 1) * LAYERS * TOP_K,)
    batch = RolloutBatch.from_arrow(_batch(moe_dir, samples).to_arrow())
    train_batch = batch.to_train_batch(0, torch.zeros(len(batch)))
    assert train_batch[ROUTED_EXPERTS].shape[-1] == LAYERS * TOP_K
    trainer = TorchTrainBackend(moe_dir, TrainConfig(threads=1, mini_batches=1), AlgorithmConfig(routing_replay="r3"))
    own = trainer.record_routing({k: v for k, v in train_batch.items() if k != ROUTED_EXPERTS})
    recorded = train_batch[ROUTED_EXPERTS]
    fed = recorded[..., 0] >= 0
    assert fed.sum() == sum(len(p) + len(s.response_ids) - 1 for p, s in zip(PROMPTS, samples, strict=True))
    assert torch.equal(own[fed], recorded[fed])  # fp32: the engine's choice is the trainer's
    assert _mismatch(trainer, batch) < 1e-4


def test_r3_brings_the_bf16_mismatch_of_a_moe_down_to_the_dense_level(bf16_pair, capsys):
    """bf16 engine against bf16 trainer, 8 prompts x 48 tokens: with live routing about 1% of (token, layer) routings
    come out different in the trainer (near-ties broken another way by rounding), and those tokens' log-probs move;
    replaying the engine's routing leaves only the kernels' rounding, which a dense model of the same shape has."""
    moe_dir, dense_dir = bf16_pair
    prompts = [[1, *range(3 + i, 9 + i)] for i in range(0, 80, 10)]
    bf16 = TrainConfig(threads=1, mini_batches=1, precision="bf16")
    batch = _batch(moe_dir, _rollout(moe_dir, torch.bfloat16, True, 48, prompts), prompts)
    off = _mismatch(TorchTrainBackend(moe_dir, bf16, AlgorithmConfig()),
                    replace(batch, routed_experts=None, metadata={}))
    r3 = _mismatch(TorchTrainBackend(moe_dir, bf16, AlgorithmConfig(routing_replay="r3")), batch)
    dense = _mismatch(TorchTrainBackend(dense_dir, bf16, AlgorithmConfig()),
                      _batch(dense_dir, _rollout(dense_dir, torch.bfloat16, False, 48, prompts), prompts))
    with capsys.disabled():
        print(f"\nmean |logp_train - logp_rollout|, bf16: MoE live routing {off:.2e}, MoE r3 {r3:.2e}, "
              f"dense {dense:.2e}")
    assert r3 < 0.8 * off
    assert r3 < 1.5 * dense


def test_r2_records_the_policy_routing_before_the_update(moe_dir):
    """r2: train_step records the pre-update policy's routing and replays it in the training forward; the record
    equals what record_routing returns for the same weights."""
    batch = toy_batch(vocab=96)
    trainer = TorchTrainBackend(moe_dir, TrainConfig(threads=1, mini_batches=1), AlgorithmConfig(routing_replay="r2"))
    before = trainer.record_routing(batch)
    seen = []
    real = trainer._route
    trainer._route = lambda lm, mb, packed: seen.append(mb.get(ROUTED_EXPERTS)) or real(lm, mb, packed)
    trainer.train_step(batch)
    assert seen and all(s is not None for s in seen)
    mask = batch["attention_mask"].bool()
    assert torch.equal(torch.cat([s.cpu() for s in seen])[mask], before[mask])


def test_wire_format_and_bad_input_is_named(moe_dir, dense_dir):
    ids = np.array([[[3, 1], [0, 7]], [[2, 2], [5, 6]]], dtype=np.int16)
    assert np.array_equal(routing_from_text(routing_to_text(ids)), ids.reshape(-1))
    with pytest.raises(ValueError, match="meta_info.routed_experts"):
        routing_from_text("not base64!")
    with pytest.raises(ValueError, match="no MoE layers"):
        TorchTrainBackend(dense_dir, TrainConfig(threads=1, mini_batches=1), AlgorithmConfig(routing_replay="r3"))
    with pytest.raises(ValueError, match="no MoE layers"):
        TorchRolloutBackend(dense_dir, threads=1, batch_size=2, record_routing=True)
    with pytest.raises(ValueError, match="routing_replay r3: .* sglang"):
        RLConfig.model_validate({"data": {"train_path": "x.jsonl"}, "algorithm": {"routing_replay": "r3"},
                                 "rollout": {"backend": "sglang"}})
    with pytest.raises(ValueError, match="routing_replay r2 with train.backend megatron: needs megatron.tensor_"):
        RLConfig.model_validate({"data": {"train_path": "x.jsonl"}, "algorithm": {"routing_replay": "r2"},
                                 "train": {"backend": "megatron", "num_workers": 2},
                                 "megatron": {"tensor_parallel": 2}})
    samples = _rollout(moe_dir, torch.float32, record=True, max_new_tokens=3)
    samples[1].routed_experts = samples[1].routed_experts[:-1]
    with pytest.raises(ValueError, match="routed_experts of sample 1"):
        _batch(moe_dir, samples)


def test_a_streamed_generation_carries_its_record_in_the_last_event(moe_dir):
    """stream: true with return_routed_experts: the final event's meta_info has the record the unstreamed answer
    has (same seed); the events before it have none."""
    import json

    engine = TorchRolloutBackend(moe_dir, threads=1, batch_size=2, record_routing=True)
    body = {"input_ids": PROMPTS[0], "return_routed_experts": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 3}}
    try:
        engine.start_server()
        with httpx.Client(base_url=engine.server_url(), timeout=60) as http:
            whole = http.post("/generate", json=body).json()
            events = [json.loads(line[len("data: "):]) for line in http.post(
                "/generate", json=body | {"stream": True}).text.splitlines()
                if line.startswith("data: {")]
    finally:
        engine.close()
    assert all("routed_experts" not in e["meta_info"] for e in events[:-1])
    assert events[-1]["meta_info"]["routed_experts"] == whole["meta_info"]["routed_experts"]


def test_the_engine_refuses_return_routed_experts_when_it_does_not_record(moe_dir):
    engine = TorchRolloutBackend(moe_dir, threads=1, batch_size=2)
    try:
        engine.start_server()
        with httpx.Client(base_url=engine.server_url(), timeout=60) as http:
            r = http.post("/generate", json={"input_ids": [1, 2, 3], "return_routed_experts": True,
                                             "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and "return_routed_experts" in r.text
    finally:
        engine.close()
    assert engine.engine.record_routing is False


def test_generation_keeps_its_routing_through_a_preemption(moe_dir):
    """A request preempted mid-generation keeps the experts recorded before (its re-prefill recomputes them) and
    returns a full record; the record store goes with the KV cache when it is released, and comes back with it."""
    engine = TorchRolloutBackend(moe_dir, threads=1, batch_size=4, record_routing=True,
                                 kv_cache=KVCacheConfig(tokens=64, page_size=8))
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)
    try:
        gens = engine.generate(PROMPTS, params, seed=1)
        assert engine.engine.drop_cache() and engine.engine.lm.routing is None  # released with the KV cache
        again = engine.generate(PROMPTS, params, seed=1)
    finally:
        engine.close()
    assert all(np.array_equal(a.routed_experts, b.routed_experts) for a, b in zip(gens, again, strict=True))
    assert engine.engine.preemptions > 0
    for g in gens:
        assert g.routed_experts.shape == (len(g.prompt_ids) + len(g.output_ids) - 1, LAYERS, TOP_K)
        assert (g.routed_experts >= 0).all() and (g.routed_experts < EXPERTS).all()


# ---- the Megatron backend (megatron-core's RouterReplay, engines/train/megatron/routing.py) -----------------
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_megatron_replays_the_engine_routing_and_records_its_own(moe_dir, mcore, packing):
    """fp32: megatron's own routing of the engine's tokens is the engine's record (packed THD and padded
    layouts, whose token orders differ); replayed, its log-probs are the engine's; a record shifted to other
    experts moves them (the replay is in force); r2's record, made in train_step, is what record_routing gives."""
    from rlflow.engines.core.config import MegatronConfig
    from rlflow.engines.train.megatron.backend import MegatronTrainBackend

    samples = _rollout(moe_dir, torch.float32, record=True)
    batch = RolloutBatch.from_arrow(_batch(moe_dir, samples).to_arrow())
    train_batch = batch.to_train_batch(0, torch.zeros(len(batch)))
    backend = MegatronTrainBackend(moe_dir, TrainConfig(threads=1, mini_batches=1),
                                   AlgorithmConfig(routing_replay="r3"), MegatronConfig(packing=packing))
    own = backend.record_routing({k: v for k, v in train_batch.items() if k != ROUTED_EXPERTS})
    recorded = train_batch[ROUTED_EXPERTS]
    fed = recorded[..., 0] >= 0
    assert torch.equal(own[fed], recorded[fed])
    mask = train_batch["loss_mask"].bool()
    replayed = backend.forward_logprobs(train_batch)
    assert (replayed - train_batch["old_logprobs"])[mask].abs().max() < 1e-4
    shifted = torch.where(recorded >= 0, (recorded.long() + 1) % EXPERTS, -1).to(torch.int16)
    moved = backend.forward_logprobs({**train_batch, ROUTED_EXPERTS: shifted})
    assert (moved - replayed)[mask].abs().max() > 1e-3

    r2 = MegatronTrainBackend(moe_dir, TrainConfig(threads=1, mini_batches=1), AlgorithmConfig(routing_replay="r2"),
                              MegatronConfig(packing=packing))
    plain = {k: v for k, v in train_batch.items() if k != ROUTED_EXPERTS}
    before = r2.record_routing(plain)
    assert torch.equal(before[fed], own[fed])  # same weights: the same choice
    seen = []
    real = r2.routing.before_forward
    r2.routing.before_forward = lambda micro, pad, record=False: seen.append(
        (record, micro.batch.get(ROUTED_EXPERTS) is not None)) or real(micro, pad, record)
    r2.train_step(plain)
    assert seen[0] == (True, False) and all(rec is False and has for rec, has in seen[len(seen) // 2:])


# ---- through the RL session (rollout, reward, advantages, train, weight sync) ---------------------------------
@pytest.mark.parametrize("backend,replay", [("torch", "r3"), ("megatron", "r3"), ("torch", "r2")])
def test_an_rl_session_replays_routing_end_to_end(recipe, mcore, tmp_path, backend, replay):
    """A Qwen3-MoE policy in the bare RL loop with algorithm.routing_replay: r3's rollout batch carries every
    sample's record (persisted and read back whole), each step trains (finite loss, a gradient) with importance
    weights taken against the rollout's log-probs (fp32: they agree, mismatch KL < 1e-8); r2 trains on the trainer's
    own record, made in its train step."""
    from transformers import AutoTokenizer

    from rlflow.engines.session.rl import RLSession
    from rlflow.engines.session.workers import prepare_data, prepare_model

    demo = prepare_model(recipe(), tmp_path)  # the demo's tokenizer and vocabulary
    moe = tmp_path / "moe"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(
        vocab_size=AutoConfig.from_pretrained(demo).vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=128, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)).save_pretrained(moe)
    AutoTokenizer.from_pretrained(demo).save_pretrained(moe)
    cfg = recipe(model={"path": str(moe)}, train={"steps": 2, "threads": 1, "backend": backend, "mini_batches": 2},
                 megatron={"micro_batch_tokens": 64},
                 algorithm={"routing_replay": replay, "is_correction": "tis"})
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    for step in range(2):
        session.rollout(step)
        batch = session.rollout_batch(step)
        if replay == "r3":
            assert batch.routed_experts is not None and all(r is not None for r in batch.routed_experts)
            again = RolloutBatch.from_arrow(session.rollout_table(step))
            assert all(np.array_equal(a, b) for a, b in zip(again.routed_experts, batch.routed_experts, strict=True))
        else:
            assert batch.routed_experts is None
        session.reward(step)
        metrics = session.advantages(step)
        assert metrics["rollout_corr/mismatch_kl"] < 1e-8, metrics  # fp32: the engines agree
        metrics = session.train(step)
        assert np.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
        session.sync_weights(step)
