"""Expert parallelism in the native trainer (engines/train/expert_parallel.py): two gloo ranks on CPU, a tiny
Qwen3-MoE, EP=2 against EP=1 (plain FSDP2 over the same two ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.batch import shard_for_workers
from rlflow.engines.core.config import AlgorithmConfig, RLConfig, TrainConfig
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.conftest import resume_one_rank_and_export
from tests.megatron_helpers import toy_batch

EXPERTS = 4


def ep_worker(rank: int, world: int, url: str, model_dir: str, out: str) -> None:
    """Each layout in turn on the same two ranks: EP=1 and EP=2 score the batch, take one step and export their
    weights; the EP=2 run saves a checkpoint, which EP=1 then loads and exports."""
    batch = toy_batch(n=8, vocab=96)
    shard = shard_for_workers(batch, world, 1)[rank]
    for ep in (1, 2):
        backend = TorchTrainBackend(model_dir, TrainConfig(threads=1, mini_batches=1, expert_parallel=ep),
                                    AlgorithmConfig(), rank=rank, world_size=world, dist_url=url)
        logprobs = backend.forward_logprobs(shard)
        metrics = backend.train_step(shard)
        weights = dict(backend.named_tensors())  # rank 0 holds them
        experts = backend.model.model.layers[0].mlp.experts.gate_up_proj
        held = experts.to_local().shape[0] if ep > 1 else EXPERTS  # EP=1: FSDP2 shards every weight alike
        torch.save({"logprobs": logprobs, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                    "experts_held": held},
                   f"{out}/ep{ep}.rank{rank}.pt")
        if rank == 0:
            save_file({n: t.contiguous() for n, t in weights.items()}, f"{out}/ep{ep}.safetensors")
        if ep == 2:
            backend.save(f"{out}/ckpt")
    resume_one_rank_and_export(model_dir, out, rank, world, url)


def test_ep2_scores_and_steps_as_ep1_and_its_checkpoint_resumes_at_ep1(tiny_moe_dir, tmp_path):
    """fp32: EP=2's log-probs, loss, gradient norm and updated weights (gathered whole, as weight sync sends them)
    equal EP=1's within 1e-5, and a checkpoint of the EP=2 run loads at EP=1 with its weights bit for bit."""
    mp.spawn(ep_worker, args=(2, f"tcp://127.0.0.1:{free_port()}", tiny_moe_dir, str(tmp_path)), nprocs=2)
    for rank in range(2):
        one, two = (torch.load(tmp_path / f"ep{ep}.rank{rank}.pt") for ep in (1, 2))
        assert (one["logprobs"] - two["logprobs"]).abs().max() < 1e-5
        assert abs(one["loss"] - two["loss"]) < 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) < 1e-5
        assert two["experts_held"] == EXPERTS // 2  # each rank computed half of the experts for both ranks
    one, two = load_file(tmp_path / "ep1.safetensors"), load_file(tmp_path / "ep2.safetensors")
    assert one.keys() == two.keys() and any(".experts." in n for n in one)
    start = load_file(Path(tiny_moe_dir) / "model.safetensors")
    moved = [n for n in one if ".experts." in n and not torch.equal(one[n], start[n])]
    assert moved, "the step moved no expert weight"
    for name in one:
        assert (one[name] - two[name]).abs().max() < 1e-5, name
    resumed = load_file(tmp_path / "resumed.safetensors")
    assert all(torch.equal(resumed[n], two[n]) for n in two)


def test_expert_parallel_sizes_that_cannot_work_are_named_errors(tiny_moe_dir, tmp_path):
    from transformers import Qwen3Config

    from tests.test_routing_replay import COMMON, _save

    data = {"data": {"train_path": "x.jsonl"}}
    with pytest.raises(ValueError, match=r"train.expert_parallel 2: must be 1 or train.num_workers \(4\)"):
        RLConfig.model_validate(data | {"train": {"expert_parallel": 2, "num_workers": 4}})
    with pytest.raises(ValueError, match="train.expert_parallel 2: the torch backend's"):
        RLConfig.model_validate(data | {"train": {"expert_parallel": 2, "num_workers": 2, "backend": "megatron"}})
    with pytest.raises(ValueError, match="with train.cpu_offload"):
        RLConfig.model_validate(data | {"train": {"expert_parallel": 2, "num_workers": 2, "cpu_offload": True}})
    with pytest.raises(ValueError, match="train.expert_parallel 3 does not divide the model's 4 experts"):
        TorchTrainBackend(tiny_moe_dir, TrainConfig(threads=1, expert_parallel=3), AlgorithmConfig())
    dense = _save(tmp_path / "dense", Qwen3Config(**COMMON))
    with pytest.raises(ValueError, match="has no experts"):
        TorchTrainBackend(dense, TrainConfig(threads=1, expert_parallel=2), AlgorithmConfig())


def test_preflight_checks_expert_parallel_against_the_models_experts(recipe, tiny_moe_dir, tmp_path):
    """Before any worker starts: an EP that does not divide the experts, or a dense model, is a problem naming
    train.expert_parallel and the model."""
    from rlflow.engines.session.preflight import find_problems
    from rlflow.engines.session.workers import prepare_model

    problems = find_problems(recipe(model={"path": tiny_moe_dir}, train={"expert_parallel": 3, "num_workers": 3},
                                    rollout={"prompts_per_step": 3, "samples_per_prompt": 2}, sft={"batch_size": 3}))
    assert any("train.expert_parallel 3 does not divide the 4 experts" in p for p in problems), problems
    assert not [p for p in find_problems(recipe(model={"path": tiny_moe_dir},
                                                train={"expert_parallel": 2, "num_workers": 2})) if "expert" in p]
    dense = prepare_model(recipe(), tmp_path)
    problems = find_problems(recipe(model={"path": dense}, train={"expert_parallel": 2, "num_workers": 2}))
    assert any("train.expert_parallel 2: model.path" in p and "dense" in p for p in problems), problems
