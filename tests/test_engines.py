"""The embedded engines agree with each other: rollout vs train logprobs, data-parallel vs single worker."""

from __future__ import annotations

import pytest
import torch

from engines.batch import pack_samples, shard_for_workers
from engines.cluster import LocalWorkerGroup, RayWorkerGroup, free_port
from engines.config import AlgorithmConfig, ClusterConfig, TrainConfig
from engines.rollout_torch import TorchRolloutBackend
from engines.sampling import SamplingParams
from engines.train_torch import TorchTrainBackend
from engines.weight_sync import plan_buckets

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
    m1, m2 = whole.train_step(batch), micro.train_step(batch)
    for (n, a), (_, b) in zip(whole.named_tensors(), micro.named_tensors(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), n
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from engines.cluster import init_ray

    init_ray(ClusterConfig(num_cpus=2))
    yield
    ray.shutdown()


def test_data_parallel_matches_single_worker(tiny_model_dir, ray_cluster):
    """2 gloo workers on half the batch each take the same steps as 1 worker on the whole batch."""
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
        m1 = single.call_each("train_step", [(s,) for s in shard_for_workers(batch, 1, 2)])[0]
        m2 = pair.call_each("train_step", [(s,) for s in shard_for_workers(batch, 2, 2)])
    for m in (m1, *m2):
        m.pop("worker_s")  # wall time, differs per rank
    assert m2[0] == pytest.approx(m2[1])  # every rank reports the global metrics
    assert m1["loss"] == pytest.approx(m2[0]["loss"], abs=1e-6)
    for (n, a), (_, b) in zip(single.call_rank0("named_tensors"), pair.call_rank0("named_tensors"), strict=True):
        assert torch.allclose(a, b, atol=1e-6), n
    pair.shutdown()
