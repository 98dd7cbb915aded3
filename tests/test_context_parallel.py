"""Context parallelism in the native trainer (engines/train/context_parallel.py, engines/models/ulysses.py): two
gloo ranks on CPU, CP=2 (one data-parallel group of two CP ranks) against CP=1 (two data-parallel ranks), on a
Qwen2 whose 2 kv heads split over the group and a Llama whose single kv head is repeated to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.batch import pack_samples, shard_for_workers
from rlflow.engines.core.config import AlgorithmConfig, RLConfig, TrainConfig, config_from_dict
from rlflow.engines.train.context_parallel import check_lengths
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.conftest import resume_one_rank_and_export, small_recipe
from tests.test_selective_checkpointing import CountAttention

VOCAB = 40
LAYERS = 2
# prompt + response lengths: 14, 9, 41, 6, 23, 12, 17, 8 tokens. At 32 tokens per rank a CP=2 micro-batch holds up
# to 64: several samples each, the streams' halves cut through samples, one stream has an odd length (padded), and
# the 41-token sample fits CP=2's budget only (CP=1 runs it in a micro-batch of its own)
LENGTHS = [(6, 8), (4, 5), (9, 32), (3, 3), (11, 12), (5, 7), (8, 9), (2, 6)]


def cp_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    prompts = [[1, *torch.randint(4, VOCAB, (p - 1,), generator=g).tolist()] for p, _ in LENGTHS]
    responses = [torch.randint(4, VOCAB, (r,), generator=g).tolist() for _, r in LENGTHS]
    logprobs = [(-torch.rand(len(r), generator=g) * 3).tolist() for r in responses]
    return pack_samples(prompts, responses, logprobs, torch.linspace(-1.5, 1.5, len(LENGTHS)), 0)


def _model(tmp_path, arch: str) -> str:
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                  num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
    cfg = Qwen2Config(**common, num_key_value_heads=2) if arch == "qwen2" else LlamaConfig(**common,
                                                                                         num_key_value_heads=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random biases and norm weights, so a forward that dropped them would differ
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / arch)
    return str(tmp_path / arch)


def _full_grads(backend: TorchTrainBackend) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (collective: FSDP2 keeps each rank's shard)."""
    return {n: p.grad.full_tensor().clone() for n, p in backend.model.named_parameters()}


def cp_worker(rank: int, world: int, url: str, model_dir: str, out: str, size: int, ckpt: str) -> None:
    """CP=1 and CP=`size` in turn on the same ranks: each scores the whole batch, takes one step on its data shard
    and records the gradients, the updated weights and the metrics; the CP run saves a checkpoint that CP=1 loads.
    `ckpt` full or selective: the CP run recomputes each layer in the backward (activation checkpointing: the
    all-to-alls run again; selective keeps the attention kernel's outputs); off: both have a KL term to a reference
    model, whose forward is split too."""
    batch = cp_batch()
    for cp in (1, size):
        train = TrainConfig(threads=1, mini_batches=1, micro_batch_tokens=64 // size, context_parallel=cp,
                            activation_checkpointing=ckpt if cp > 1 else "off")
        algo = AlgorithmConfig() if ckpt != "off" else AlgorithmConfig(kl_coef=0.1, kl_in="loss")
        backend = TorchTrainBackend(model_dir, train, algo, rank=rank, world_size=world, dist_url=url)
        logprobs = backend.forward_logprobs(batch)
        shard = shard_for_workers(batch, world // cp, 1)[backend.data_parallel_rank()]
        micro = [len(rows) for rows, _ in backend.micro_batches(shard)]
        with CountAttention() as attention:
            metrics = backend.train_step(shard)
        grads = _full_grads(backend)
        weights = dict(backend.named_tensors())  # rank 0 holds them
        name = "one" if cp == 1 else "cp"
        torch.save({"logprobs": logprobs, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                    "micro": micro, "attention": attention.calls}, f"{out}/{name}.rank{rank}.pt")
        if rank == 0:
            save_file(grads, f"{out}/{name}.grads.safetensors")
            save_file({n: t.contiguous() for n, t in weights.items()}, f"{out}/{name}.safetensors")
        if cp > 1:
            backend.micro_batches(batch)  # the 41-token sample fits CP x 64 / CP
            backend.cfg = backend.cfg.model_copy(update={"micro_batch_tokens": 40 // cp})
            try:
                backend.micro_batches(batch)
                too_long = None
            except ValueError as e:
                too_long = str(e)
            Path(out, f"too_long.rank{rank}.json").write_text(json.dumps(too_long))
            backend.cfg = backend.cfg.model_copy(update={"micro_batch_tokens": 64 // cp})
            backend.save(f"{out}/ckpt")
    resume_one_rank_and_export(model_dir, out, rank, world, url)


@pytest.mark.parametrize(("arch", "world", "size", "ckpt"),
                         [("qwen2", 2, 2, "off"), ("llama", 2, 2, "full"), ("qwen2", 2, 2, "selective"),
                          ("qwen2", 4, 2, "off"), ("qwen2", 4, 4, "off")],
                         ids=["qwen2-kv-split-kl", "llama-kv-repeated-recomputed", "qwen2-kv-split-selective",
                              "qwen2-dp2xcp2", "qwen2-cp4-kv-partly-repeated"])
def test_cp_scores_and_steps_as_cp1_and_its_checkpoint_resumes_at_cp1(tmp_path, arch, world, size, ckpt):
    """fp32: CP=`size`'s log-probs (of every rank), loss, gradients and updated weights equal CP=1's within 1e-5 on
    the same ranks (4 ranks at CP=2: 2 data-parallel groups of 2 CP ranks against 4 data-parallel ranks; CP=4 with
    2 kv heads: each repeated twice, Qwen2-1.5B's case at CP=4); a checkpoint of the CP run loads at CP=1 bit for
    bit; a sample longer than CP x micro_batch_tokens is named."""
    model_dir = _model(tmp_path, arch)
    mp.spawn(cp_worker, args=(world, f"tcp://127.0.0.1:{free_port()}", model_dir, str(tmp_path), size, ckpt),
             nprocs=world)
    mask = cp_batch()["attention_mask"].bool()
    for rank in range(world):
        one, two = (torch.load(tmp_path / f"{name}.rank{rank}.pt") for name in ("one", "cp"))
        assert one["logprobs"][mask].abs().sum() > 1
        assert (one["logprobs"] - two["logprobs"]).abs().max() < 1e-5
        assert abs(one["loss"] - two["loss"]) < 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) < 1e-5
        assert max(two["micro"]) > 1  # a stream of several samples, split in two
        if ckpt != "off":  # the CP step's attention kernel per layer and micro-batch: again in full's recompute only
            assert two["attention"] == (2 if ckpt == "full" else 1) * LAYERS * len(two["micro"])
        error = json.loads((tmp_path / f"too_long.rank{rank}.json").read_text())
        assert f"41 tokens is longer than train.context_parallel x train.micro_batch_tokens = {size} x " in error
    for kind in ("grads", None):
        one, two = (load_file(tmp_path / (f"{name}.{kind}.safetensors" if kind else f"{name}.safetensors"))
                    for name in ("one", "cp"))
        assert one.keys() == two.keys()
        for name in one:
            assert (one[name] - two[name]).abs().max() < 1e-5, (kind, name)
    grads = load_file(tmp_path / "cp.grads.safetensors")
    assert all(g.abs().max() > 0 for n, g in grads.items() if "k_proj" in n or "v_proj" in n)
    resumed, two = load_file(tmp_path / "resumed.safetensors"), load_file(tmp_path / "cp.safetensors")
    assert all(torch.equal(resumed[n], two[n]) for n in two)


def test_context_parallel_settings_that_cannot_work_are_named_errors(tmp_path):
    data = {"data": {"train_path": "x.jsonl"}}
    with pytest.raises(ValueError, match=r"train.context_parallel 2 must divide train.num_workers \(3\)"):
        RLConfig.model_validate(data | {"train": {"context_parallel": 2, "num_workers": 3}})
    with pytest.raises(ValueError, match="train.context_parallel 2: the torch backend's"):
        RLConfig.model_validate(data | {"train": {"context_parallel": 2, "num_workers": 2, "backend": "megatron"}})
    with pytest.raises(ValueError, match="train.context_parallel 2 with train.lora: not supported"):
        RLConfig.model_validate(data | {"train": {"context_parallel": 2, "num_workers": 2, "lora": {}},
                                        "weight_sync": {"transport": "adapter"}})
    with pytest.raises(ValueError, match="train.context_parallel 2 with algorithm.routing_replay"):
        RLConfig.model_validate(data | {"train": {"context_parallel": 2, "num_workers": 2},
                                        "algorithm": {"routing_replay": "r2"}})
    with pytest.raises(ValueError, match="train.context_parallel 2 with rollout.true_on_policy"):
        RLConfig.model_validate(data | {"train": {"context_parallel": 2, "num_workers": 2},
                                        "rollout": {"true_on_policy": True}})
    ok = RLConfig.model_validate(data | {"train": {"context_parallel": 2, "num_workers": 4}})
    assert ok.data_parallel_size == 2
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        TorchTrainBackend(_model(tmp_path, "qwen2"), TrainConfig(threads=1, context_parallel=3), AlgorithmConfig(),
                          world_size=1)
    check_lengths([10, 64], 2, 32)
    with pytest.raises(ValueError, match="a sample of 65 tokens is longer than"):
        check_lengths([10, 65], 2, 32)


def test_preflight_checks_context_parallel_against_the_models_heads(recipe, tmp_path):
    """Before any worker starts: a CP size that does not divide the model's attention heads is a problem naming
    train.context_parallel and the model."""
    from rlflow.engines.session.preflight import find_problems  # the session layer: only this test needs it

    model = _model(tmp_path, "qwen2")
    problems = find_problems(recipe(model={"path": model}, train={"context_parallel": 3, "num_workers": 3},
                                    rollout={"prompts_per_step": 3, "samples_per_prompt": 2}, sft={"batch_size": 3}))
    assert any("train.context_parallel 3 does not divide the 4 attention heads" in p for p in problems), problems
    assert not [p for p in find_problems(recipe(model={"path": model}, train={"context_parallel": 2,
                                                                            "num_workers": 2})) if "context" in p]


def test_the_rl_loop_with_one_cp_group_of_two_ray_workers_trains_as_one_worker(tmp_path):
    """The bare RL loop, engines in Ray actors: train.num_workers 2 at train.context_parallel 2 are one data-parallel
    group (data_parallel_rank 0 for both, the session sends each the whole batch), and its steps' losses equal one
    worker's without CP on the same recipe (fp32; the rollouts are the same while the weights are)."""
    from bench.e2e.bare_loop import run_bare  # the loop of bench/e2e (the session, Ray): only this test drives it

    def history(name: str, **train) -> list[dict]:
        raw = small_recipe(tmp_path / name, eval={"every": 0}, train={"steps": 2, "threads": 1, **train},
                           cluster={"use_ray": bool(train), "cpus_per_worker": 0.25})
        return run_bare(config_from_dict(raw), str(tmp_path / name), log=lambda line: None, use_ray=bool(train))

    one, cp = history("one"), history("cp", num_workers=2, context_parallel=2)
    assert len(one) == len(cp) == 2
    assert cp[0]["train/loss"] == pytest.approx(one[0]["train/loss"], abs=1e-5)
    assert cp[0]["train/grad_norm"] == pytest.approx(one[0]["train/grad_norm"], abs=1e-5)
