"""Shared pieces of the Megatron tests: tiny HF models and a 2-process gloo worker (spawned, so it lives in a
module the child can import, not in the test file)."""

from __future__ import annotations

import gc
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from rlflow.engines.core.batch import TrainBatch, pack_samples, select, shard_for_workers
from rlflow.engines.core.config import AlgorithmConfig, MegatronConfig, TrainConfig
from tests.spawned_ranks import end_ranks

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mixtral": MixtralConfig,
            "qwen3_moe": Qwen3MoeConfig}
# 4 experts of width 32, 2 per token (Qwen3-MoE without renormalising them, as its default config)
MOE = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
       "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "norm_topk_prob": False}}


def tiny_hf_model(out: str | Path, family: str, tied: bool = False, seed: int = 0, layers: int = 2
                  ) -> dict[str, torch.Tensor]:
    """A `layers`-layer (default 2) HF model with 4 query / 2 KV heads (head_dim 24 != hidden / heads), every weight
    perturbed so that norms are not all 1 and biases not all 0 (MoE families: 4 experts, 2 per token). Saved to
    `out`; returns its state dict."""
    kw = {"intermediate_size": 128} | MOE.get(family, {})
    cfg = FAMILIES[family](vocab_size=96, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=24, max_position_embeddings=64, tie_word_embeddings=tied,
                           rms_norm_eps=1e-6, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    return {k: v.clone() for k, v in model.state_dict().items()}


def toy_batch(n: int = 8, vocab: int = 18, seed: int = 0) -> TrainBatch:
    """n right-padded samples of mixed prompt and response lengths, old logprobs -1, advantages spread."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(4, vocab, (int(torch.randint(lo, hi, (), generator=g)),), generator=g).tolist()

    prompts = [[1, *ids(2, 6)] for _ in range(n)]
    responses = [ids(1, 6) for _ in range(n)]
    return pack_samples(prompts, responses, [[-1.0] * len(r) for r in responses], torch.linspace(-1.5, 1.5, n), 0)


def train_config(**kw) -> TrainConfig:
    return TrainConfig(**({"threads": 1, "micro_batch_size": 3, "mini_batches": 2} | kw))


def backends_in_turn_worker(rank: int, model_dir: str, out: str) -> None:
    """Megatron backends built one after another in a fresh process, torch.distributed re-initialised between
    them once; writes the c10d group names and the thread count at each point as JSON to `out`. A fresh process:
    megatron's DDP keeps each model it wraps alive through its gradient hooks (a cycle through autograd's C++
    nodes that Python's collector cannot see), so in a process that built other backends before, their groups
    outlive any release."""
    from rlflow.engines.train.megatron.backend import MegatronTrainBackend

    def state() -> dict:
        return {"groups": sorted(dist.distributed_c10d._world.pg_names.values()),
                "threads": len(os.listdir(f"/proc/{os.getpid()}/task"))}

    def step() -> None:
        MegatronTrainBackend(model_dir, train_config(), AlgorithmConfig(), None).train_step(toy_batch())

    step()
    seen = {"first": state()}
    for _ in range(3):
        step()
    seen["fourth"] = state()
    dist.destroy_process_group()  # torch.distributed brought down and up again: every group is new
    step()
    gc.collect()
    seen["reinitialised"] = state()
    Path(out).write_text(json.dumps(seen))


def parallel_layouts_worker(rank: int, world: int, url: str, jobs: list[dict]) -> None:
    """One rank running several layouts in turn (each job: parallel_worker's keyword arguments but rank, world and
    url): the processes import megatron-core once, not once a layout; the backend re-forms megatron's parallel
    groups over the same torch.distributed group for each."""
    for job in jobs:
        parallel_worker(rank, world, url=url, **job)
    end_ranks()


def parallel_worker(rank: int, world: int, tp: int, pp: int, url: str, model_dir: str, hf_dirs: dict[str, str],
                    out: str, resume: str = "", ep: int = 1) -> None:
    """One rank of a 2-process layout: TP round trips of every family's HF weights (after loading into a
    TP-sharded model; also written as a sharded HF checkpoint into `out + ".hf/<family>"`), then a logprob
    pass and a train step of the backend. Rank 0 writes results as JSON and
    the final weights as safetensors. Then a checkpoint into `out + ".ckpt"`, one more step (its weights in
    `out + ".next.safetensors"`), and, given `resume` (a checkpoint
    of another layout), its weights loaded into this layout and their logprobs. With expert parallelism (`ep`),
    only the MoE families make the round trips."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from rlflow.engines.train.megatron.backend import MegatronTrainBackend
    from rlflow.engines.train.megatron.cpu import cpu_shim
    from rlflow.engines.train.megatron.export import WeightExporter
    from rlflow.engines.train.megatron.hf_config import spec_from_hf
    from rlflow.engines.train.megatron.model_build import build_model, load_hf_weights, stage_params, transformer_config

    # packed THD across ranks
    mcfg = MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, packing=True)
    backend = MegatronTrainBackend(model_dir, train_config(), AlgorithmConfig(), mcfg, rank=rank, world_size=world,
                                   dist_url=url)
    results: dict = {"round_trip": {}}
    with cpu_shim():
        for family, path in hf_dirs.items():
            if ep > 1 and family not in MOE:
                continue
            spec = spec_from_hf(AutoConfig.from_pretrained(path))
            model = build_model(spec, transformer_config(spec, mcfg, torch.float32, "cpu"), use_te=False,
                                attention=mcfg.attention)
            load_hf_weights(model, spec, path)
            exporter = WeightExporter(spec, stage_params(model), fused_norms=False)
            exported = exporter.gather(list(_hf_names(path)))
            exporter.save_hf(f"{out}.hf/{family}", max_file_bytes=1 << 12)  # small files: several per stage
            if rank == 0:
                from safetensors.torch import load_file

                hf = load_file(str(Path(path) / "model.safetensors"))
                results["round_trip"][family] = {n: bool(torch.equal(t, hf[n])) for n, t in exported}
                results["round_trip"][family]["__count__"] = len(exported)
    batch = toy_batch()
    logprobs = backend.forward_logprobs(batch)
    dp = world // (tp * pp)
    shard = shard_for_workers({**batch, "old_logprobs": logprobs}, dp, 2)[backend.data_parallel_rank()]
    results["metrics"] = global_metrics(backend.train_step(shard))
    weights = dict(backend.named_tensors())
    backend.save(out + ".ckpt")
    # the step after the checkpoint: what a resume on another layout must take (optimizer state included)
    results["next_metrics"] = global_metrics(backend.train_step(shard_for_workers(toy_batch(seed=1), dp, 2)[
        backend.data_parallel_rank()]))
    next_weights = dict(backend.named_tensors())
    if resume:
        backend.load(resume, weights_only=True)
        results["resumed_logprobs"] = backend.forward_logprobs(batch).tolist()
    if rank == 0:
        results["logprobs"] = logprobs.tolist()
        save_file({k: v.contiguous() for k, v in weights.items()}, out + ".safetensors")
        save_file({k: v.contiguous() for k, v in next_weights.items()}, out + ".next.safetensors")
        Path(out).write_text(json.dumps(results))


def _hf_names(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return list(f.keys())  # noqa: SIM118 (safe_open has no __iter__)


def global_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A train step's metrics without its wall time, which differs between runs and ranks."""
    return {k: v for k, v in metrics.items() if k != "worker_s"}


def uneven_expert_parallel_worker(rank: int, world: int, model_dir: str, url: str, packing: bool, out: str,
                                  split: int = 4) -> None:
    """One of 2 expert-parallel ranks fed shards of different sizes: rank 0 rows 0..split-1 of toy_batch(6), rank 1
    the rest, in micro-batches of 2 rows, so (split 4) rank 0 runs 2 micro-batches where rank 1 has 1 (the RL
    session's shards differ in length like this), or (split 6) rank 1 has none. Writes its shard's logprobs and its
    train step's metrics to `out`.<rank>.json."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from rlflow.engines.train.megatron.backend import MegatronTrainBackend

    mcfg = MegatronConfig(expert_parallel=2, packing=packing)
    backend = MegatronTrainBackend(model_dir, train_config(micro_batch_size=2, mini_batches=1), AlgorithmConfig(),
                                   mcfg, rank=rank, world_size=world, dist_url=url, collective_timeout_s=60)
    shard = select(toy_batch(6), slice(0, split) if rank == 0 else slice(split, 6))
    logprobs = backend.forward_logprobs(shard)
    metrics = global_metrics(backend.train_step({**shard, "old_logprobs": logprobs}))
    Path(f"{out}.{rank}.json").write_text(json.dumps({"logprobs": logprobs.tolist(), "metrics": metrics}))
