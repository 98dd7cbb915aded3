"""The embedded engines agree with each other: rollout vs train logprobs, data-parallel vs single worker."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.cluster.groups import LocalWorkerGroup, RayWorkerGroup
from rlflow.engines.core.batch import pack_samples, shard_for_workers
from rlflow.engines.core.config import AlgorithmConfig, ClusterConfig, TrainConfig
from rlflow.engines.core.protocols import TrainBackend
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.sync.base import plan_buckets
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.conftest import assert_same_update

PROMPTS = [[1, 5, 6, 7, 15], [1, 9, 15], [1, 4, 4, 8, 9, 10, 15]]  # different lengths: left padding matters


def _batch_from(gens, advantages, pad_id):
    return pack_samples([g.prompt_ids for g in gens], [g.output_ids for g in gens],
                        [g.output_logprobs for g in gens], advantages, pad_id)


def test_rollout_logprobs_match_train_logprobs(tiny_model_dir):
    rollout = TorchRolloutBackend(tiny_model_dir, threads=1)
    trainer = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig())
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    gens = rollout.generate(PROMPTS * 4, params, seed=3)
    batch = _batch_from(gens, torch.zeros(len(gens)), rollout.tokenizer.pad_token_id)
    train_lp = trainer.forward_logprobs(batch)
    mask = batch["loss_mask"].bool()
    assert mask.sum() > 0
    assert (train_lp[mask] - batch["old_logprobs"][mask]).abs().max() <= 1e-5

    # after a training step and a weight sync, the two still agree
    trainer.train_step({**batch, "advantages": torch.linspace(-1, 1, len(gens))})
    rollout.update_weights(trainer.named_tensors(), version=1)
    gens = rollout.generate(PROMPTS, params, seed=4)
    assert all(g.weight_version == 1 for g in gens)
    batch = _batch_from(gens, torch.zeros(len(gens)), rollout.tokenizer.pad_token_id)
    mask = batch["loss_mask"].bool()
    assert (trainer.forward_logprobs(batch)[mask] - batch["old_logprobs"][mask]).abs().max() <= 1e-5


def test_generation_is_seeded_and_stops(tiny_model_dir):
    rollout = TorchRolloutBackend(tiny_model_dir, threads=1)
    p = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=5, top_p=0.9)
    a = rollout.generate(PROMPTS, p, seed=11)
    b = rollout.generate(PROMPTS, p, seed=11)
    assert [g.output_ids for g in a] == [g.output_ids for g in b]
    for g in a:
        assert len(g.output_ids) == len(g.output_logprobs) <= 6
        if g.finish_reason["type"] == "stop":
            assert g.output_ids[-1] == rollout.tokenizer.eos_token_id
        else:
            assert g.finish_reason == {"type": "length", "length": 6}
    # a stop token id ends every sequence at its first occurrence
    greedy = rollout.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0), seed=0)
    first = greedy[0].output_ids[0]
    stopped = rollout.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0,
                                                           stop_token_ids=[first]), seed=0)
    assert stopped[0].output_ids == [first] and stopped[0].finish_reason == {"type": "stop", "matched": first}


def test_weight_buckets_respect_size():
    layout = [("a", 10), ("b", 10), ("c", 25), ("d", 5)]
    assert list(plan_buckets(layout, 20)) == [["a", "b"], ["c"], ["d"]]


def _toy_batch(tiny_model_dir, n=16):
    rollout = TorchRolloutBackend(tiny_model_dir, threads=1)
    gens = rollout.generate(PROMPTS * (n // len(PROMPTS) + 1), SamplingParams(max_new_tokens=6), seed=5)[:n]
    adv = torch.linspace(-1.5, 1.5, n)
    return _batch_from(gens, adv, rollout.tokenizer.pad_token_id)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_do_not_change_the_update(tiny_model_dir, loss_agg):
    batch = _toy_batch(tiny_model_dir)
    algo = AlgorithmConfig(loss_agg=loss_agg)
    whole = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1, micro_batch_size=16), algo)
    micro = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1, micro_batch_size=3), algo)
    start = {n: t.clone() for n, t in whole.named_tensors()}  # on CPU these are the live parameters
    m1, m2 = whole.train_step(batch), micro.train_step(batch)
    assert_same_update(start, whole.named_tensors(), micro.named_tensors())
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from rlflow.engines.cluster.groups import init_ray

    init_ray(ClusterConfig(num_cpus=2))
    yield
    ray.shutdown()


def test_data_parallel_matches_single_worker(tiny_model_dir, ray_cluster):
    """2 FSDP2 ranks (gloo) on half the batch each take the same steps as 1 rank on the whole batch."""
    batch = _toy_batch(tiny_model_dir)
    train = TrainConfig(threads=1, mini_batches=2, steps=2)
    algo = AlgorithmConfig()
    single = LocalWorkerGroup([TorchTrainBackend(tiny_model_dir, train, algo)])
    url = f"tcp://127.0.0.1:{free_port()}"
    pair = RayWorkerGroup(
        TorchTrainBackend, 2,
        lambda r: dict(model_path=tiny_model_dir, train=train, algorithm=algo, rank=r, world_size=2, dist_url=url),
        num_cpus=0.5, name="dp-test",
    )
    for _ in range(2):
        m1 = single.call_each(TrainBackend.train_step, [(s,) for s in shard_for_workers(batch, 1, 2)])[0]
        m2 = pair.call_each(TrainBackend.train_step, [(s,) for s in shard_for_workers(batch, 2, 2)])
    for m in (m1, *m2):
        m.pop("worker_s")  # wall time, differs per rank
    assert m2[0] == pytest.approx(m2[1])  # every rank reports the global metrics
    assert m1["loss"] == pytest.approx(m2[0]["loss"], abs=1e-6)
    weights = TrainBackend.named_tensors
    start = dict(LocalWorkerGroup([TorchTrainBackend(tiny_model_dir, train, algo)]).call_rank0(weights))
    assert_same_update(start, single.call_rank0(weights), pair.wait(pair.submit(weights))[0])  # a gather: all join
    pair.shutdown()


# ----------------------------------------------------------------------------- algorithm options in the train step


def _count_forwards(trainer: TorchTrainBackend) -> list[bool]:
    """Record each forward_logprobs call's `reference` flag."""
    calls: list[bool] = []
    original = trainer.forward_logprobs

    def counted(batch, reference=False):
        calls.append(reference)
        return original(batch, reference)

    trainer.forward_logprobs = counted
    return calls


@pytest.mark.parametrize("mode", ["none", "tis", "icepop"])
def test_is_correction_costs_one_forward_per_step(tiny_model_dir, mode):
    """The train engine's old logprobs are recomputed once per step (not per epoch or mini-batch), only with IS."""
    batch = _toy_batch(tiny_model_dir)
    trainer = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1, mini_batches=2, epochs=2),
                                AlgorithmConfig(is_correction=mode))
    calls = _count_forwards(trainer)
    m = trainer.train_step(batch)
    assert calls == ([] if mode == "none" else [False])
    if mode == "none":
        assert "is_weight_mean" not in m
    else:  # the embedded engines agree to ~1e-6: weights 1, nothing truncated or masked
        assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and m["mismatch_kl"] < 1e-8
        assert m["is_clip_frac" if mode == "tis" else "is_mask_frac"] == 0.0


def test_tis_on_matching_engines_is_the_plain_loss(tiny_model_dir):
    batch = _toy_batch(tiny_model_dir)
    losses = [TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig(is_correction=mode))
              .train_step(batch)["loss"] for mode in ("none", "tis")]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_icepop_drops_tokens_the_engines_disagree_on(tiny_model_dir):
    """A rollout engine that put 4x the train engine's probability on the tokens of 5 samples: ratio 1/4 is outside
    [0.5, 5], so those tokens leave the policy loss, which then equals the loss with their advantages zeroed."""
    batch = _toy_batch(tiny_model_dir)
    off = torch.zeros(len(batch["advantages"]), dtype=torch.bool)
    off[[0, 3, 4, 9, 15]] = True
    skewed = {**batch, "old_logprobs": batch["old_logprobs"] + off[:, None] * batch["loss_mask"] * math.log(4)}
    m = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig(is_correction="icepop")
                          ).train_step(skewed)
    mask = batch["loss_mask"]
    assert m["is_mask_frac"] == pytest.approx(float(mask[off].sum() / mask.sum()), abs=1e-6)
    zeroed = {**batch, "advantages": batch["advantages"].masked_fill(off, 0.0)}
    plain = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig()).train_step(zeroed)
    assert m["pg_loss"] == pytest.approx(plain["pg_loss"], abs=1e-5)


@pytest.mark.parametrize("kl_in", ["loss", "reward"])
def test_kl_in_reward_stays_out_of_the_loss(tiny_model_dir, kl_in):
    trainer = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig(kl_coef=0.1, kl_in=kl_in))
    calls = _count_forwards(trainer)
    m = trainer.train_step(_toy_batch(tiny_model_dir))
    assert calls == ([True] if kl_in == "loss" else [])  # the reference forward only for the loss term
    assert ("kl" in m) == (kl_in == "loss")


def test_session_token_advantages_kl_reward_and_is(recipe, tmp_path):
    """REINFORCE++ with KL in the reward and TIS through the stages: token advantages [N, L], the train engine's
    logprobs computed once (in the advantages stage, reused by the train step), the reference's once."""
    cfg = recipe(algorithm={"advantage": "reinforce_pp", "kl_coef": 0.05, "kl_in": "reward", "is_correction": "tis",
                            "kl_estimator": "k1"}, train={"steps": 2, "threads": 1, "lr": 0.05})
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    calls = _count_forwards(session.train_group.workers[0])
    for step in range(2):
        calls.clear()
        session.rollout(step)
        session.reward(step)
        adv = session.advantages(step)
        st = session.steps.get(step)
        n = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
        assert st.advantages.dim() == 2 and st.advantages.shape[0] == n and st.train_logprobs is not None
        train = session.train(step)
        assert sorted(calls) == [False, True]
        assert train["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and "train/kl" not in train
        session.sync_weights(step)
        if step == 0:  # the reference is the starting policy: no KL yet
            assert abs(adv["adv/kl_penalty"]) < 1e-5
    assert abs(adv["adv/kl_penalty"]) > 1e-4  # one step (lr 0.05) later the policy has moved
    session.shutdown()


# ----------------------------------------------------------------------------- the continuous-batching rollout engine


def _arch_model(tmp_path, arch: str) -> str:
    """A random 2-layer model of each family the engine's own forward implements (Qwen2: qkv bias; Qwen3: q/k
    norm and a head_dim that is not hidden/heads; Mixtral: MoE layers of 4 experts, top 2; Qwen3-MoE: an MoE layer,
    then a dense one)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    cfg = {"llama": lambda: LlamaConfig(**common),
           "qwen2": lambda: Qwen2Config(**common),
           "qwen3": lambda: Qwen3Config(**common, head_dim=16),
           "mixtral": lambda: MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
           "qwen3_moe": lambda: Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=16, mlp_only_layers=[1])}[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random biases / norm weights, so a forward that ignored them would differ
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / arch
    model.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("fused", [False, True], ids=["per-projection", "fused"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_own_forward_matches_hf(tmp_path, arch, fused):
    """Our decoder's prefill, chunked prefill and paged decode give HF's logits. `fused`: the weights laid out as
    a GPU rollout worker keeps them (one flat buffer in fusable_order), so q/k/v and gate/up run as one GEMM each
    over views of that buffer; also after the buffer moves (a colocated release and resume re-allocates it)."""
    from rlflow.engines.models.decoder import DecoderLM
    from rlflow.engines.models.flat_weights import flatten_, fusable_order
    from rlflow.engines.models.hf import load_model

    hf = load_model(_arch_model(tmp_path, arch)).eval()
    params = dict(hf.named_parameters())
    if fused:
        flatten_({n: params[n] for n in fusable_order(list(params))})
    lm = DecoderLM(hf)
    dense = [i for i in range(2) if f"model.layers.{i}.mlp.gate_proj.weight" in params]
    assert lm.graph_safe  # MoE layers too: their experts run on torch's grouped kernel (fp32 on CPU, bf16 on CUDA)
    assert lm.fused_groups == (hf.config.num_hidden_layers + len(dense) if fused else 0)
    if fused:  # the buffer moves: the fused views follow it
        flatten_({n: params[n] for n in fusable_order(list(params))})
        lm.fuse_projections()
        assert lm._qkv[0][0].data_ptr() == params["model.layers.0.self_attn.q_proj.weight"].data_ptr()
        for i in dense:
            assert lm._gate_up[i][0].data_ptr() == params[f"model.layers.{i}.mlp.gate_proj.weight"].data_ptr()
    cache = lm.new_cache(rows=3, max_len=32, num_pages=12, page_size=4)
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8]]
    seqs = [list(p) for p in prompts]
    pages = [[3, 7], [1], [5, 2]]  # rows 0 and 2; row 2 continues prompt 1 from position 2 (chunked prefill)
    out = torch.empty(3, lm.vocab_size)
    with torch.no_grad():
        first = lm.prefill(cache, [prompts[0], prompts[1][:2]], [0, 0], [pages[0], pages[2]])
        last = [first[0], lm.prefill(cache, [prompts[1][2:]], [2], [pages[2]])[0]]
        for _ in range(4):  # grow both sequences token by token; compare with HF on the whole sequence
            for s, seq in enumerate(seqs):
                ref = hf(torch.tensor([seq])).logits[0, -1]
                assert (last[s] - ref).abs().max() < 1e-5, (arch, len(seq))
            nxt = [int(x.argmax()) for x in last]
            for seq, t in zip(seqs, nxt, strict=True):
                seq.append(t)
            for held, seq, spare in ((pages[0], seqs[0], 8), (pages[2], seqs[1], 9)):  # grow pages with the tokens
                if len(held) * 4 < len(seq):
                    held.append(spare)
            cache.set_row(0, pages[0])
            cache.set_row(2, pages[2])
            cache.flush()
            positions = torch.tensor([len(seqs[0]) - 1, 0, len(seqs[1]) - 1])  # row 1 idle: scratch page
            lm.decode_rows(cache, torch.tensor([nxt[0], 0, nxt[1]]), positions, cache.max_pages, out)
            last = [out[0].clone(), out[2].clone()]


def test_samples_do_not_depend_on_batch_mates(tiny_model_dir):
    p = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9)
    alone = TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=1).generate(PROMPTS, p, seed=7)
    together = TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=8).generate(PROMPTS + [[1, 2, 3]], p, seed=7)
    assert [g.output_ids for g in alone] == [g.output_ids for g in together[:3]]
    for a, b in zip(alone, together, strict=False):
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True)) < 1e-5


def test_request_joins_mid_batch_and_abort_keeps_its_tokens(tiny_model_dir):
    """At the 2nd token of a running request a second one is submitted (it joins the running batch and samples
    what it samples alone); at the 3rd the first is aborted and returns its 3 tokens."""
    backend = TorchRolloutBackend(tiny_model_dir, threads=1, trace=True)
    long = SamplingParams(max_new_tokens=20, ignore_eos=True)
    first = backend.requests([PROMPTS[0]], long, seed=1, rid="first")[0]
    joiner = backend.requests([PROMPTS[1]], SamplingParams(max_new_tokens=4, ignore_eos=True), seed=2)[0]
    joined_at: list[int] = []

    def on_token(r):
        if len(r.output_ids) == 2:
            backend.engine.submit([joiner])
        if len(r.output_ids) == 3:
            backend.engine.abort("first")

    first.on_token = on_token
    joiner.on_token = lambda r: joined_at.append(len(first.output_ids)) if len(r.output_ids) == 1 else None
    aborted = backend.engine.submit([first])[0].result(timeout=60)
    assert aborted.finish_reason["type"] == "abort" and len(aborted.output_ids) == len(aborted.output_logprobs) == 3
    assert joined_at == [3]  # the joiner's first token came in the step right after it was submitted
    joined = joiner.future.result(timeout=60)
    alone = backend.generate([PROMPTS[1]], SamplingParams(max_new_tokens=4, ignore_eos=True), seed=2)[0]
    assert joined.output_ids == alone.output_ids and joined.finish_reason == {"type": "length", "length": 4}
    assert [e["name"] for e in backend.drain_trace()].count("abort") == 1
    backend.close()


def test_a_generation_paused_for_a_weight_update_continues_with_the_new_weights(tiny_model_dir):
    """Partial rollouts (rollout.max_staleness >= 2): at its 4th token a request's engine is paused, the weights
    change to version 1, generation continues. Its first 5 tokens (the 5th was sampled from logits computed before
    the pause) are the ones it samples with no update; from the 6th on, its logprobs are the new weights'. It
    records both versions, first and last."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    backend = TorchRolloutBackend(tiny_model_dir, threads=1)
    ref = backend.generate([PROMPTS[0]], params, seed=5)[0]
    assert (ref.weight_version, ref.last_weight_version) == (0, 0)
    gen = torch.Generator().manual_seed(0)
    new = {n: p + 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in backend.params.items()}
    request = backend.requests([PROMPTS[0]], params, seed=5)[0]
    paused = threading.Event()

    def on_token(r):
        if len(r.output_ids) == 4:
            backend.pause_generation()  # on the engine's own thread: it stops after this step
            paused.set()

    request.on_token = on_token
    future = backend.engine.submit([request])[0]
    assert paused.wait(timeout=60)
    assert len(request.output_ids) == 4 and not future.done()
    backend.update_weights(new.items(), version=1)
    backend.continue_generation()
    out = future.result(timeout=60)
    assert (out.weight_version, out.last_weight_version) == (0, 1)
    assert len(out.output_ids) == 12 and out.output_ids[:5] == ref.output_ids[:5]
    assert out.output_logprobs[:5] == pytest.approx(ref.output_logprobs[:5], abs=1e-6)
    assert abs(out.output_logprobs[5] - ref.output_logprobs[5]) > 1e-3 or out.output_ids[5] != ref.output_ids[5]
    backend.close()
