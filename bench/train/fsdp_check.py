"""GPU check of the FSDP2 train backend's one-rank path: a train step in bf16, a sharded checkpoint written and
loaded into a fresh backend (same next step), and the HF export loaded by transformers. CPU CI covers the
multi-rank logic over gloo; this covers what only a GPU runs (the cuda:nccl,cpu:gloo group, fused AdamW,
varlen attention, DCP on CUDA tensors), and train.compile's and liger's kernels against HF's modules.

    python -m bench.train.fsdp_check
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from bench import harness
from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
from rlflow.engines.train.torch_backend import TorchTrainBackend


def main() -> None:
    cfg = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)
    n, width = 16, 256
    lengths = torch.randint(64, width + 1, (n,), generator=g)
    cols = torch.arange(width)[None]
    attn = (cols < lengths[:, None]).long()
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (n, width), generator=g) * attn,
             "attention_mask": attn, "loss_mask": ((cols >= 32) & attn.bool()).float(),
             "old_logprobs": torch.zeros(n, width), "advantages": torch.randn(n, generator=g)}
    train = TrainConfig(device="cuda", precision="bf16", micro_batch_tokens=1024, lr=1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(Path(tmp) / "base")
        a = TorchTrainBackend(str(Path(tmp) / "base"), train, AlgorithmConfig())
        first = a.train_step(batch)
        a.save(Path(tmp) / "ckpt")
        b = TorchTrainBackend(str(Path(tmp) / "base"), train, AlgorithmConfig())
        b.load(Path(tmp) / "ckpt")
        ma, mb = a.train_step(batch), b.train_step(batch)
        hf = AutoModelForCausalLM.from_pretrained(Path(tmp) / "ckpt" / "model")
        exported = dict(hf.named_parameters())
        weights = dict(b.named_tensors())
        on_gpu = all(p.device.type == "cuda" for p in b.model.parameters())  # fully_shard moved them
        base = str(Path(tmp) / "base")
        kernels = {"compile": agreement(base, train, batch, {"compile": True})}
        if liger_installed():  # after the rest: its rotary patch stays for the process
            kernels["liger"] = agreement(base, train, batch, {"kernels": "liger"})
    report = harness.report_header(__spec__.name, None) | {
        "backend": torch.distributed.get_backend(),
        "first_loss": first["loss"], "next_loss": [ma["loss"], mb["loss"]],
        "next_grad_norm": [ma["grad_norm"], mb["grad_norm"]],
        "export_matches_names": sorted(exported) == sorted(weights), "params_on_gpu": on_gpu,
        "kernels": kernels,
        "ok": on_gpu and abs(ma["loss"] - mb["loss"]) <= 1e-6
        and abs(ma["grad_norm"] - mb["grad_norm"]) <= 1e-4 * ma["grad_norm"] and all(k["ok"] for k in kernels.values()),
    }
    print(json.dumps(report, indent=1))
    sys.exit(0 if report["ok"] else 1)


def agreement(base: str, train: TrainConfig, batch: dict, options: dict) -> dict:
    """The backend with `options` (train.compile, train.kernels liger) against the same backend without them, on
    the same weights and batch, in bf16: the logprobs and the first step's loss and gradient norm. The plain side
    runs first: liger's rotary patch is process-wide once applied."""
    mask = batch["loss_mask"].bool()
    results = []
    for update in ({}, options):
        backend = TorchTrainBackend(base, train.model_copy(update=update), AlgorithmConfig())
        logprobs = backend.forward_logprobs(batch)[mask].float().cpu()
        results.append((logprobs, backend.train_step(batch)))
    (ref, step_ref), (ours, step) = results
    diff = (ours - ref).abs()
    report = {"max_abs_logprob_diff": float(diff.max()), "mean_abs_logprob_diff": float(diff.mean()),
              "loss": [step_ref["loss"], step["loss"]], "grad_norm": [step_ref["grad_norm"], step["grad_norm"]]}
    # bf16: fused kernels round differently from HF's chain of ops; a wrong kernel is off by far more
    report["ok"] = report["mean_abs_logprob_diff"] < 2e-2 and abs(step["grad_norm"] / step_ref["grad_norm"] - 1) < 0.05
    return report


def liger_installed() -> bool:
    try:
        import liger_kernel  # noqa: F401  (only asks whether the extra is installed)
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
