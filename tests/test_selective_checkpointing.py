"""train.activation_checkpointing "selective" (engines/models/checkpointing.py): the same numbers as "off" and "full",
with the attention kernel run once per layer (its outputs kept) where "full" runs it again in the backward.
Context parallelism with "selective": tests/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode

from rlflow.engines.core.config import AlgorithmConfig, RLConfig, TrainConfig
from rlflow.engines.models.checkpointing import ATTENTION_OPS, attention_policy
from rlflow.engines.models.hf import load_model
from rlflow.engines.models.packed import PackedLM, PackedRows
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.test_engines import _toy_batch

MODES = ("off", "full", "selective")
CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # packed.py's SDPA on the CPU, fp32


class CountAttention(TorchDispatchMode):
    """Counts the attention kernel's runs (an op the selective checkpoint returns from its cache never gets here)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket is CPU_ATTENTION
        return func(*args, **(kwargs or {}))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in model.named_parameters()}


def _packed_run(model_dir: str, mode: str) -> tuple[torch.Tensor, torch.Tensor, dict, int, int]:
    """One train-mode forward and backward of PackedLM on a packed micro-batch of 4 samples: (log-probs, loss,
    gradients, attention runs, layers)."""
    model = load_model(model_dir)
    lm = PackedLM(model, chunk_tokens=8, checkpoint_layers=mode).train()
    g = torch.Generator().manual_seed(0)
    lengths = [7, 12, 3, 9]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = torch.randint(3, model.config.vocab_size, (n,), generator=g), 1
    packed = PackedRows.from_padded(ids, mask)
    weights = torch.randn(packed.input_ids.shape, generator=g)
    with CountAttention() as count:
        lp, ent = lm(packed, 0.7, with_entropy=True)
        loss = (lp * weights).sum() + 0.1 * ent.sum()
        loss.backward()
    return lp.detach(), loss.detach(), _grads(model), count.calls, model.config.num_hidden_layers


def test_attention_policy_keeps_the_attention_kernels_only():
    assert CPU_ATTENTION in ATTENTION_OPS
    assert attention_policy(None, CPU_ATTENTION.default).name == "MUST_SAVE"
    assert attention_policy(None, torch.ops.aten.mm.default).name == "PREFER_RECOMPUTE"
    varlen = getattr(torch.ops.torch_attn, "_varlen_attn", None)
    if varlen is not None:  # packed.py's CUDA attention (torch >= 2.9)
        assert attention_policy(None, varlen.default).name == "MUST_SAVE"


def test_selective_runs_attention_once_and_equals_off_and_full(tiny_model_dir):
    """fp32: log-probs, loss and every parameter's gradient equal within 1e-6 across the modes; the attention kernel
    runs once per layer with "off" and "selective" (kept for the backward) and twice with "full" (recomputed)."""
    runs = {mode: _packed_run(tiny_model_dir, mode) for mode in MODES}
    lp, loss, grads, _, layers = runs["off"]
    assert layers > 1 and loss.abs() > 0
    for mode in ("full", "selective"):
        assert (runs[mode][0] - lp).abs().max() <= 1e-6, mode
        assert (runs[mode][1] - loss).abs() <= 1e-6, mode
        assert runs[mode][2].keys() == grads.keys()
        for name, g in grads.items():
            assert (runs[mode][2][name] - g).abs().max() <= 1e-6, (mode, name)
    assert all(g.abs().max() > 0 for n, g in grads.items() if "layers" in n and "proj" in n)
    assert {mode: run[3] for mode, run in runs.items()} == {"off": layers, "full": 2 * layers, "selective": layers}


def test_selective_train_step_equals_off_and_recomputes_no_attention(tiny_model_dir):
    """TorchTrainBackend over several micro-batches: loss, gradient norm and gradients of "selective" and "full"
    equal "off"'s within 1e-6; "full" runs the attention kernel once more per layer and micro-batch, "selective"
    never."""
    batch = _toy_batch(tiny_model_dir, n=8)
    results = {}
    for mode in MODES:
        backend = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1, micro_batch_size=3,
                                                                activation_checkpointing=mode), AlgorithmConfig())
        micro = len(backend.micro_batches(batch))
        with CountAttention() as count:
            metrics = backend.train_step(batch)
        results[mode] = metrics, _grads(backend.model), count.calls
    layers = backend.model.config.num_hidden_layers
    metrics, grads, calls = results["off"]
    assert micro > 1 and calls == layers * micro
    for mode in ("full", "selective"):
        assert abs(results[mode][0]["loss"] - metrics["loss"]) <= 1e-6, mode
        assert abs(results[mode][0]["grad_norm"] - metrics["grad_norm"]) <= 1e-6, mode
        for name, g in grads.items():
            assert (results[mode][1][name] - g).abs().max() <= 1e-6, (mode, name)
    assert results["selective"][2] == calls
    assert results["full"][2] == calls + layers * micro


def test_activation_checkpointing_takes_the_old_booleans_and_refuses_other_values():
    assert TrainConfig().activation_checkpointing == "off"
    assert TrainConfig(activation_checkpointing=True).activation_checkpointing == "full"
    assert TrainConfig(activation_checkpointing=False).activation_checkpointing == "off"
    assert TrainConfig(activation_checkpointing="selective").activation_checkpointing == "selective"
    data = {"data": {"train_path": "x.jsonl"}}
    assert RLConfig.model_validate(data | {"train": {"activation_checkpointing": True}}).train \
        .activation_checkpointing == "full"
    with pytest.raises(ValidationError, match=r"train\.activation_checkpointing\n.*'off', 'full' or 'selective'"):
        RLConfig.model_validate(data | {"train": {"activation_checkpointing": "attention"}})
