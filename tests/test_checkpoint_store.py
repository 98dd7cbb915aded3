"""Sharded checkpoints written by every rank straight into the run store (S3 on the moto server), committed by
the driver's marker, and read back straight from the store onto another number of ranks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from transformers import AutoModelForCausalLM

from rlflow.engines.core.config import StorageConfig, TrainConfig
from rlflow.engines.core.protocols import TrainBackend
from rlflow.engines.store.run_store import RunStore, StorageError
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.test_fsdp import ALGO, _ranks, _step, batch, ray_cluster  # noqa: F401 - fixtures

TRAIN = TrainConfig(threads=1, lr=1e-3, lr_schedule="cosine", warmup_steps=1, steps=6)


def _s3(s3_bucket) -> StorageConfig:
    """The bucket's store with explicit credentials: the Ray workers do not share the test's environment."""
    root, endpoint = s3_bucket
    return StorageConfig(uri=root, endpoint_url=endpoint, key="testing", secret="testing", region="us-east-1")


def test_two_ranks_write_shards_to_s3_and_resume_on_one(tiny_model_dir, batch, ray_cluster, s3_bucket, tmp_path):  # noqa: F811
    """2 ranks each put their own shards into s3://, the driver commits; nothing but safetensors and JSON is
    written (no pickled DCP .metadata); one rank reading straight from S3 takes the same next step; model/ is
    an HF checkpoint transformers loads."""
    storage = _s3(s3_bucket)
    store = RunStore(storage, "run")
    two = _ranks(tiny_model_dir, TRAIN, 2, "store-two")
    _step(two, batch, 2)
    target = store.begin_checkpoint(3)
    assert target.startswith("s3://")
    two.call(TrainBackend.save, target, storage)
    assert store.committed_steps() == []  # shards alone are no checkpoint
    store.finish_checkpoint(3, {"step": 3})
    weights = dict(two.wait(two.submit(TrainBackend.named_tensors))[0])
    want = _step(two, batch, 2)
    two.shutdown()

    files = store.files("checkpoints", 3)
    assert all(f.endswith((".safetensors", ".json")) or f in ("COMMITTED",) for f in files), files
    assert {f for f in files if f.startswith("optimizer/")} == {
        f"optimizer/shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)
    }  # each rank wrote its own
    assert "model/model.safetensors" in files and not any(f.startswith("model/sharded") for f in files)

    one = TorchTrainBackend(tiny_model_dir, TRAIN, ALGO)
    one.load(store.uri("checkpoints", 3), storage)
    got = _step_one(one, batch)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    assert got["lr"] == want["lr"]
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)

    hf = AutoModelForCausalLM.from_pretrained(store.export_model(3, tmp_path / "export"), dtype=torch.float32)
    exported = dict(hf.named_parameters())
    assert all(torch.equal(exported[n], w) for n, w in weights.items())


def test_a_crash_before_the_marker_leaves_no_checkpoint(tiny_model_dir, batch, storage, monkeypatch):  # noqa: F811
    """A rank that dies between its shard writes (here: the optimizer's upload fails for good after the model's
    went through) raises out of save, so the driver never writes COMMITTED: the store has no checkpoint, says
    the step was never committed, and the next attempt removes the leftovers. On a local store and on S3: the
    same store-direct code serves both."""
    store = RunStore(storage, "run")
    store.claim()  # the RUN marker, as open_run writes it: clean_torn deletes only in a folder that has it
    store.write_json({}, "config.json")
    trainer = TorchTrainBackend(tiny_model_dir, TRAIN, ALGO)
    _step_one(trainer, batch)
    write = RunStore.write_bytes

    def dying(self, data, *parts):
        if "optimizer" in "/".join(map(str, parts)):
            raise StorageError(f"write {self.uri(*parts)} failed (error): the node went away")
        return write(self, data, *parts)

    monkeypatch.setattr(RunStore, "write_bytes", dying)
    target = store.begin_checkpoint(5)
    with pytest.raises(CheckpointException, match="went away"):  # DCP names the rank and its error
        trainer.save(target, storage)
    monkeypatch.undo()
    assert any(f.startswith("model/") for f in store.files("checkpoints", 5))  # the model's shards did land
    assert store.committed_steps() == [] and store.latest_step() is None
    with pytest.raises(StorageError, match="no committed checkpoint"):
        store.committed_step(5)
    assert store.clean_torn() == ["checkpoints/5"]


def _step_one(trainer: TorchTrainBackend, rows) -> dict[str, float]:
    metrics = trainer.train_step(rows)
    metrics.pop("worker_s")
    return metrics


def test_workers_get_the_drivers_credentials_when_the_recipe_names_none(monkeypatch):
    """Ray workers do not inherit the driver's AWS_* environment: the StorageConfig sent to them carries it (as
    a recipe's key/secret would); explicit settings, a profile and local stores are left as they are."""
    from rlflow.engines.store.run_store import worker_storage

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDRIVER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "driver-secret")
    sent = worker_storage(StorageConfig(uri="s3://bucket/runs"))
    assert sent.key.get_secret_value() == "AKIDRIVER" and sent.secret.get_secret_value() == "driver-secret"
    assert "driver-secret" not in repr(sent)
    own = StorageConfig(uri="s3://bucket/runs", key="AKIOWN", secret="own")
    assert worker_storage(own) is own
    assert worker_storage(StorageConfig(uri="s3://bucket/runs", profile="p")).key is None
    assert worker_storage(StorageConfig(uri="/tmp/runs")).key is None


def test_a_reader_fetches_only_the_rows_it_needs(tmp_path, monkeypatch):
    """read_stored_tensor with `rows`: one ranged read of exactly those rows' bytes (a rank resharding along the
    first dimension, e.g. a Megatron load onto more tensor-parallel ranks, reads its part and no more)."""
    from safetensors.torch import save

    from rlflow.engines.train.dcp_store import read_stored_tensor, safetensors_header

    store = RunStore(StorageConfig(uri=str(tmp_path)), "r")
    w = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    store.write_bytes(save({"b": torch.ones(3), "w": w}), "f.safetensors")
    start, header = safetensors_header(store, "f.safetensors")
    reads = []
    read_range = store.read_range
    monkeypatch.setattr(store, "read_range", lambda a, b, *p: reads.append(b - a) or read_range(a, b, *p))
    assert torch.equal(read_stored_tensor(store, "f.safetensors", start, header["w"], (2, 5)), w[2:5])
    assert reads == [3 * 5 * 4]
    assert torch.equal(read_stored_tensor(store, "f.safetensors", start, header["w"]), w)
    assert torch.equal(read_stored_tensor(store, "f.safetensors", start, header["w"], (6, 6)), w[6:6])
