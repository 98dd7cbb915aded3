"""PendingCommit (checkpoint.async_save): a background checkpoint is committed only once every worker's write is
done, never when one failed or the run closed first, and the reason reaches the run."""

from __future__ import annotations

import json
import threading

import pytest

from rlflow.tasks.checkpoint_commit import PendingCommit

MARKERS = ["written_rank0.json", "written_rank1.json", "critic/written_rank0.json"]


def _pending(folder, commits: list):
    def exists(name):
        return (folder / name).exists()

    def read_error(name):
        return json.loads((folder / name).read_text())["error"]

    return PendingCommit(5, MARKERS, exists, read_error, lambda: commits.append(5), poll_s=0.01)


def _mark(folder, name: str, body: dict) -> None:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(body))


def test_commits_once_every_worker_has_written(tmp_path):
    commits: list = []
    pending = _pending(tmp_path, commits)
    for name in MARKERS[:2]:
        _mark(tmp_path, name, {"seconds": 1.0})
    threading.Event().wait(0.2)
    assert commits == []  # the critic's rank has not written yet
    _mark(tmp_path, MARKERS[2], {"seconds": 1.0})
    assert pending.result() > 0 and commits == [5]


def test_a_failed_write_is_never_committed_and_names_the_rank(tmp_path):
    commits: list = []
    pending = _pending(tmp_path, commits)
    _mark(tmp_path, "written_rank0.json", {"seconds": 1.0})
    _mark(tmp_path, "failed_rank1.json", {"error": "OSError: No space left on device"})
    with pytest.raises(RuntimeError, match="step 5 was not committed: failed_rank1.json: OSError: No space left"):
        pending.result()
    assert commits == []


def test_a_run_that_closes_first_leaves_it_uncommitted(tmp_path):
    commits: list = []
    pending = _pending(tmp_path, commits)
    pending.cancel()
    for name in MARKERS:  # written after the run gave up on it: still not committed
        _mark(tmp_path, name, {"seconds": 1.0})
    with pytest.raises(RuntimeError, match="closed before every worker's write was done"):
        pending.result()
    assert commits == []


def test_a_worker_that_dies_mid_write_fails_the_wait_instead_of_hanging(tmp_path):
    commits: list = []
    pending = _pending(tmp_path, commits)
    _mark(tmp_path, "written_rank0.json", {"seconds": 1.0})  # rank 1 and the critic never write: gone
    with pytest.raises(RuntimeError, match="step 5 was not committed: a worker is gone"):
        pending.result(problem=lambda: "a worker is gone (ActorDiedError)", check_s=0.05)
    assert commits == []


def test_an_unreadable_store_fails_the_wait_with_its_error(tmp_path):
    def exists(name):
        raise OSError("the store is unreachable")

    pending = PendingCommit(5, MARKERS, exists, lambda name: "", lambda: None, poll_s=0.01)
    with pytest.raises(RuntimeError, match="step 5 was not committed: OSError: the store is unreachable"):
        pending.result()
