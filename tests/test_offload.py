"""The colocated trainer's offload seam (engines/train/offload.py, TorchTrainBackend.offload/onload): its state
leaves (storages freed) and comes back byte for byte, so the steps after a round trip are the steps without one.
On CPU the parked bytes go to a host buffer and the originals are freed, the same path a GPU run takes."""

from __future__ import annotations

import pytest
import torch

from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.train import fsdp
from rlflow.engines.train.offload import HostParking
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.test_engines import _toy_batch

TRAIN = TrainConfig(threads=1, lr=1e-3, micro_batch_size=5)
KL = AlgorithmConfig(kl_coef=0.1)  # a reference model, parked with the policy


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    return _toy_batch(tiny_model_dir, n=12)


def _weights(t: TorchTrainBackend) -> list[torch.Tensor]:
    return [fsdp.local(p) for lm in (t.lm, t.ref_lm) for p in lm.parameters()]


def _optimizer_state(t: TorchTrainBackend) -> list[torch.Tensor]:
    return [fsdp.local(v) for st in t.optimizer.state.values() for v in st.values()]


def _snapshot(t: TorchTrainBackend) -> list[torch.Tensor]:
    return [x.detach().clone() for x in _weights(t) + _optimizer_state(t)]


def test_host_parking_moves_each_storage_once_and_refuses_a_second_trip():
    base = torch.arange(12, dtype=torch.float32)
    view, other = base[4:8], torch.ones(3)
    parking = HostParking()
    assert parking.park([base, view, other], "cpu") == 12 * 4 + 3 * 4  # the view shares base's storage
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="already parked"):
        parking.park([other], "cpu")
    assert parking.unpark() == 60
    assert torch.equal(base, torch.arange(12, dtype=torch.float32)) and torch.equal(view, base[4:8])
    assert torch.equal(other, torch.ones(3)) and not parking.parked
    assert parking.park([base], "cuda") == 0  # nothing of it on that device: nothing moves


def test_offload_round_trip_restores_state_and_the_next_steps(tiny_model_dir, batch):
    """One rank, policy and reference model: offload in the session's two phases (optimizer state while the
    weights are still read by the sync, then the weights), memory freed, refused use while parked, then onload;
    the state is bit-identical and the next two steps equal a trainer that never offloaded."""
    parked, plain = (TorchTrainBackend(tiny_model_dir, TRAIN, KL) for _ in range(2))
    for t in (parked, plain):
        t.train_step(batch)  # Adam state and gradients exist
    before = _snapshot(parked)
    for _cycle in range(2):  # the host buffer is reused on the second trip
        optimizer_bytes = sum(x.untyped_storage().nbytes() for x in _optimizer_state(parked))
        assert parked.offload(keep_weights=True)["bytes"] == optimizer_bytes > 0
        assert all(x.untyped_storage().nbytes() == 0 for x in _optimizer_state(parked))
        assert all(p.grad is None for p in parked.model.parameters())  # the last step's: the next one zeroes them
        assert dict(parked.named_tensors()).keys()  # the sync still reads the weights
        with pytest.raises(RuntimeError, match="train_step while its state is offloaded"):
            parked.train_step(batch)
        assert parked.offload()["bytes"] > 0
        assert all(w.untyped_storage().nbytes() == 0 for w in _weights(parked))
        with pytest.raises(RuntimeError, match="forward_logprobs while its state is offloaded"):
            parked.forward_logprobs(batch)
        assert parked.offload() == pytest.approx({"bytes": 0.0, "seconds": 0.0}, abs=0.1)  # idempotent
        parked.onload()
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(parked), strict=True))
    for _ in range(2):
        m1, m2 = parked.train_step(batch), plain.train_step(batch)
        for k in ("loss", "grad_norm", "kl"):
            assert m1[k] == m2[k], k
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(parked), _snapshot(plain), strict=True))


def _loop(session: RLSession, steps: int, check=None) -> list[dict]:
    history = []
    for step in range(steps):
        m = {}
        for stage in ("rollout", "reward", "advantages", "train", "sync_weights"):
            m |= getattr(session, stage)(step)
            if check:
                check(stage)
        m |= session.evaluate(step)[0]
        history.append(m)
    return history


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_colocated_loop_parks_the_trainer_while_the_rollout_engine_runs(recipe, tmp_path, correction):
    """The RL loop with cluster.colocate (forced on CPU, where the recipe check refuses it, so the same session
    code runs here): the trainer is parked from the sync until it is needed (the train stage, or advantages
    when rollout correction needs its logprobs) and resident while it runs, the rollout engine released while
    the trainer runs, a checkpoint onloads; every metric of the run equals the run without colocation, and
    the moves are timed."""
    cfg = recipe(
        train={"steps": 2, "threads": 1},
        rollout={"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 4},
        eval={"max_prompts": 4},
        algorithm={"is_correction": correction},
    )
    needs_trainer = ("advantages", "train") if correction != "none" else ("train",)
    colocated = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"colocate": True})})
    assert colocated.offloads_trainer and not cfg.offloads_trainer
    prepare_data(cfg)
    model = prepare_model(cfg, tmp_path)
    plain = RLSession.create(cfg, model, use_ray=False)
    try:
        want = _loop(plain, 2)
    finally:
        plain.shutdown()

    session = RLSession.create(colocated, model, use_ray=False)
    trainer, engine = session.train_group.workers[0], session.rollout_group.workers[0]

    def check(stage: str) -> None:
        parked = trainer._parked_weights.parked
        assert trainer._parked_optimizer.parked == (parked and bool(trainer.optimizer.state)), stage
        trainer_turn = stage in needs_trainer
        assert parked != trainer_turn and engine._released == trainer_turn, stage

    try:
        got = _loop(session, 2, check)
        session.save(tmp_path / "ckpt", 1)
        assert not trainer._parked_weights.parked  # written from the GPU; the next rollout parks it again
        session.rollout(2)
        assert trainer._parked_weights.parked
    finally:
        session.shutdown()
    for g, w in zip(got, want, strict=True):
        moves = {k: g.pop(k) for k in list(g) if k.startswith(("time/offload", "time/onload", "offload/", "onload/"))}
        assert moves["time/offload"] > 0 and moves["offload/gb"] > 0 and moves["time/onload"] > 0
        assert g.keys() == w.keys()
        for k in w:
            if not k.endswith(("tokens_per_s", "worker", "gb_per_s")):  # rates and wall times
                assert g[k] == w[k], k


@pytest.fixture
def allocator_settings(monkeypatch):
    """The process's allocator settings, as a GPU machine would have them, put back afterwards; CUDA reported
    available, so fsdp._cap_pinned_rounding does its work (on a CPU build the settings are parsed all the same)."""
    get, put = torch._C._accelerator_getAllocatorSettings, torch._C._accelerator_setAllocatorSettings
    saved = get()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    put("max_split_size_mb:128,garbage_collection_threshold:0.6")
    yield get, put
    put(saved)


def test_capping_pinned_rounding_keeps_the_other_allocator_settings(allocator_settings):
    """torch re-reads the whole settings string and resets the options it lacks, so the cap is added to them."""
    get, _ = allocator_settings
    assert fsdp._cap_pinned_rounding.__wrapped__() is True
    assert get().split(",") == ["max_split_size_mb:128", "garbage_collection_threshold:0.6",
                                f"{fsdp.PIN_ROUNDING_KEY}:{fsdp.PIN_ROUNDING_LIMIT_MB}"]


def test_a_torch_without_the_cap_offloads_to_pageable_memory_with_its_settings_restored(allocator_settings,
                                                                                        monkeypatch):
    """torch 2.11 refuses the key after resetting the other options (probed on the GPU machine): the previous
    settings are put back, and the shards are not pinned."""
    get, put = allocator_settings

    def put_without_the_key(settings: str) -> None:
        put("")  # what 2.11 does before it reads the keys
        if fsdp.PIN_ROUNDING_KEY in settings:
            raise ValueError(f"Unrecognized key '{fsdp.PIN_ROUNDING_KEY}' in Accelerator allocator config.")
        put(settings)

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", put_without_the_key)
    assert fsdp._cap_pinned_rounding.__wrapped__() is False
    assert get() == "max_split_size_mb:128,garbage_collection_threshold:0.6"
