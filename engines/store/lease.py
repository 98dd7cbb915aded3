"""One writer per run: the run's lease, `<store>/<run>/LEASE`.

Two processes that open the same run at once write the same steps, checkpoints and status (issue 49: one reused
the other's rollout batches). The process that opens a run takes its lease: JSON naming the holder (host, pid, the
process's start time, a uuid), since when it holds it, and a heartbeat time that a thread renews while the run is
open. The run's end, finished or failed, releases it. Any other process is refused with a LeaseHeld error naming
the holder, unless the lease is stale:
  - released: its run ended;
  - no heartbeat for longer than the holder's timeout (RLFLOW_LEASE_TIMEOUT_S, default 300 s);
  - its holder ran on this host and is gone (a SIGKILLed run resumes at once, without waiting for the timeout);
  - left by an earlier attempt in this very process (a flow retry after an open that failed half way);
or the user takes the run over (`rlflow run ... --takeover`; a flow run: RLFLOW_TAKEOVER=1 in its environment).
A holder whose lease was taken over finds out at its next heartbeat and stops at its next stage (LeaseLost), and
writes neither its status nor a release over the new holder's lease.

Every read-and-write of LEASE is RunStore.update_json: under a flock on a local store, conditional writes on S3
(If-None-Match / If-Match on the ETag read), so of two processes deciding at once only one wins.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from rlflow.engines.store.run_store import RunStore, StorageError

log = logging.getLogger("rlflow.store")

LEASE = "LEASE"
TIMEOUT_ENV = "RLFLOW_LEASE_TIMEOUT_S"
TAKEOVER_ENV = "RLFLOW_TAKEOVER"
DEFAULT_TIMEOUT_S = 300.0
HEARTBEATS_PER_TIMEOUT = 5  # a holder renews five times within its timeout: one slow write does not lose the lease
STALE_MARGIN_S = 2.0  # a waiting taker looks again this long after a lease's expected staleness
HOST = socket.gethostname()

_live: set[str] = set()  # the ids of the leases this process holds now


class LeaseHeld(StorageError):
    """Another live process holds the run's lease: the message names it (host, pid, since, heartbeat age)."""


class LeaseLost(StorageError):
    """This process's lease was taken over (or could not be renewed within its timeout): the run must stop."""


def lease_timeout_s() -> float:
    """RLFLOW_LEASE_TIMEOUT_S: seconds without a heartbeat after which a lease is stale (default 300)."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected a number of seconds above 0")
    return value


def takeover_requested() -> bool:
    """RLFLOW_TAKEOVER: 1/true/yes takes a run's lease from a live holder (`rlflow run --takeover` sets it)."""
    text = os.environ.get(TAKEOVER_ENV, "").strip().lower()
    if text in ("", "0", "false", "no"):
        return False
    if text in ("1", "true", "yes"):
        return True
    raise ValueError(f"{TAKEOVER_ENV}={text!r}: expected 1, true or yes (take over), or 0, false or no")


def process_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of a process on this host, from /proc; None where there is no
    /proc or no such process. The start time tells a reused pid from the process that wrote a lease."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 (state) onwards
    return fields[0], int(fields[19])  # field 22: starttime


def process_alive(pid: int, started: int | None) -> bool:
    """Whether the process that wrote a lease on this host still runs: it exists, is no zombie (killed, not yet
    reaped), and, where the lease recorded its start time, it is the same process and not a reused pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    info = process_start(pid)
    if info is None:
        return True  # no /proc: the signal said it exists
    state, start = info
    return state != "Z" and (started is None or start == started)


# what a lease holds, and the types each field may have (times: seconds since the epoch)
FIELDS = {"run": str, "id": str, "host": str, "pid": int, "since": (int, float), "heartbeat": (int, float),
          "timeout_s": (int, float)}


def well_formed(lease: object) -> bool:
    """Whether `lease` is what RunLease writes: a LEASE edited by hand or by something else is not judged."""
    return isinstance(lease, dict) and all(isinstance(lease.get(k), t) for k, t in FIELDS.items())


def describe(lease: dict, now: float) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(lease["since"]))
    this = " (this process)" if lease["host"] == HOST and lease["pid"] == os.getpid() else ""
    return (f"host {lease['host']}, pid {lease['pid']}{this}, since {since}, "
            f"last heartbeat {now - lease['heartbeat']:.0f} s ago")


def stale_reason(lease: dict, now: float) -> str | None:
    """Why a lease no longer holds its run, or None while its holder may still be writing."""
    if lease.get("released"):
        return "released when its run ended"
    age = now - lease["heartbeat"]
    if age > lease["timeout_s"]:
        return f"no heartbeat for {age:.0f} s (its timeout: {lease['timeout_s']:.0f} s)"
    if lease["host"] == HOST:
        if lease["pid"] == os.getpid() and lease["id"] not in _live:
            return "left by an earlier attempt in this process"
        if lease["pid"] != os.getpid() and not process_alive(lease["pid"], lease.get("pid_start")):
            return f"process {lease['pid']} on this host is gone"
    return None


class RunLease:
    """The lease of one run, held by this process from acquire() to release(), renewed by a heartbeat thread."""

    def __init__(self, store: RunStore, timeout_s: float | None = None, takeover: bool | None = None):
        self.store = store
        self.timeout_s = lease_timeout_s() if timeout_s is None else timeout_s
        self.takeover = takeover_requested() if takeover is None else takeover
        self.id = uuid.uuid4().hex
        self.lost: str | None = None  # why the lease is no longer this process's, once the heartbeat found out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed = time.monotonic()

    @property
    def held(self) -> bool:
        return self.id in _live and self.lost is None

    def acquire(self, wait_for_stale: bool = False) -> None:
        """Take the run's lease, or raise LeaseHeld naming the live holder; then start the heartbeat.

        wait_for_stale: a live-looking holder is waited for, until its lease would go stale (its last heartbeat plus
        its timeout, and a margin), before LeaseHeld. An automatic resume needs that: Prefect declares a lost machine's
        run crashed after its flow heartbeats stop (150 s), before the lease of that machine's process, which cannot
        be checked from here, goes stale (300 s); without the wait the resumed attempt would fail at once."""
        if not wait_for_stale:
            return self._acquire()
        deadline = None
        while True:
            try:
                return self._acquire()
            except LeaseHeld as held:
                current = self.store.update_json(lambda _: None, LEASE)  # a read under the writers' lock
                if not well_formed(current):
                    raise
                stale_at = current["heartbeat"] + current["timeout_s"] + STALE_MARGIN_S
                if deadline is None:
                    deadline = stale_at
                    log.warning("run %r: waiting up to %.0f s for the lease of %s to go stale (its holder may be on "
                                "a machine that is gone)", self.store.run, max(0.0, stale_at - time.time()),
                                describe(current, time.time()))
                if time.time() > deadline:  # it kept renewing past the first deadline: a live writer
                    raise held
                time.sleep(max(0.5, min(5.0, stale_at - time.time())))

    def _acquire(self) -> None:
        started = process_start(os.getpid())
        taken: list[str] = []

        def take(current: dict | None) -> dict | None:
            now = time.time()
            if current is not None and current.get("id") == self.id:
                return None  # ours already: a write retried after it had landed
            if current is not None and not well_formed(current) and not self.takeover:
                raise StorageError(f"{self.store.uri(LEASE)} is not a lease rlflow writes (expected the fields "
                                   f"{', '.join(FIELDS)}): remove it, or take the run over with `--takeover`")
            if current is not None and well_formed(current):
                reason = stale_reason(current, now)
                if reason is None and not self.takeover:
                    raise LeaseHeld(
                        f"run {self.store.run!r} is being written by another process: {describe(current, now)} "
                        f"(lease {self.store.uri(LEASE)}). Two writers would overwrite each other's steps and "
                        "checkpoints: wait for it to end or stop it, or take the run over with `--takeover` (a flow "
                        f"run: {TAKEOVER_ENV}=1 in its environment). Without heartbeats for "
                        f"{current['timeout_s']:.0f} s the lease goes stale and is taken over by itself.")
                if not current.get("released"):
                    taken[:] = [f"{describe(current, now)}: {reason or 'taken over on request'}"]
            return {"run": self.store.run, "id": self.id, "host": HOST, "pid": os.getpid(),
                    "pid_start": started[1] if started else None, "since": now, "heartbeat": now,
                    "timeout_s": self.timeout_s}

        # live before it is written: another thread of this process that reads the lease while this one is still
        # writing (or reading it back, on S3) must see a live holder, not one "left by an earlier attempt"
        _live.add(self.id)
        try:
            self.store.update_json(take, LEASE)
        except BaseException:
            _live.discard(self.id)
            raise
        self._renewed = time.monotonic()
        if taken:
            log.warning("run %r: took over the lease of %s", self.store.run, taken[0])
        self._thread = threading.Thread(target=self._heartbeat, name=f"rlflow-lease-{self.store.run}", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise LeaseLost if the heartbeat found the lease gone: called before each stage and each commit."""
        if self.lost is not None:
            raise LeaseLost(self.lost)

    def renew(self) -> None:
        """One heartbeat: the lease's time moves on if it is still this process's; else `lost` says who has it."""

        def beat(current: dict | None) -> dict:
            if current is None or current.get("id") != self.id or current.get("released"):
                holder = describe(current, time.time()) if well_formed(current) and not current.get("released") \
                    else "nobody"
                raise LeaseLost(f"run {self.store.run!r}: this process's lease ({self.store.uri(LEASE)}) was taken "
                                f"over; it is now held by {holder}. This run stops: another process writes it.")
            return current | {"heartbeat": time.time()}

        try:
            self.store.update_json(beat, LEASE)
            self._renewed = time.monotonic()
        except LeaseLost as e:
            self.lost = str(e)
        except StorageError as e:
            silent = time.monotonic() - self._renewed
            if silent > self.timeout_s:
                self.lost = (f"run {self.store.run!r}: the lease ({self.store.uri(LEASE)}) could not be renewed for "
                             f"{silent:.0f} s, past its timeout ({self.timeout_s:.0f} s), so another process may "
                             f"have taken the run over: this run stops (last error: {e})")
            else:
                log.warning("run %r: lease heartbeat failed (%s); trying again", self.store.run, e)

    def _heartbeat(self) -> None:
        while self.lost is None and not self._stop.wait(self.timeout_s / HEARTBEATS_PER_TIMEOUT):
            self.renew()
        if self.lost is not None:
            log.error("%s", self.lost)

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released, if it is still this process's (a lease taken over stays
        the new holder's). A failed release is a warning: the lease then goes stale on its own."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self.id not in _live:
            return

        def free(current: dict | None) -> dict | None:
            if current is None or current.get("id") != self.id:
                return None
            return current | {"released": time.time()}

        try:
            if self.lost is None:
                self.store.update_json(free, LEASE)
        except StorageError as e:
            log.warning("run %r: the lease was not released (%s); it goes stale after %.0f s without heartbeats",
                        self.store.run, e, self.timeout_s)
        finally:
            _live.discard(self.id)
