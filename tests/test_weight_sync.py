"""Weight-sync transports: the store fallback and the in-memory path give the rollout workers the same bits."""

from __future__ import annotations

import pytest
import torch

from engines.rl import RLSession, prepare_data, prepare_model
from tasks.run_store import RunStore


def _rollout_weights_after(cfg, tmp_path, steps: int) -> dict[str, torch.Tensor]:
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path / cfg.name), use_ray=False)
    try:
        for step in range(steps):
            for stage in ("rollout", "reward", "advantages", "train", "sync_weights"):
                getattr(session, stage)(step)
        return dict(session.rollout_group.call_rank0("named_tensors"))
    finally:
        session.shutdown()


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_store_transport_matches_in_memory(backend, recipe, tmp_path):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    train = {"backend": backend, "steps": 2, "threads": 1}
    # 16 KiB buckets: the tiny model's weights travel in several
    in_memory = _rollout_weights_after(recipe(name="mem", train=train, weight_sync={"bucket_mb": 1 / 64}), tmp_path, 2)
    cfg = recipe(name="store", train=train, weight_sync={"transport": "store", "bucket_mb": 1 / 64})
    via_store = _rollout_weights_after(cfg, tmp_path, 2)
    assert in_memory.keys() == via_store.keys()
    for name in in_memory:
        assert torch.equal(in_memory[name], via_store[name]), name
    assert not RunStore(cfg.storage, cfg.name).exists("weights", "v00000002"), "a delivered version is removed"

