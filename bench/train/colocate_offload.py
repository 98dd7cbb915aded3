"""GPU check of the colocated trainer offload (train.offload_during_rollout): one process, one GPU, the FSDP2
trainer and the embedded rollout engine side by side, as a colocated pair shares a GPU.

    PYTHONUNBUFFERED=1 python -m bench.train.colocate_offload --out colocate_offload.json

A random-weight model of Qwen2-1.5B's shape (bf16 on disk, tied embeddings, full 151936 vocab) and a synthetic
GRPO batch (--samples rows of --prompt-len + 64..--response-len random ids). The session's order is replayed:
train step -> offload(keep_weights=True) (optimizer state out) -> weight sync into the rollout engine (it
allocates its weights) -> offload() (weights out) -> the engine generates (its KV cache) -> the engine releases
-> onload() -> the next train step. Reported: GPU memory (allocated by torch, and free on the device, which is
what a rollout engine in another process could take) after each move, the seconds and GB/s of each move,
whether the parked state came back bit for bit (a float64 sum of every parameter shard and optimizer tensor,
before and after), and the next step's loss and grad norm against a trainer of the same seed that never
offloaded (run afterwards in the same process; deterministic algorithms on, so they should match exactly).

The park/onload cycle runs twice: the first pins the host buffers (cudaHostAlloc of the state's size, seconds),
the second reuses them, as every later step of a run does; compare `cycles[1]` for the steady state.

`--smoke` runs a tiny model on the CPU to check the script itself (no memory figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import harness
from bench.rollout.gpu import SHAPES, build_model
from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.train import fsdp
from rlflow.engines.train.torch_backend import TorchTrainBackend


def memory(device: str) -> dict[str, float] | None:
    """GiB torch holds (allocated, reserved) and the device's free memory, after torch's cache went back to the
    driver (so `free_gib` is what another process could take)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    gib = 1024**3
    return {
        "allocated_gib": torch.cuda.memory_allocated() / gib,
        "reserved_gib": torch.cuda.memory_reserved() / gib,
        "free_gib": free / gib,
        "total_gib": total / gib,
    }


def batch(vocab: int, n: int, prompt: int, response: int, seed: int) -> dict[str, torch.Tensor]:
    """n right-padded rows: a prompt of `prompt` ids and a response of 64..`response` ids (uniform)."""
    g = torch.Generator().manual_seed(seed)
    width = prompt + response
    lengths = prompt + torch.randint(min(64, response), response + 1, (n,), generator=g)
    cols = torch.arange(width)[None]
    attn = (cols < lengths[:, None]).long()
    return {
        "input_ids": torch.randint(0, vocab, (n, width), generator=g) * attn,
        "attention_mask": attn,
        "loss_mask": ((cols >= prompt) & attn.bool()).float(),
        "old_logprobs": torch.zeros(n, width),
        "advantages": torch.randn(n, generator=g),
    }


@torch.no_grad()
def digest(t: TorchTrainBackend) -> list[float]:
    """A float64 sum per parameter shard and optimizer tensor (a byte-exact round trip keeps every one)."""
    tensors = [fsdp.local(p) for p in t.model.parameters()]
    tensors += [fsdp.local(v) for st in t.optimizer.state.values() for v in st.values()]
    return [float(x.double().sum()) for x in tensors]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.5B", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--rollout-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    harness.add_smoke(ap)
    a = ap.parse_args()
    if a.smoke:
        a.size, a.device = "smoke", "cpu"
    if a.size == "smoke":
        a.samples, a.prompt_len, a.response_len, a.micro_batch_tokens = 8, 16, 64, 256
        a.rollout_prompts, a.new_tokens = 8, 8
    dev = a.device
    if dev == "cuda":  # deterministic kernels: the plain trainer's step must equal the offloaded one's
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    vocab = SHAPES[a.size]["vocab_size"]
    batches = [batch(vocab, a.samples, a.prompt_len, a.response_len, seed) for seed in (1, 2)]
    train = TrainConfig(
        device=dev,
        precision="bf16" if dev == "cuda" else "fp32",
        lr=1e-5,
        micro_batch_tokens=a.micro_batch_tokens,
        activation_checkpointing="full",
        threads=4,
    )
    report: dict = harness.report_header(__spec__.name, None) | {
        "size": a.size,
        "samples": a.samples,
        "tokens_per_step": int(sum(b["attention_mask"].sum() for b in batches) / 2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        harness.say(f"building a random {a.size} model")
        path = str(build_model(a.size, Path(tmp) / "model", dev))
        rollout = TorchRolloutBackend(
            path,
            device=dev,
            dtype=torch.bfloat16 if dev == "cuda" else torch.float32,
            batch_size=a.rollout_prompts,
            context_len=a.prompt_len + a.new_tokens + 8,
        )
        rollout.release_memory_occupation()  # the colocated starting point: the trainer runs first
        trainer = TorchTrainBackend(path, train, AlgorithmConfig())
        gc.collect()  # the model build_model made
        report["trainer_loaded"] = memory(dev)
        harness.say("step 1")
        first = trainer.train_step(batches[0])
        before = digest(trainer)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.rollout_prompts)]
        cycles = []  # the first pins the host buffers, the second reuses them
        for cycle in range(2):
            mem = {"after_train": memory(dev)}  # without offload, this is what the rollout engine would get
            moves = {"offload_optimizer": trainer.offload(keep_weights=True)}
            mem["after_offload_optimizer"] = memory(dev)
            t0 = time.perf_counter()
            rollout.update_weights(trainer.named_tensors(), cycle + 1)  # the sync: the engine allocates its weights
            sync_s = time.perf_counter() - t0
            mem["after_sync"] = memory(dev)
            moves["offload_weights"] = trainer.offload()
            mem["after_offload_weights"] = memory(dev)
            harness.say(f"rollout {cycle}")
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            gens = rollout.generate(prompts, SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True), seed=0)
            rollout_s = time.perf_counter() - t0
            mem["rollout_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 1024**3 if dev == "cuda" else None
            mem["after_rollout"] = memory(dev)
            rollout.release_memory_occupation()
            mem["after_rollout_release"] = memory(dev)
            moves["onload"] = trainer.onload()
            mem["after_onload"] = memory(dev)
            for m in moves.values():
                m["gb_per_s"] = m["bytes"] / 1e9 / m["seconds"] if m["seconds"] else None
            cycles.append(
                {
                    "memory": mem,
                    "moves": moves,
                    "sync_s": sync_s,
                    "rollout_s": rollout_s,
                    "rollout_tokens": sum(len(x.output_ids) for x in gens),
                }
            )
        exact = digest(trainer) == before
        harness.say("step 2")
        second = trainer.train_step(batches[1])
        del trainer
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        harness.say("the same two steps without offload")
        plain = TorchTrainBackend(path, train, AlgorithmConfig())
        plain_first, plain_second = plain.train_step(batches[0]), plain.train_step(batches[1])
    report |= {
        "cycles": cycles,
        "state_restored_bit_exact": exact,
        "step1": {
            "loss": [first["loss"], plain_first["loss"]],
            "grad_norm": [first["grad_norm"], plain_first["grad_norm"]],
        },
        "step2_after_onload_vs_plain": {
            "loss": [second["loss"], plain_second["loss"]],
            "grad_norm": [second["grad_norm"], plain_second["grad_norm"]],
        },
    }
    same = all(x[0] == x[1] for x in report["step2_after_onload_vs_plain"].values())
    close = (
        abs(second["loss"] - plain_second["loss"]) <= 1e-5 * max(abs(plain_second["loss"]), 1.0)
        and abs(second["grad_norm"] - plain_second["grad_norm"]) <= 1e-4 * plain_second["grad_norm"]
    )
    report["step2_equal"], report["ok"] = same, exact and close
    print(json.dumps(report, indent=1))
    if a.out:
        harness.write_json(a.out, report)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
