"""MoE weights between the torch trainer and the embedded engine: transformers 5 stacks a layer's experts in two
parameters, while weight syncs name each expert as checkpoints do (engines/models/moe.py)."""

from __future__ import annotations

import httpx
import torch
from safetensors.torch import load_file

import rlflow.engines.train.torch_backend as torch_backend
from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
from rlflow.engines.models.moe import checkpoint_named
from rlflow.engines.rollout.http_api import serialize_named_tensors
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.sync.base import plan_buckets
from tests.megatron_helpers import toy_batch


def test_a_bucketed_sync_gathers_each_stacked_parameter_once_and_sends_owned_tensors(tiny_moe_dir, monkeypatch):
    """Buckets cut across a stacked parameter's experts: it is still gathered once per sync (kept between
    calls), every expert arrives as its own tensor (a view would carry the whole stack when pickled), and after
    a step the next sync gathers the new weights."""
    trainer = torch_backend.TorchTrainBackend(tiny_moe_dir, TrainConfig(threads=1, mini_batches=1), AlgorithmConfig())
    gathered: list[str] = []
    real_gather = torch_backend.fsdp.gather
    monkeypatch.setattr(torch_backend.fsdp, "gather",
                        lambda params, names, *a, **k: gathered.extend(names) or real_gather(params, names, *a, **k))
    checkpoint = load_file(f"{tiny_moe_dir}/model.safetensors")
    buckets = list(plan_buckets(trainer.weight_layout(), 4096))
    bucket_of = {n: i for i, b in enumerate(buckets) for n in b}
    assert bucket_of["model.layers.0.mlp.experts.0.gate_proj.weight"] != \
        bucket_of["model.layers.0.mlp.experts.3.gate_proj.weight"]  # one stacked parameter over several buckets
    sent = {n: t for b in buckets for n, t in trainer.named_tensors(b)}
    assert sent.keys() == checkpoint.keys() and all(torch.equal(sent[n], t) for n, t in checkpoint.items())
    assert sorted(gathered) == sorted(dict(trainer.model.named_parameters()))  # each module parameter once
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in sent.values())

    trainer.train_step(toy_batch(vocab=96))
    after = {n: t for b in buckets for n, t in trainer.named_tensors(b)}
    now = checkpoint_named({n: p.detach().full_tensor() for n, p in trainer.model.named_parameters()}, "qwen3_moe")
    assert all(torch.equal(after[n], now[n]) for n in after)
    assert not torch.equal(after["model.layers.0.mlp.experts.1.up_proj.weight"],
                           sent["model.layers.0.mlp.experts.1.up_proj.weight"])


def test_the_embedded_server_takes_experts_by_their_checkpoint_names(tiny_moe_dir):
    """/update_weights_from_tensor with per-expert names (what the Megatron backend and the torch backend send)
    writes the engine's stacked expert tensors; a name that is neither is refused, naming it."""
    engine = TorchRolloutBackend(tiny_moe_dir, threads=1, batch_size=4)
    try:
        engine.start_server()
        name = "model.layers.1.mlp.experts.2.down_proj.weight"
        new = torch.randn(32, 16)
        with httpx.Client(base_url=engine.server_url(), timeout=60) as http:
            r = http.post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [serialize_named_tensors([(name, new)])], "load_format": "safetensors"})
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            assert torch.equal(dict(engine.model.named_parameters())["model.layers.1.mlp.experts.down_proj"][2], new)
            assert torch.equal(dict(engine.named_tensors([name]))[name], new)
            bad = "model.layers.1.mlp.experts.9.down_proj.weight"
            r = http.post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [serialize_named_tensors([(bad, new)])], "load_format": "safetensors"})
            assert r.status_code == 400 and bad in r.text
    finally:
        engine.close()
