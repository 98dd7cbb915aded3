"""Backends in spawned processes, called by method name over pipes: a worker group for benchmarks on machines
without Ray (the device machines: Ray's wheel is larger than what a run may carry there).

It has the verbs the weight transports use (engines/sync/base.py: call, call_each, call_rank0, call_one,
submit, submit_rank0, submit_each, wait), so a transport runs unchanged between real backends in real
processes, as it does between Ray actors. A worker runs one call at a time, in order; `submit*` returns at once
with a ticket and `wait` collects the answer, so calls on two groups overlap (a broadcast's sender and its
receivers). Every wait is bounded by the group's deadline: a hung collective ends the run with TimeoutError
instead of waiting for NCCL's own timeout, and a worker that dies is reported at the next wait.

Messages are plain Python values (method names, bucket plans, CUDA IPC handle tuples, floats) between
processes of one host; nothing is persisted or sent over a network.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlflow.engines.core.protocols import method_name


def _serve(conn, cls: type, kwargs: dict, gpu: int | None) -> None:
    """A worker process: build the backend on its GPU, then answer (method, args, kwargs) until None."""
    if gpu is not None:
        torch.cuda.set_device(0)  # the one GPU it sees (`_sees_only`)
    try:
        backend = cls(**kwargs)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while (msg := conn.recv()) is not None:
        name, args, kw = msg
        try:
            conn.send(("ok", getattr(backend, name)(*args, **kw)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    if hasattr(backend, "close"):
        backend.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: destroying an NCCL group at exit can block on its peer, gone already


@contextlib.contextmanager
def _sees_only(gpu: int | None) -> Iterator[None]:
    """The environment a worker process starts with: GPU `gpu` of this process's alone visible, as cuda:0 (as Ray
    shows an actor its GPU), so that every thread of the worker works on it: torch.cuda.set_device holds for the
    calling thread only, and an embedded rollout server joins the `distributed` transport's NCCL group from a
    thread of its own."""
    if gpu is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = before.split(",") if before else None
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[gpu] if visible else str(gpu)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


@dataclass(frozen=True)
class Ticket:
    """A call sent to worker `rank` of `group`, answered in order (`seq`)."""

    group: ProcessWorkerGroup
    rank: int
    seq: int


class ProcessWorkerGroup:
    """Worker i is `cls(**kwargs[i])` in its own spawned process on GPU `gpus[i]` (None: no GPU), the only GPU
    it sees (its cuda:0). The workers are built concurrently; `ready()` waits for them. All calls end by
    `deadline` (time.monotonic())."""

    def __init__(
        self, cls: type, kwargs: Sequence[dict], gpus: Sequence[int | None], deadline: float, name: str = "worker"
    ):
        if len(kwargs) != len(gpus):
            raise ValueError(f"{name}: {len(kwargs)} workers' kwargs but {len(gpus)} GPUs")
        ctx = mp.get_context("spawn")
        self.name, self.deadline = name, deadline
        self._conns, self.procs = [], []
        for kw, gpu in zip(kwargs, gpus, strict=True):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, cls, kw, gpu), name=f"{name}-{len(self.procs)}", daemon=True)
            with _sees_only(gpu):  # a spawned process takes the environment of this moment
                proc.start()
            child.close()
            self._conns.append(parent)
            self.procs.append(proc)
        self._sent = [1] * len(self.procs)  # seq 0 is the construction's answer
        self._received = [0] * len(self.procs)
        self._answers: list[dict[int, tuple]] = [{} for _ in self.procs]
        self._started = [Ticket(self, r, 0) for r in range(len(self.procs))]

    def __len__(self) -> int:
        return len(self.procs)

    def ready(self) -> None:
        """Wait until every worker has built its backend (raises the first one's error)."""
        self.wait(self._started)

    # ---- sending and receiving ---------------------------------------------------------------------------
    def _send(self, rank: int, method: Callable[..., Any], args: tuple, kwargs: dict) -> Ticket:
        args = tuple(a.group.wait([a])[0] if isinstance(a, Ticket) else a for a in args)  # another call's result
        self._conns[rank].send((method_name(method), args, kwargs))
        ticket = Ticket(self, rank, self._sent[rank])
        self._sent[rank] += 1
        return ticket

    def _answer(self, t: Ticket) -> Any:
        conn, answers = self._conns[t.rank], self._answers[t.rank]
        while t.seq not in answers:
            left = self.deadline - time.monotonic()
            if left <= 0 or not conn.poll(left):
                raise TimeoutError(f"{self.name}-{t.rank}: no answer before the deadline (the run's --timeout)")
            try:
                answers[self._received[t.rank]] = conn.recv()
            except EOFError:
                code = self.procs[t.rank].exitcode
                raise RuntimeError(f"{self.name}-{t.rank}: the worker process died (exit code {code})") from None
            self._received[t.rank] += 1
        status, value = answers.pop(t.seq)
        if status == "error":
            raise RuntimeError(f"{self.name}-{t.rank} raised:\n{value}")
        return value

    # ---- the worker-group verbs ------------------------------------------------------------------------
    def submit(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Ticket]:
        return [self._send(r, method, args, kwargs) for r in range(len(self))]

    def submit_each(self, method: Callable[..., Any], per_worker_args: Sequence[tuple]) -> list[Ticket]:
        if len(per_worker_args) != len(self):
            raise ValueError(f"{self.name}: {len(per_worker_args)} argument tuples for {len(self)} workers")
        return [self._send(r, method, tuple(a), {}) for r, a in enumerate(per_worker_args)]

    def submit_rank0(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Ticket:
        return self._send(0, method, args, kwargs)

    def wait(self, handles: Sequence[Ticket]) -> list[Any]:
        return [h.group._answer(h) for h in handles]

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self.wait(self.submit(method, *args, **kwargs))

    def call_each(self, method: Callable[..., Any], per_worker_args: Sequence[tuple]) -> list[Any]:
        return self.wait(self.submit_each(method, per_worker_args))

    def call_rank0(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.wait([self.submit_rank0(method, *args, **kwargs)])[0]

    def call_one(self, rank: int, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.wait([self._send(rank, method, args, kwargs)])[0]

    def shutdown(self, grace_s: float = 30) -> None:
        """Ask every worker to close its backend and exit; kill those still running after `grace_s`."""
        for conn, proc in zip(self._conns, self.procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
        end = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(max(0.0, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
