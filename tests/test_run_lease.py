"""One writer per run (engines/store/lease.py), on a local store and on an S3 server: a second writer is refused
naming the holder; a holder that died on this host, stopped its heartbeat or released is taken over; --takeover
stops a live holder at its next stage. And open_run's guards: a name that leaves the store, a held lease."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from rlflow.engines.core.config import StorageConfig, config_from_dict
from rlflow.engines.store.lease import HOST, LeaseHeld, LeaseLost, RunLease, process_alive, process_start
from rlflow.engines.store.run_store import Conflict, RunNameError, RunStore
from tests.conftest import small_recipe, step_metrics

# A process that holds a run's lease until it loses it (then says so, releases and exits) or is killed.
HOLDER = """
import json, sys, time
from rlflow.engines.core.config import StorageConfig
from rlflow.engines.store.lease import RunLease
from rlflow.engines.store.run_store import RunStore
store = RunStore(StorageConfig(**json.loads(sys.argv[1])), sys.argv[2])
store.claim()
lease = RunLease(store, timeout_s=float(sys.argv[3]), takeover=False)
lease.acquire()
print("held", flush=True)
while lease.lost is None:
    time.sleep(0.05)
print("lost:", lease.lost, flush=True)
lease.release()
"""


def _holder(storage: StorageConfig, run: str, timeout_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, storage.model_dump_json(), run, str(timeout_s)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _store(storage: StorageConfig, run: str = "r") -> RunStore:
    store = RunStore(storage, run)
    store.claim()
    return store


def _lease_of(host: str, pid: int, heartbeat_age_s: float, timeout_s: float = 30.0, lease_id: str = "x" * 32):
    now = time.time()
    return {"run": "r", "id": lease_id, "host": host, "pid": pid, "pid_start": None, "since": now - 3600,
            "heartbeat": now - heartbeat_age_s, "timeout_s": timeout_s}


def test_a_second_writer_is_refused_naming_the_holder_and_takes_over_once_it_is_killed(storage, caplog):
    """A live holder in another process: refused, the message naming it. SIGKILLed on this host, its lease is
    taken over at once (no waiting for the 60 s timeout): what a resume after a kill does."""
    store = _store(storage)
    holder = _holder(storage, "r", timeout_s=60)
    try:
        with pytest.raises(LeaseHeld, match=rf"run 'r' is being written by another process: host {re.escape(HOST)}, "
                                            rf"pid {holder.pid}, since .* UTC, last heartbeat \d+ s ago \(lease "):
            RunLease(store, timeout_s=60).acquire()
    finally:
        holder.kill()
        holder.wait()
    lease = RunLease(store, timeout_s=60)
    with caplog.at_level(logging.WARNING, logger="rlflow.store"):
        lease.acquire()
    lease.release()
    assert f"pid {holder.pid}" in caplog.text and f"process {holder.pid} on this host is gone" in caplog.text


def test_takeover_stops_the_live_holder_at_its_next_heartbeat(storage, monkeypatch):
    """RLFLOW_TAKEOVER=1 (what `rlflow run --takeover` sets) takes the lease from a live holder; the holder finds
    out at its next heartbeat, and its release leaves the new holder's lease as it is."""
    store = _store(storage)
    holder = _holder(storage, "r", timeout_s=10)  # a heartbeat every 2 s
    monkeypatch.setenv("RLFLOW_TAKEOVER", "1")
    lease = RunLease(store, timeout_s=60)
    try:
        lease.acquire()
        out, _ = holder.communicate(timeout=120)
    finally:
        holder.kill()
    assert holder.returncode == 0
    assert re.search(rf"^lost: run 'r': this process's lease .* was taken over; it is now held by host "
                     rf"{re.escape(HOST)}, pid {os.getpid()}", out), out
    held = store.read_json("LEASE")
    assert held["id"] == lease.id and "released" not in held
    lease.release()
    assert store.read_json("LEASE")["released"]


def test_a_lease_without_heartbeats_is_stale_and_a_fresh_one_of_another_host_holds(storage, caplog):
    store = _store(storage)
    store.write_json(_lease_of("other-host", 1, heartbeat_age_s=100, timeout_s=30), "LEASE")
    lease = RunLease(store, timeout_s=60)
    with caplog.at_level(logging.WARNING, logger="rlflow.store"):
        lease.acquire()
    assert re.search(r"took over the lease of host other-host, pid 1, .*: no heartbeat for 100 s \(its timeout: 30 s\)",
                     caplog.text), caplog.text
    lease.release()
    store.write_json(_lease_of("other-host", 1, heartbeat_age_s=5, timeout_s=30), "LEASE")
    with pytest.raises(LeaseHeld, match=r"host other-host, pid 1, since .* last heartbeat 5 s ago .*"
                                        r"Without heartbeats for 30 s the lease goes stale"):
        RunLease(store, timeout_s=60).acquire()


def test_an_automatic_resume_waits_for_a_lost_machines_lease_to_go_stale(storage, caplog):
    """Prefect calls a run crashed 150 s after its machine's heartbeats stop; that machine's lease (another host:
    its process cannot be checked) holds for 300 s. The auto-resumed attempt waits for it to go stale instead of
    failing at once; a holder that keeps renewing past that is a live writer, and is refused after the wait."""
    store = _store(storage)
    store.write_json(_lease_of("lost-host", 1, heartbeat_age_s=8, timeout_s=10), "LEASE")
    with pytest.raises(LeaseHeld):
        RunLease(store, timeout_s=60).acquire()  # not an automatic resume: refused at once
    lease = RunLease(store, timeout_s=60)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rlflow.store"):
        lease.acquire(wait_for_stale=True)
    waited = time.monotonic() - t0
    lease.release()
    assert 1 < waited < 20, waited  # ~2 s to its staleness, plus the 2 s margin
    assert re.search(r"waiting up to \d+ s for the lease of host lost-host, pid 1", caplog.text), caplog.text
    assert "took over the lease of host lost-host, pid 1" in caplog.text

    def renew():  # a holder on another host that is alive after all: its heartbeats go on, as RunLease writes them
        while not done.wait(0.5):
            store.update_json(lambda held: _lease_of("busy-host", 1, heartbeat_age_s=0, timeout_s=3), "LEASE")

    done = threading.Event()
    store.write_json(_lease_of("busy-host", 1, heartbeat_age_s=0, timeout_s=3), "LEASE")
    beats = threading.Thread(target=renew)
    beats.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(LeaseHeld, match="host busy-host"):
            RunLease(store, timeout_s=60).acquire(wait_for_stale=True)
        assert 3 < time.monotonic() - t0 < 30
    finally:
        done.set()
        beats.join()


def test_a_released_lease_and_a_leftover_of_this_process_are_free(storage, caplog):
    """A run that ended released its lease: the next one takes it without a word. A lease of this very process
    that it no longer holds (an attempt whose open failed before a flow retry) is stale; one it holds is not."""
    store = _store(storage)
    first = RunLease(store, timeout_s=60)
    first.acquire()
    with pytest.raises(LeaseHeld, match=rf"pid {os.getpid()} \(this process\)"):
        RunLease(store, timeout_s=60).acquire()
    first.release()
    assert store.read_json("LEASE")["released"]
    with caplog.at_level(logging.WARNING, logger="rlflow.store"):
        second = RunLease(store, timeout_s=60)
        second.acquire()
        second.release()
        assert "took over" not in caplog.text
        store.write_json(_lease_of(HOST, os.getpid(), heartbeat_age_s=0), "LEASE")
        third = RunLease(store, timeout_s=60)
        third.acquire()
        third.release()
    assert "left by an earlier attempt in this process" in caplog.text


def test_a_renewal_finds_a_lost_lease_and_release_leaves_the_new_holders(storage):
    store = _store(storage)
    lease = RunLease(store, timeout_s=600)
    lease.acquire()
    before = store.read_json("LEASE")["heartbeat"]
    lease.renew()
    assert store.read_json("LEASE")["heartbeat"] >= before and lease.lost is None
    lease.check()
    store.write_json(_lease_of("other-host", 7, heartbeat_age_s=0), "LEASE")  # taken over by another host
    lease.renew()
    with pytest.raises(LeaseLost, match=r"was taken over; it is now held by host other-host, pid 7"):
        lease.check()
    lease.release()
    assert store.read_json("LEASE")["host"] == "other-host" and "released" not in store.read_json("LEASE")


def test_of_racing_writers_exactly_one_takes_the_lease(storage):
    """Eight threads take the lease of a new run at once: the create is atomic (a flock locally, If-None-Match on
    S3), so one holds it and seven are refused."""
    store = _store(storage)
    barrier, won, refused = threading.Barrier(8), [], []

    def race() -> None:
        lease = RunLease(RunStore(storage, "r"), timeout_s=600)
        barrier.wait()
        try:
            lease.acquire()
            won.append(lease)
        except LeaseHeld:
            refused.append(lease)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7
    assert store.read_json("LEASE")["id"] == won[0].id
    won[0].release()


def test_a_conditional_write_loses_to_a_write_between_its_read_and_write(s3_bucket):
    """On S3 a read-modify-write replaces the file only if its ETag is the one read (and creates only if absent):
    another writer in between makes it read and decide again, on what that writer wrote."""
    root, endpoint = s3_bucket
    store = RunStore(StorageConfig(uri=root, endpoint_url=endpoint), "r")
    seen: list = []

    def change(current):
        seen.append(current)
        if len(seen) in (1, 3):  # another writer lands after this read
            store.write_json({"by": f"other-{len(seen)}"}, "f.json")
        return {"by": "me", "after": current}

    assert store.update_json(change, "f.json") == {"by": "me", "after": {"by": "other-1"}}
    assert seen == [None, {"by": "other-1"}]
    assert store.update_json(change, "f.json") == {"by": "me", "after": {"by": "other-3"}}
    assert seen[2:] == [{"by": "me", "after": {"by": "other-1"}}, {"by": "other-3"}]
    with pytest.raises(Conflict):  # the primitive underneath: If-Match on an ETag that moved on
        store._write_if_unchanged(store.path("f.json"), b"{}", '"0123456789abcdef0123456789abcdef"')


def test_a_killed_unreaped_process_counts_as_gone():
    """A SIGKILLed child that its parent has not waited for yet is a zombie: its pid still answers signal 0."""
    child = subprocess.Popen(["sleep", "60"])
    started = process_start(child.pid)
    assert started is not None and process_alive(child.pid, started[1])
    assert not process_alive(child.pid, started[1] + 1)  # a reused pid: another process's start time
    os.kill(child.pid, signal.SIGKILL)
    while process_start(child.pid)[0] != "Z":  # the kernel makes it a zombie shortly after the signal
        time.sleep(0.01)
    assert not process_alive(child.pid, started[1])
    child.wait()
    assert not process_alive(child.pid, started[1])


def test_open_run_refuses_a_name_that_leaves_the_store_and_touches_nothing_there(tmp_path):
    """Issue 49's defect: `--set name=..` put the run in the store's parent and its cleanup deleted two folders
    there. With the config's validator bypassed, open_run still refuses the name before any file is written or
    deleted, naming the field and the store."""
    from rlflow.tasks.run_context import open_run

    cfg = config_from_dict(small_recipe(tmp_path))
    for folder in ("checkpoints/7", "steps/1"):  # shaped like a run's uncommitted leftovers, beside the store
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "notes.txt").write_text("keep")
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    with pytest.raises(RunNameError, match=rf"^name: run name '\.\.' .*\(storage.uri {tmp_path}/runs\)$"):
        open_run(cfg.model_copy(update={"name": ".."}))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before


def test_open_run_refuses_while_another_process_holds_the_run(tmp_path):
    from rlflow.tasks.run_context import open_run

    cfg = config_from_dict(small_recipe(tmp_path))
    holder = _holder(cfg.storage, cfg.name, timeout_s=60)
    try:
        with pytest.raises(LeaseHeld, match=rf"run 't' is being written by another process: .* pid {holder.pid}"):
            open_run(cfg)
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "data").exists()  # refused before the data was prepared


def test_a_run_taken_over_stops_at_its_next_stage_and_writes_no_status(tmp_path):
    """A flow run whose lease another process takes over mid-run fails at its next stage with LeaseLost; its end
    writes neither its status nor a release over the new holder's lease."""
    from rlflow.flows.post_train import post_train
    from rlflow.tasks.run_context import active_run

    cfg = config_from_dict(small_recipe(tmp_path, cluster={"use_ray": False}, train={"steps": 3, "threads": 1},
                                        eval={"every": 0}, checkpoint={"every": 1},
                                        rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 1}))
    store = RunStore(cfg.storage, cfg.name)
    taker = RunLease(store, timeout_s=600, takeover=True)

    def take_over(step: int, metrics: dict) -> None:
        if step == 0:
            taker.acquire()
            store.write_json({"status": "taken"}, "status.json")
            active_run(cfg.name).lease.renew()  # its heartbeat, now rather than in two minutes

    try:
        with pytest.raises(LeaseLost, match="was taken over"):
            step_metrics(lambda: post_train(cfg), [take_over])
        assert store.read_json("LEASE")["id"] == taker.id and "released" not in store.read_json("LEASE")
        assert store.read_json("status.json") == {"status": "taken"}
        assert store.committed_steps() == [0]  # step 1's checkpoint never committed
    finally:
        taker.release()
    assert json.loads((tmp_path / "runs" / "t" / "LEASE").read_text())["released"]


def test_rlflow_run_takeover_takes_the_run_from_a_live_holder(tmp_path):
    """`rlflow run RECIPE --takeover` while another process holds the run: the run goes through, the holder
    stops at its next heartbeat, and the run's end releases the lease."""
    raw = small_recipe(tmp_path, cluster={"use_ray": False}, train={"steps": 1, "threads": 1}, eval={"every": 0},
                       rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 1})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    cfg = config_from_dict(raw)
    holder = _holder(cfg.storage, cfg.name, timeout_s=10)
    try:
        run = subprocess.run([sys.executable, "-m", "rlflow.flows.cli", "run", str(tmp_path / "r.yaml"), "--takeover"],
                             env=os.environ | {"RLFLOW_TAKEOVER": "0"}, capture_output=True, text=True, timeout=600,
                             cwd=tmp_path)
        out, _ = holder.communicate(timeout=120)
    finally:
        holder.kill()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "took over the lease" in run.stderr and f"pid {holder.pid}" in run.stderr
    assert out.startswith("lost: run 't': this process's lease") and holder.returncode == 0
    assert RunStore(cfg.storage, cfg.name).read_json("LEASE")["released"]
