"""The `delta` weight transport (engines/sync/delta.py) between a real trainer taking real AdamW steps and two
embedded rollout workers (bf16, so versions are diffed in bf16), through a local store and S3 (moto): weights
arrive bit for bit, a corrupt object or a missed version falls back to a snapshot and the metrics say so, a
version without its manifest does not exist, a restarted sender starts with a snapshot, and old versions go."""

from __future__ import annotations

import pytest
import torch

from rlflow.engines.cluster.groups import LocalWorkerGroup
from rlflow.engines.core.batch import pack_samples
from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
from rlflow.engines.core.protocols import TrainBackend
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync import delta_format
from rlflow.engines.sync.base import WeightSource
from rlflow.engines.sync.delta import DeltaTransport
from rlflow.engines.sync.delta_format import DeltaFollower, DeltaPublisher, committed, stored_versions
from rlflow.engines.train.torch_backend import TorchTrainBackend

PROMPTS = [[1, 5, 6, 7, 15], [1, 9, 15], [1, 4, 4, 8, 9, 10, 15]]


class Rig:
    """A trainer, two bf16 rollout workers and the delta transport between them, as a session wires them."""

    def __init__(self, recipe, storage, model_dir: str, full_every: int = 10):
        cfg = recipe(name="delta", weight_sync={"transport": "delta", "bucket_mb": 1 / 64,
                                                 "delta": {"full_every": full_every}})
        self.cfg = cfg.model_copy(update={"storage": storage})
        self.store = RunStore(storage, "delta")
        self.trainer = TorchTrainBackend(model_dir, TrainConfig(threads=1, lr=1e-4), AlgorithmConfig())
        self.workers = [TorchRolloutBackend(model_dir, threads=1, dtype=torch.bfloat16) for _ in range(2)]
        gens = self.workers[0].generate(PROMPTS * 4, SamplingParams(max_new_tokens=6), seed=5)
        self.batch = pack_samples([g.prompt_ids for g in gens], [g.output_ids for g in gens],
                                  [g.output_logprobs for g in gens], torch.linspace(-1.5, 1.5, len(gens)),
                                  self.workers[0].tokenizer.pad_token_id)
        self.source = WeightSource(LocalWorkerGroup([self.trainer]), int(1024 * 1024 / 64))
        self.transport = self.new_transport()

    def new_transport(self, workers=None) -> DeltaTransport:
        return DeltaTransport(self.cfg, self.source, LocalWorkerGroup(self.workers if workers is None else workers))

    def step_and_sync(self, version: int, transport: DeltaTransport | None = None) -> dict[str, float]:
        self.trainer.train_step(self.batch)  # a real AdamW step
        (transport or self.transport).update(version)
        return (transport or self.transport).take_metrics()

    def assert_exact(self, workers=None) -> None:
        trained = dict(self.trainer.named_tensors(dtype=torch.bfloat16))
        for w in self.workers if workers is None else workers:
            served = dict(w.named_tensors())
            assert served.keys() == trained.keys()
            for name, t in trained.items():
                assert torch.equal(served[name], t), name

    def close(self) -> None:
        for w in self.workers:
            w.close()


@pytest.fixture
def rig(recipe, storage, tiny_model_dir):
    made: list[Rig] = []

    def make(**kwargs) -> Rig:
        made.append(Rig(recipe, storage, tiny_model_dir, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_versions_arrive_exactly_snapshots_come_every_full_every_and_old_versions_go(rig):
    r = rig(full_every=3)
    start = dict(r.workers[0].named_tensors())
    kinds = []
    for version in range(1, 6):
        metrics = r.step_and_sync(version)
        r.assert_exact()
        kinds.append(metrics["sync/delta_full"])
        assert metrics["sync/delta_full_fetches"] == 0
        if version in (2, 3):  # deltas: a fraction of the bf16 bytes
            assert 0 < metrics["sync/delta_ratio"] < 0.9 and metrics["sync/delta_bytes"] > 0
    assert kinds == [1, 0, 0, 1, 0]  # the first version, then every 3rd after the last snapshot
    assert stored_versions(r.store) == [4, 5], "a snapshot prunes every older version"
    assert committed(r.store) == {4: {"full"}, 5: {"delta"}}
    assert any(not torch.equal(start[n], t) for n, t in r.workers[0].named_tensors()), "the weights did move"


def test_a_corrupt_object_fails_its_checksum_and_a_snapshot_of_that_version_is_fetched(rig, monkeypatch):
    r = rig()
    for version in (1, 2):
        r.step_and_sync(version)
    worker = r.workers[0]
    follow = worker.update_weights_from_delta

    def corrupt_then_follow(storage, run, version):
        """Flip bytes in the middle of version 3's first stored delta object, as a bad disk or a partial copy."""
        manifest = r.store.read_json(*delta_format.version_folder(version), "delta.json")
        bucket = next(b for b in manifest["buckets"] if b["stored_bytes"] > 8)
        data = bytearray(r.store.read_bytes(*delta_format.version_folder(version), bucket["object"]))
        data[len(data) // 2] ^= 0xFF
        data[len(data) // 2 + 1] ^= 0x5A
        r.store.write_bytes(bytes(data), *delta_format.version_folder(version), bucket["object"])
        monkeypatch.setattr(worker, "update_weights_from_delta", follow)  # once
        return follow(storage, run, version)

    monkeypatch.setattr(worker, "update_weights_from_delta", corrupt_then_follow)
    metrics = r.step_and_sync(3)
    r.assert_exact()
    assert metrics["sync/delta_full"] == 0 and metrics["sync/delta_full_fetches"] >= 1
    assert committed(r.store)[3] == {"delta", "full"}, "the sender wrote a snapshot of version 3 from its copy"
    assert stored_versions(r.store) == [3]
    metrics = r.step_and_sync(4)  # and the next version is a delta again, over the snapshot's bytes
    r.assert_exact()
    assert metrics["sync/delta_full"] == 0 and metrics["sync/delta_full_fetches"] == 0


def test_a_receiver_that_missed_a_version_or_restarted_follows_from_the_snapshot(rig, tiny_model_dir):
    r = rig()
    for version in (1, 2):
        r.step_and_sync(version)
    behind = r.workers[1]
    r.transport.rollout = LocalWorkerGroup(r.workers[:1])  # worker 1 misses version 3
    r.step_and_sync(3)
    r.transport.rollout = LocalWorkerGroup(r.workers)
    metrics = r.step_and_sync(4)
    r.assert_exact()
    assert metrics["sync/delta_full"] == 0 and metrics["sync/delta_full_fetches"] == 1  # worker 1: v1 + v2..v4
    r.workers[1] = TorchRolloutBackend(tiny_model_dir, threads=1, dtype=torch.bfloat16)  # a restarted worker
    behind.close()
    r.transport.rollout = LocalWorkerGroup(r.workers)
    metrics = r.step_and_sync(5)
    r.assert_exact()
    assert metrics["sync/delta_full_fetches"] == 1


def test_a_version_without_its_manifest_does_not_exist_and_a_restarted_sender_starts_with_a_snapshot(
        rig, monkeypatch):
    r = rig()
    for version in (1, 2):
        r.step_and_sync(version)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the manifest")

    with monkeypatch.context() as m:
        m.setattr("rlflow.engines.sync.delta.write_manifest", killed)
        with pytest.raises(KeyboardInterrupt):
            r.step_and_sync(3)
    assert 3 in stored_versions(r.store) and 3 not in committed(r.store), "objects written, no manifest"
    fresh = DeltaFollower()
    with pytest.raises(FileNotFoundError, match="version 3 has no manifest"):
        fresh.follow(r.store, 3)
    assert fresh.follow(r.store, 2).applied  # a new receiver rebuilds the newest committed version

    # the sender's process dies: its copy of version 2 with it; a new driver and publisher go on
    r.trainer._delta = DeltaPublisher()
    metrics = r.step_and_sync(3, r.new_transport())
    r.assert_exact()
    assert metrics["sync/delta_full"] == 1 and metrics["sync/delta_full_fetches"] == 0
    assert committed(r.store) == {3: {"full"}} and stored_versions(r.store) == [3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_frames_rebuild_every_dtype_exactly_in_chunks_and_a_wrong_base_fails_the_checksum(dtype, tmp_path,
                                                                                           monkeypatch):
    """Tensors larger than a chunk are coded in several frames on the pool (CHUNK made small here): versions of
    bf16, fp32 and 1-byte tensors, an odd size and an empty one, rebuild bit for bit; a delta applied onto other
    bytes than its base is refused by the checksum."""
    monkeypatch.setattr(delta_format, "CHUNK", 96)
    store = RunStore(str(tmp_path / "store"), "codec")
    g = torch.Generator().manual_seed(0)

    def weights(step: int) -> list[tuple[str, torch.Tensor]]:
        a = torch.randn(37, 11, generator=g) if dtype != torch.uint8 else torch.randint(0, 255, (37, 11), generator=g)
        base = torch.zeros(37, 11) if step == 0 else a
        return [("a", base.to(dtype)), ("b", torch.full((5,), float(step)).to(dtype)),
                ("empty", torch.zeros(0, 3).to(dtype))]

    publisher, follower = DeltaPublisher(), DeltaFollower()
    for version in (1, 2, 3):
        sent = weights(version - 1)
        entry = publisher.put(store, version, 0, sent, None if version == 1 else version - 1, 3)
        assert len(entry["tensors"][0].get("lengths", [])) in (0, -(-37 * 11 * sent[0][1].element_size() // 96))
        delta_format.write_manifest(store, version, "full" if version == 1 else "delta", publisher.epoch,
                                    None if version == 1 else version - 1, str(dtype).removeprefix("torch."), [entry])
        assert follower.follow(store, version).applied
        got = dict(follower.tensors())
        for name, t in sent:
            assert torch.equal(got[name], t), (version, name)
    wrong = DeltaFollower()
    assert wrong.follow(store, 2).applied and wrong.at[1] == 2
    wrong.at = (publisher.epoch, 2)  # claims version 2 but holds version 2 of ...
    wrong.mirror["a"][2][:4] ^= 1  # ... other bytes: version 3's delta onto them cannot match
    result = wrong.follow(store, 3)
    assert result.problems and "checksum" in result.problems[0]


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_tiny_rl_run_syncs_by_delta(backend, recipe, tmp_path):
    """RL steps of a session (no Ray) with weight_sync.transport delta: the rollout worker serves the trainer's
    weights after each sync and the sync stage reports the delta metrics (both train backends)."""
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    cfg = recipe(name="delta-e2e", train={"backend": backend, "steps": 3, "threads": 1},
                 weight_sync={"transport": "delta", "bucket_mb": 1 / 64, "delta": {"full_every": 2}})
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path / cfg.name), use_ray=False)
    try:
        fulls = []
        for step in range(3):
            for stage in ("rollout", "reward", "advantages", "train"):
                getattr(session, stage)(step)
            metrics = session.sync_weights(step)
            trained = dict(session.train_group.call_rank0(TrainBackend.named_tensors, None))
            served = dict(session.rollout_group.call_rank0(TorchRolloutBackend.named_tensors))
            for name, t in trained.items():
                assert torch.equal(served[name], t.to(served[name].dtype)), name
            assert metrics["sync/weight_version"] == step + 1 and metrics["sync/delta_full_fetches"] == 0
            assert metrics["sync/delta_bytes"] > 0
            fulls.append(metrics["sync/delta_full"])
        assert fulls == [1, 0, 1]
        assert committed(RunStore(cfg.storage, cfg.name)) == {3: {"full"}}
    finally:
        session.shutdown()
