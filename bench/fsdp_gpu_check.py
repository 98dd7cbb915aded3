"""GPU check of the FSDP2 train backend's one-rank path: a train step in bf16, a sharded checkpoint written and
loaded into a fresh backend (same next step), and the HF export loaded by transformers. CPU CI covers the
multi-rank logic over gloo; this covers what only a GPU runs (the cuda:nccl,cpu:gloo group, fused AdamW,
varlen attention, DCP on CUDA tensors).

    python -m bench.fsdp_gpu_check
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

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
    report = {
        "gpu": torch.cuda.get_device_name(), "backend": torch.distributed.get_backend(),
        "first_loss": first["loss"], "next_loss": [ma["loss"], mb["loss"]],
        "next_grad_norm": [ma["grad_norm"], mb["grad_norm"]],
        "export_matches_names": sorted(exported) == sorted(weights), "params_on_gpu": on_gpu,
        "ok": on_gpu and abs(ma["loss"] - mb["loss"]) <= 1e-6
        and abs(ma["grad_norm"] - mb["grad_norm"]) <= 1e-4 * ma["grad_norm"],
    }
    print(json.dumps(report, indent=1))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
