"""Train/rollout log-prob mismatch of a mixture of experts in bf16, with and without routing replay (r3), against
a dense model of the same shape: the embedded engine samples (recording each token's experts), the native trainer
scores the same tokens.

    PYTHONUNBUFFERED=1 python -m bench.train.routing_replay --out routing_replay.json [--true-on-policy]

Reported: mean and 99th percentile of |log p_train - log p_rollout| over the response tokens, and the share of
(token, MoE layer) routings the trainer picks differently from the engine when it routes live. Random weights (a
Qwen3-MoE and the Qwen3 with the same attention, hidden size and depth); the MoE's experts' down projections are
scaled so that what they add to the residual stream is as large as the dense MLP's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from bench import harness
from rlflow.engines.core.batch import ROUTED_EXPERTS, RolloutBatch
from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models.hf import build_char_tokenizer
from rlflow.engines.models.moe import routing_width
from rlflow.engines.rollout.functions import PromptSample, Sample
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.train.torch_backend import TorchTrainBackend

SHAPES = {
    "1B-A0.3B": dict(vocab_size=32768, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
                     num_attention_heads=16, num_key_value_heads=4, head_dim=64, moe_intermediate_size=512,
                     num_experts=64, num_experts_per_tok=8),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=32, num_experts_per_tok=4),
}
MOE_KEYS = ("moe_intermediate_size", "num_experts", "num_experts_per_tok")


def build(shape: dict, out: Path, moe: bool, device: str) -> str:
    common = {k: v for k, v in shape.items() if k not in MOE_KEYS} | {"max_position_embeddings": 4096}
    config = Qwen3MoeConfig(**common, **{k: shape[k] for k in MOE_KEYS}) if moe else Qwen3Config(**common)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if moe:  # as large an MLP contribution as the dense model's: k experts of width f against one of 4096
        scale = shape["intermediate_size"] / (shape["num_experts_per_tok"] * shape["moe_intermediate_size"])
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.down_proj.mul_(scale ** 0.5)
    model.save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return str(out)


def rollout(path: str, prompts: list[list[int]], new_tokens: int, device: str, record: bool,
            exact: bool = False) -> RolloutBatch:
    engine = TorchRolloutBackend(path, device=device, dtype=torch.bfloat16, batch_size=len(prompts),
                                 context_len=len(prompts[0]) + new_tokens + 16, record_routing=record,
                                 true_on_policy=exact)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True),
                           seed=3)
    engine.close()
    samples = [Sample(response_ids=g.output_ids, logprobs=g.output_logprobs, weight_version=0,
                      routed_experts=None if g.routed_experts is None else g.routed_experts.reshape(-1))
               for g in gens]
    meta = [PromptSample(index=i, prompt="", label=None, prompt_ids=p, n=1, seed=0) for i, p in enumerate(prompts)]
    return RolloutBatch.from_samples(meta, [[s] for s in samples], routing_width(AutoConfig.from_pretrained(path)))


def mismatch(trainer: TorchTrainBackend, batch: RolloutBatch) -> dict:
    tb = batch.to_train_batch(0, torch.zeros(len(batch)))
    diff = (trainer.forward_logprobs(tb) - tb["old_logprobs"]).abs()[tb["loss_mask"].bool()]
    return {"mean": float(diff.mean()), "p99": float(diff.quantile(0.99)), "max": float(diff.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1B-A0.3B", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--true-on-policy", action="store_true", help="also the MoE with rollout.true_on_policy on both "
                    "sides (engines/models/invariant.py): expected exactly 0")
    ap.add_argument("--out", default="routing_replay.json")
    harness.add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.size, args.prompts, args.prompt_len, args.new_tokens = "smoke", 8, 8, 48
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    work = Path(tempfile.mkdtemp(prefix="rlflow-r3-"))
    shape = SHAPES[args.size]
    moe, dense = build(shape, work / "moe", True, device), build(shape, work / "dense", False, device)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, shape["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()
    train = TrainConfig(threads=4, mini_batches=1, precision="bf16", device=device, micro_batch_tokens=16384)
    result: dict = harness.report_header(__spec__.name, None) | {
        "size": args.size, "shape": shape, "prompts": args.prompts, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens}

    batch = rollout(moe, prompts, args.new_tokens, device, record=True)
    trainer = TorchTrainBackend(moe, train, AlgorithmConfig(routing_replay="r3"))
    tb = batch.to_train_batch(0, torch.zeros(len(batch)))
    own = trainer.record_routing({k: v for k, v in tb.items() if k != ROUTED_EXPERTS})
    rec = tb[ROUTED_EXPERTS]
    fed = rec[..., 0] >= 0
    layers, k = trainer.routing_shape
    flips = (own[fed].view(-1, layers, k).sort(-1).values != rec[fed].view(-1, layers, k).sort(-1).values).any(-1)
    result["routing_flips"] = float(flips.float().mean())
    result["moe_r3"] = mismatch(trainer, batch)
    result["moe_live"] = mismatch(trainer, replace(batch, routed_experts=None, metadata={}))
    dense_trainer = TorchTrainBackend(dense, train, AlgorithmConfig())
    result["dense"] = mismatch(dense_trainer, rollout(dense, prompts, args.new_tokens, device, record=False))
    if args.true_on_policy:
        exact_trainer = TorchTrainBackend(moe, train, AlgorithmConfig(), true_on_policy=True)
        result["moe_true_on_policy"] = mismatch(exact_trainer, rollout(moe, prompts, args.new_tokens, device,
                                                                       record=False, exact=True))
    print({k: result[k] for k in ("routing_flips", "moe_live", "moe_r3", "dense", "moe_true_on_policy")
           if k in result}, flush=True)
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
