"""The run store on file:// and on an S3 server: commit markers, torn writes, retention, retries, run names that
would leave the store, and the RUN marker that every cleanup requires."""

from __future__ import annotations

import os
import re

import pyarrow as pa
import pytest

from rlflow.engines.core.retry import is_transient
from rlflow.engines.store.run_store import NotThisRun, RunNameError, RunStore, StorageError, list_runs


def _ckpt(tmp_path, step: int):
    d = tmp_path / f"local{step}"
    (d / "model").mkdir(parents=True)
    (d / "model" / "w.bin").write_bytes(bytes([step]) * 10)
    (d / "state.json").write_text("{}")
    return d


def test_commit_latest_and_download(storage, tmp_path):
    store = RunStore(storage, "r1")
    assert store.latest_step() is None
    store.commit_checkpoint(3, _ckpt(tmp_path, 3), {"step": 3})
    store.commit_checkpoint(5, _ckpt(tmp_path, 5), {"step": 5})
    assert store.committed_steps() == [3, 5] and store.latest_step() == 5
    assert store.read_bytes("latest") == b"5"
    got = store.download_checkpoint(5, tmp_path / "dl")
    assert (got / "model" / "w.bin").read_bytes() == bytes([5]) * 10
    assert store.read_json("checkpoints", 5, "meta.json") == {"step": 5}


def test_torn_checkpoint_is_ignored_and_cleaned(storage, tmp_path):
    store = RunStore(storage, "r2")
    store.claim()
    store.commit_checkpoint(2, _ckpt(tmp_path, 2), {"step": 2})
    # a crash mid-upload: files of step 4 without COMMITTED, and a rollout without its marker
    store.write_bytes(b"partial", "checkpoints", 4, "model", "w.bin")
    store.write_bytes(b"partial", "steps", 5, "rollout.parquet")
    assert store.latest_step() == 2 and store.load_rollout(5) is None
    assert sorted(store.clean_torn()) == ["checkpoints/4", "steps/5"]
    assert not store.exists("checkpoints", 4) and store.committed_steps() == [2]


def test_prune_keeps_newest(storage, tmp_path):
    store = RunStore(storage, "r3")
    store.claim()
    for s in (1, 2, 3, 4):
        store.commit_checkpoint(s, _ckpt(tmp_path, s), {"step": s})
    assert store.prune(keep_last=2) == [1, 2]
    assert store.committed_steps() == [3, 4]
    assert store.prune(keep_last=0) == [3]  # never below one: the newest survives
    assert store.committed_steps() == [4]


def test_rollout_batches_round_trip(storage):
    store = RunStore(storage, "r4")
    store.claim()
    table = pa.table({"prompt": ["a", "b"], "output_ids": [[1, 2], [3]], "output_logprobs": [[-0.5, -1.0], [-2.0]]})
    store.save_rollout(7, table)
    assert store.load_rollout(7).equals(table)
    store.prune_rollouts(before_step=7)
    assert store.load_rollout(7) is None


def test_list_runs(storage, tmp_path):
    for name in ("a", "b"):
        RunStore(storage, name).write_json({"name": name}, "config.json")
    RunStore(storage, "a").commit_checkpoint(9, _ckpt(tmp_path, 9), {})
    RunStore(storage, "a").write_json({"status": "finished"}, "status.json")
    runs = {r["run"]: r for r in list_runs(storage)}
    assert runs["a"]["latest_step"] == 9 and runs["a"]["status"] == "finished"
    assert runs["b"]["latest_step"] is None


class _Throttled(Exception):
    """Shaped like botocore's ClientError for a 503 SlowDown (a mock: real S3 throttling cannot be provoked here)."""

    response = {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}


class _Denied(Exception):
    response = {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}


def test_transient_errors_are_retried(tmp_path, monkeypatch):
    store = RunStore(str(tmp_path / "s"), "r", backoff_s=0.001)
    real, calls = store.fs.pipe_file, []

    def flaky(path, data, **kw):
        calls.append(path)
        if len(calls) < 3:
            raise [TimeoutError("read timed out"), _Throttled("slow down")][len(calls) - 1]
        return real(path, data, **kw)

    monkeypatch.setattr(store.fs, "pipe_file", flaky)
    store.write_bytes(b"x", "f")
    assert len(calls) == 3 and store.read_bytes("f") == b"x"


def test_permanent_error_names_uri_and_reason(tmp_path, monkeypatch):
    store = RunStore(str(tmp_path / "s"), "r", backoff_s=0.001)

    def denied(path, data, **kw):
        raise _Denied("access denied")

    monkeypatch.setattr(store.fs, "pipe_file", denied)
    with pytest.raises(StorageError, match=r"write .*/r/f failed \(error\): _Denied: access denied"):
        store.write_bytes(b"x", "f")


def test_transient_classification():
    assert is_transient(TimeoutError()) and is_transient(_Throttled())
    assert not is_transient(_Denied()) and not is_transient(ValueError("bad"))
    try:
        try:
            raise _Throttled()
        except _Throttled as inner:
            raise OSError("translated by s3fs") from inner
    except OSError as outer:
        assert is_transient(outer)


def test_export_of_a_missing_step_lists_the_steps_there_are(tmp_path, capsys):
    from rlflow.flows.cli import main as cli_main

    root = str(tmp_path / "runs")
    store = RunStore(root, "r")
    store.write_json({"name": "r"}, "config.json")
    for s in (49, 98):
        store.commit_checkpoint(s, _ckpt(tmp_path, s), {"step": s})
    store.write_bytes(b"partial", "checkpoints", 99, "model", "w.bin")  # a crash while saving step 99

    def export(run: str, *step: str) -> tuple[int, str]:
        rc = cli_main(["export", run, str(tmp_path / "out"), *step, "--store", root])
        return rc, capsys.readouterr().err

    rc, err = export("r", "--step", "99")
    assert rc == 2 and "no committed checkpoint at step 99 (it was started but never committed)" in err
    assert f"committed steps in {root}/r/checkpoints: 49, 98" in err
    rc, err = export("r", "--step", "50")
    assert rc == 2 and err.endswith("checkpoints: 49, 98\n") and "never committed" not in err
    rc, err = export("nope")
    assert rc == 2 and "run 'nope' has no committed checkpoint" in err and "no run 'nope' here" in err
    assert export("r", "--step", "49")[0] == 0 and (tmp_path / "out" / "w.bin").read_bytes() == bytes([49]) * 10
    assert export("r")[0] == 0 and (tmp_path / "out" / "w.bin").read_bytes() == bytes([98]) * 10  # the newest


def test_export_of_a_lora_adapter(tmp_path, capsys):
    """`rlflow export RUN OUT --adapter`: a LoRA checkpoint's PEFT folder (adapter/); a full run's has none, which
    the error says, writing nothing."""
    from rlflow.flows.cli import main as cli_main

    root = str(tmp_path / "runs")
    store = RunStore(root, "r")
    lora_ckpt = _ckpt(tmp_path, 3)
    (lora_ckpt / "adapter").mkdir()
    (lora_ckpt / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (lora_ckpt / "adapter" / "adapter_model.safetensors").write_bytes(b"a")
    store.commit_checkpoint(3, lora_ckpt, {"step": 3})
    assert cli_main(["export", "r", str(tmp_path / "a"), "--adapter", "--store", root]) == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    store.commit_checkpoint(4, _ckpt(tmp_path, 4), {"step": 4})
    capsys.readouterr()
    assert cli_main(["export", "r", str(tmp_path / "b"), "--adapter", "--store", root]) == 2
    assert "step 4 of 'r' has no LoRA adapter" in capsys.readouterr().err and not (tmp_path / "b").exists()


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "../runs-b", "a\\b"])
def test_a_run_name_outside_the_store_is_refused(storage, name):
    """The config refuses such names too; the store refuses them itself, whoever built it (here: directly)."""
    with pytest.raises(RunNameError, match=rf"^name: run name .*\(storage.uri {re.escape(storage.uri)}\)$"):
        RunStore(storage, name)


def test_a_run_folder_that_resolves_outside_the_store_is_refused(tmp_path):
    """A local run folder that is a symlink out of the store: its resolved path is not inside the root."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "runs" / "r")
    with pytest.raises(RunNameError, match=r"resolves to .*/elsewhere, not a folder of"):
        RunStore(str(tmp_path / "runs"), "r")
    RunStore(str(tmp_path / "runs"), "ok").write_json({"name": "ok"}, "config.json")
    assert [r["run"] for r in list_runs(str(tmp_path / "runs"))] == ["ok"]  # `rlflow runs` passes the link by


def test_the_cleanup_never_deletes_a_folder_without_the_marker(storage):
    """A folder rlflow did not create (here: one named like a run, holding what clean_torn and prune delete) is
    never cleaned: every cleanup names it and deletes nothing, and claim refuses it before writing anything."""
    store = RunStore(storage, "notes")
    store.write_bytes(b"mine", "checkpoints", 3, "w.bin")  # no COMMITTED: what clean_torn would call torn
    store.write_bytes(b"mine", "steps", 1, "rollout.parquet")
    store.write_bytes(b"3", "checkpoints", 2, "COMMITTED")
    before, folder = store.files(), re.escape(store.uri())
    for cleanup in (store.clean_torn, lambda: store.prune(keep_last=0), lambda: store.prune_rollouts(9)):
        with pytest.raises(NotThisRun, match=rf"refusing to delete anything in {folder}: it has no RUN marker"):
            cleanup()
    with pytest.raises(NotThisRun, match=rf"{folder} holds checkpoints, steps but no RUN marker of run 'notes'"):
        store.claim()
    assert RunStore(storage, "notes").files() == before  # nothing deleted, nothing written (no marker, no lock)


def test_claim_creates_the_marker_and_adopts_a_run_from_before_markers(storage, tmp_path):
    fresh = RunStore(storage, "fresh")
    made = fresh.claim()
    assert made["run"] == "fresh" and len(made["id"]) == 32
    assert RunStore(storage, "fresh").claim() == made  # a second start keeps the creation id
    old = RunStore(storage, "old")  # a run written before markers: its config.json names it
    old.write_json({"name": "old"}, "config.json")
    old.commit_checkpoint(2, _ckpt(tmp_path, 2), {"step": 2})
    old.write_bytes(b"partial", "checkpoints", 4, "model", "w.bin")
    assert old.claim()["adopted"] is True and old.read_json("RUN")["run"] == "old"
    assert old.clean_torn() == ["checkpoints/4"] and old.committed_steps() == [2]
    other = RunStore(storage, "copy")  # a folder whose config.json names another run is not adopted
    other.write_json({"name": "old"}, "config.json")
    with pytest.raises(NotThisRun, match="no RUN marker of run 'copy' \\(nor a config.json naming it\\)"):
        other.claim()
    other.write_json({"run": "old", "id": "x"}, "RUN")  # nor is one whose marker names another run
    with pytest.raises(NotThisRun, match=r"RUN belongs to run 'old', not 'copy'"):
        other.claim()
    with pytest.raises(NotThisRun):
        other.clean_torn()
