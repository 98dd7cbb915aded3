"""A checkpoint's RNG state: JSON only, CPU and CUDA generators restored, a damaged one named in the error."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from rlflow.engines.train.rng import restore_rng, rng_state, set_rng_state


def _draws(device: str = "cpu") -> list:
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.rand(3, device=device).tolist()]


def test_cpu_generators_continue_where_the_saved_state_was():
    torch.manual_seed(1)
    saved = json.loads(json.dumps(rng_state()))  # what a checkpoint stores and reads back
    first = _draws()
    set_rng_state(saved)
    assert _draws() == first


class _FakeCuda:
    """torch.cuda as a process that drives a GPU sees it: initialised, with a generator state of its own."""

    def __init__(self, monkeypatch, initialised: bool = True):
        self.state = torch.arange(16, dtype=torch.uint8)
        self.restored: list[torch.Tensor] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.state.clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": self.restored.append(s))


def test_cuda_generator_is_saved_and_restored_with_the_cpu_ones(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    saved = json.loads(json.dumps(rng_state()))
    assert saved["cuda"] == list(range(16))
    set_rng_state(saved)
    assert len(cuda.restored) == 1 and torch.equal(cuda.restored[0], cuda.state)


def test_no_cuda_state_without_a_cuda_context(monkeypatch):
    """A CPU run never starts CUDA to save its state; a GPU checkpoint resumed without CUDA skips it."""
    cuda = _FakeCuda(monkeypatch, initialised=False)
    assert "cuda" not in rng_state()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    set_rng_state(rng_state() | {"cuda": list(range(16))})
    assert cuda.restored == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_continue_where_the_saved_state_was():
    torch.cuda.manual_seed(3)
    torch.rand(1, device="cuda")  # CUDA initialised, as in a GPU train worker
    saved = json.loads(json.dumps(rng_state()))
    first = _draws("cuda")
    set_rng_state(saved)
    assert _draws("cuda") == first


def test_a_damaged_rng_state_names_the_checkpoint_file():
    state = {"rng": rng_state() | {"torch": [1, 2, 3]}}
    with pytest.raises(ValueError, match=r"checkpoint ck/7/trainer_rank0.json: field 'rng'"):
        restore_rng(state, "ck/7/trainer_rank0.json")
    with pytest.raises(ValueError, match=r"trainer_rank1.json: field 'rng'"):
        restore_rng({}, "ck/7/trainer_rank1.json")


def test_megatron_tracker_streams_round_trip_as_json():
    """Megatron's named CUDA RNG streams (dropout in tensor-parallel regions) are saved beside the generators."""
    pytest.importorskip("megatron.core")
    from megatron.core import tensor_parallel

    from rlflow.engines.train.megatron.checkpoint import set_tracker_rng_state, tracker_rng_state

    tracker = tensor_parallel.get_cuda_rng_tracker()
    streams = {"model-parallel-rng": torch.arange(16, dtype=torch.uint8),
               "expert-parallel-rng": torch.ones(16, dtype=torch.uint8)}
    try:
        tracker.set_states(dict(streams))
        saved = json.loads(json.dumps(tracker_rng_state()))
        tracker.reset()
        set_tracker_rng_state(saved)
        assert {k: v.tolist() for k, v in tracker.get_states().items()} == {k: v.tolist() for k, v in streams.items()}
    finally:
        tracker.reset()
