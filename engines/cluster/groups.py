"""Worker groups: N copies of a backend class, called together.

`RayWorkerGroup` runs each copy in a long-lived Ray actor; `LocalWorkerGroup` keeps them in this
process. Both have the same three verbs, so the RL loop is written once and runs with or without Ray
(the bare loop is the benchmark's baseline and the first debugging tool).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError, RayTaskError

from rlflow.engines.cluster.addresses import LOOPBACK, free_port, node_ip
from rlflow.engines.cluster.placement import Placement, RoleDemand, place
from rlflow.engines.cluster.termination import bound_exit_on_sigterm
from rlflow.engines.core.config import ClusterConfig
from rlflow.engines.core.protocols import bound, missing_methods

B = TypeVar("B")
P = ParamSpec("P")
R = TypeVar("R")


class LocalWorkerGroup(Generic[B]):
    """Workers as plain objects in this process (one worker, or sequential calls for tests)."""

    def __init__(self, workers: Sequence[B], factory: Callable[[int], B] | None = None,
                 protocols: Sequence[type] = ()):
        """`factory(rank)` builds a worker again for `restart`; `protocols` as for RayWorkerGroup."""
        for w in workers:
            check_implements(type(w), protocols)
        self.workers, self.factory = list(workers), factory

    def __len__(self) -> int:
        return len(self.workers)

    def call(self, method: Callable[Concatenate[B, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Same arguments to every worker; results in rank order."""
        return [bound(w, method)(*args, **kwargs) for w in self.workers]

    def call_each(self, method: Callable[..., R], per_worker_args: Sequence[tuple]) -> list[R]:
        """Worker i gets per_worker_args[i] (e.g. its shard of a batch)."""
        return [bound(w, method)(*a) for w, a in zip(self.workers, per_worker_args, strict=True)]

    def call_rank0(self, method: Callable[Concatenate[B, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return bound(self.workers[0], method)(*args, **kwargs)

    def call_one(self, rank: int, method: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        return bound(self.workers[rank], method)(*args, **kwargs)

    def submit_each(self, method: Callable[..., Any], per_worker_args: Sequence[tuple]) -> list[Any]:
        """call_each without waiting (here: it runs now); `wait` gives the results."""
        return self.call_each(method, per_worker_args)

    def submit_rank0(self, method: Callable[Concatenate[B, P], Any], *args: P.args, **kwargs: P.kwargs) -> Any:
        """Start a call on rank 0 and return a handle another group's `call` accepts as an argument."""
        return self.call_rank0(method, *args, **kwargs)

    def submit(self, method: Callable[Concatenate[B, P], Any], *args: P.args, **kwargs: P.kwargs) -> list[Any]:
        """Start a call on every worker (a collective); handles in rank order, for another group's `call`."""
        return self.call(method, *args, **kwargs)

    def wait(self, handles: Sequence[Any]) -> list[Any]:
        """Results of `submit` handles (raises a worker's error)."""
        return list(handles)

    def node_ip(self, rank: int) -> str:
        """Every worker is in this process: loopback reaches it."""
        return LOOPBACK

    def alive(self) -> list[bool]:
        """In one process every worker object lives as long as the group."""
        return [True] * len(self.workers)

    def restart(self, rank: int) -> None:
        """Replace worker `rank` by a fresh one (its old object is closed first)."""
        if self.factory is None:
            raise RuntimeError("LocalWorkerGroup.restart: this group was built without a factory")
        old = self.workers[rank]
        if hasattr(old, "close"):
            old.close()
        self.workers[rank] = self.factory(rank)

    def shutdown(self) -> None:
        for w in self.workers:  # a rollout backend stops its engine thread and HTTP server
            if hasattr(w, "close"):
                w.close()
        self.workers.clear()


class RayWorkerGroup(Generic[B]):
    """Workers as Ray actors, worker i in slot i of a placement (engines/cluster/placement.py); calls fan out
    concurrently and are gathered once per batch, never per sample."""

    def __init__(self, cls: type[B], num_workers: int, make_kwargs: Callable[[int], dict], num_cpus: float,
                 name: str, num_gpus: float = 0, placement: Placement | None = None, protocols: Sequence[type] = (),
                 rendezvous: bool = False, wait: bool = True):
        """`placement`: the slots to start in, owned by the caller (the run's plan; colocated groups share
        one); by default the group reserves its own on one node. `protocols`: what the session will call on
        these workers; a backend that lacks a method fails here, before any actor starts. `rendezvous`: the
        workers form a torch.distributed group; each gets `dist_url`, an address on rank 0's node. `wait`: return
        once every actor is constructed (raising its constructor's error); False returns as they start, and
        `wait_ready` waits for several groups together, so their workers load their models at the same time."""
        check_implements(cls, protocols)
        self._owns_placement = placement is None
        if placement is None:
            bundle = {"CPU": num_cpus} | ({"GPU": num_gpus} if num_gpus else {})
            placement = place([RoleDemand(name, num_workers, 1, bundle)])[name]
        self.placement = placement
        actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(cls)
        extra = {"dist_url": rendezvous_url(placement)} if rendezvous and num_workers > 1 else {}

        def start(rank: int, name: str) -> Any:
            return actor_cls.options(name=name, max_concurrency=1, scheduling_strategy=placement.strategy(rank)
                                     ).remote(**make_kwargs(rank), **extra)

        self._start, self._name, self._restarts = start, name, 0
        self.workers = [start(rank, f"{name}-{rank}") for rank in range(num_workers)]
        if wait:
            wait_ready([self])

    def ready_refs(self) -> list[Any]:
        """One ref per actor, done when its constructor has returned (raising its error if it failed)."""
        return [w.__ray_ready__.remote() for w in self.workers]

    def node_ip(self, rank: int) -> str:
        """The address of the node worker `rank`'s bundle is on now (Ray moves a lost node's bundles)."""
        return node_address(self.placement, rank)[0]

    def alive(self, timeout_s: float = 10.0) -> list[bool]:
        """Whether each actor still answers (a killed worker process raises at once)."""
        out = []
        for ref in [w.__ray_ready__.remote() for w in self.workers]:
            try:
                ray.get(ref, timeout=timeout_s)
                out.append(True)
            except (RayActorError, GetTimeoutError):
                out.append(False)
        return out

    def restart(self, rank: int) -> None:
        """Replace actor `rank` by a fresh one in the same placement bundle (the old one is killed if alive)."""
        ray.kill(self.workers[rank], no_restart=True)
        self._restarts += 1
        self.workers[rank] = self._start(rank, f"{self._name}-{rank}-restart{self._restarts}")
        ray.get(self.workers[rank].__ray_ready__.remote())

    def __len__(self) -> int:
        return len(self.workers)

    def call(self, method: Callable[Concatenate[B, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return get_all([bound(w, method).remote(*args, **kwargs) for w in self.workers])

    def call_each(self, method: Callable[..., R], per_worker_args: Sequence[tuple]) -> list[R]:
        return get_all([bound(w, method).remote(*a) for w, a in zip(self.workers, per_worker_args, strict=True)])

    def call_rank0(self, method: Callable[Concatenate[B, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return self.call_one(0, method, *args, **kwargs)

    def call_one(self, rank: int, method: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        return ray.get(bound(self.workers[rank], method).remote(*args, **kwargs))

    def submit_each(self, method: Callable[..., Any], per_worker_args: Sequence[tuple]) -> list[Any]:
        """call_each without waiting: one ObjectRef per worker, for `wait` (another group can work meanwhile)."""
        return [bound(w, method).remote(*a) for w, a in zip(self.workers, per_worker_args, strict=True)]

    def submit_rank0(self, method: Callable[Concatenate[B, P], Any], *args: P.args, **kwargs: P.kwargs) -> Any:
        """An ObjectRef: passed to another group's `call`, the data goes actor to actor, not via the driver."""
        return bound(self.workers[0], method).remote(*args, **kwargs)

    def submit(self, method: Callable[Concatenate[B, P], Any], *args: P.args, **kwargs: P.kwargs) -> list[Any]:
        """One ObjectRef per worker (a collective every rank must join), in rank order."""
        return [bound(w, method).remote(*args, **kwargs) for w in self.workers]

    def wait(self, handles: Sequence[Any]) -> list[Any]:
        return get_all(list(handles))

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers.clear()
        if self._owns_placement:
            self.placement.remove()


def check_implements(cls: type, protocols: Sequence[type]) -> None:
    """Fail at a group's start when `cls` lacks a method of a protocol it is used through."""
    for protocol in protocols:
        missing = missing_methods(cls, protocol)
        if missing:
            raise TypeError(f"{cls.__name__} does not implement {protocol.__name__}: missing {missing}")


def wait_ready(groups: Sequence[RayWorkerGroup]) -> None:
    """Wait until every actor of these groups is constructed; the first constructor error raises at once."""
    get_all([ref for group in groups for ref in group.ready_refs()])


DEATH_GRACE_S = 10.0


def get_all(refs: list[Any]) -> list[Any]:
    """ray.get of every ref, raising the first error as soon as it happens: a dead rank surfaces at once,
    not after the collective its peers are left waiting in times out."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done)
        except RayTaskError as error:
            _raise_a_death_among(pending, error)
            raise
    return ray.get(list(refs))


def _raise_a_death_among(pending: list[Any], error: RayTaskError) -> None:
    """A rank's collective fails at once when a peer's process dies (gloo: "connection reset by peer"), a moment
    before Ray reports that death; the death is the cause worth naming, so a task error waits a short grace for
    one among the other ranks and raises it instead, chained to the error that came first."""
    deadline = time.monotonic() + DEATH_GRACE_S
    while pending and (left := deadline - time.monotonic()) > 0:
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            try:
                ray.get(ref)
            except ActorUnavailableError:  # a rank Ray cannot reach for now: not a death
                pass
            except RayActorError as death:
                raise death from error
            except RayError:  # another rank's own failure: the first error stays the one raised
                pass


def rendezvous_url(placement: Placement) -> str:
    """tcp://<ip>:<port> for a torch.distributed group: the node of rank 0's slot and a port free there,
    probed on that node (no loopback: the other ranks may be on other nodes)."""
    host, port = node_address(placement, 0)
    return f"tcp://{host}:{port}"


def node_address(placement: Placement, rank: int) -> tuple[str, int]:
    """(ip, a free port) of the node that holds `rank`'s bundle, asked on that node by a task in the bundle."""
    return ray.get(_probe_node.options(scheduling_strategy=placement.strategy(rank)).remote())


@ray.remote(num_cpus=0)
def _probe_node() -> tuple[str, int]:
    return node_ip(), free_port()


def init_ray(cfg: ClusterConfig) -> None:
    """Join `cfg.address`, or start a small local Ray (no dashboard: it costs seconds and memory)."""
    if ray.is_initialized():
        return
    env = worker_runtime_env()
    if cfg.address:
        ray.init(address=cfg.address, runtime_env=env, log_to_driver=True)
    else:
        # "local" always starts a private instance: never attach to a stray cluster found in /tmp/ray.
        # Ray runs workers at nice 15 so its driver stays responsive; here the actors do the compute and
        # the driver mostly waits, so they get normal priority (else any daemon preempts a training step)
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=True,
                 object_store_memory=cfg.object_store_mb * 1024 * 1024)
    bound_exit_on_sigterm()  # ray.init replaced the SIGTERM handler with one that has no deadline


def worker_runtime_env() -> dict:
    """Ray's runtime_env for our actors and tasks: the driver's modules (engines, user rewards) must import inside
    them, so the working directory goes on their PYTHONPATH; OpenMP settings as `omp_env`."""
    return {"env_vars": {
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
        **omp_env(),
    }}


def omp_env() -> dict[str, str]:
    """OpenMP settings for actors. Train and rollout actors take turns on the same cores: a finished
    actor's threads must go to sleep soon (else they spin on the cores the other one computes on), but
    not at once (else each of a step's thousands of small parallel regions pays a thread wake-up)."""
    env = {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "100000")}
    if "OMP_WAIT_POLICY" in os.environ:
        env["OMP_WAIT_POLICY"] = os.environ["OMP_WAIT_POLICY"]
    return env


