"""Weight-sync transports: the store fallback and the in-memory path give the rollout workers the same bits."""

from __future__ import annotations

import pytest
import torch

from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.store.run_store import RunStore


def _rollout_weights_after(cfg, tmp_path, steps: int) -> dict[str, torch.Tensor]:
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path / cfg.name), use_ray=False)
    try:
        for step in range(steps):
            for stage in ("rollout", "reward", "advantages", "train", "sync_weights"):
                getattr(session, stage)(step)
        return dict(session.rollout_group.call_rank0(TorchRolloutBackend.named_tensors))
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



def test_flat_weights_copy_as_one_slice():
    """GPU transports lay weights out flat (flatten_) so a whole run of them is one slice (flat_span); the
    copy through that slice must give the same weights as the per-tensor path. Checked here on CPU tensors;
    the CUDA IPC and NCCL paths that use it run on the device machine (bench/gpu_rl.py)."""
    from rlflow.engines.sync.cuda_ipc import copy_plan
    from rlflow.engines.sync.gpu import flat_span, flatten_

    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}
    src = {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in shapes.items()}
    values = {n: p.detach().clone() for n, p in src.items()}
    flat = flatten_(src)
    assert flat.numel() == 12 + 5 + 8
    for n, p in src.items():  # same Parameter objects, same values, now views of one buffer
        assert torch.equal(p, values[n]) and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    span = flat_span([src["b"], src["c"]])
    assert span is not None and torch.equal(span, torch.cat([values["b"], values["c"].flatten()]))
    assert flat_span([src["c"], src["b"]]) is None, "out of order is not one slice"
    assert flat_span([src["a"], src["c"]]) is None, "a gap is not one slice"

    dst = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    flatten_(dst)
    per_tensor = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    copy_plan(dst, list(src.items()))()  # flat -> flat: one cast copy
    copy_plan(per_tensor, list(src.items()))()  # separate tensors: the foreach path
    for n in shapes:
        assert torch.equal(dst[n], values[n].to(torch.bfloat16)) and torch.equal(dst[n], per_tensor[n])

    released = flatten_(dst, shapes={n: torch.Size(s) for n, s in shapes.items()})  # re-allocation
    assert released.numel() == flat.numel() and flat_span(list(dst.values())) is not None
