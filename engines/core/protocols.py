"""What a train worker, a critic worker and a rollout worker offer, and what a worker group is.

Backends declare the protocols they implement by subclassing them (as torchtitan's models do), and the
session calls them through a worker group with the protocol's method as the handle:
`train_group.call(TrainBackend.save, path)`. The group runs the backend's own method of that name on every
worker (an object in this process or a Ray actor), so a typo or a missing method is a type error or an
error at the group's start (`missing_methods`), never a string that fails mid-run.

Weight transports need more of each side; those protocols live with the transports (engines/sync/).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import torch

from rlflow.engines.core.batch import TrainBatch
from rlflow.engines.core.config import StorageConfig
from rlflow.engines.core.sampling import SamplingParams

NamedTensors = list[tuple[str, torch.Tensor]]

B = TypeVar("B", contravariant=True)
P = ParamSpec("P")
R = TypeVar("R")


class TrainBackend(Protocol):
    """One rank of the policy's train worker group (torch or Megatron). Weights at the boundary carry
    Hugging Face names; `named_tensors` and `save` are collectives where weights are sharded."""

    def forward_logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs [N, L] of the policy (or the frozen reference), aligned with input_ids."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step per mini-batch of this rank's shard; metrics of the step."""
        ...

    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """One supervised (cross-entropy) optimizer step on this rank's shard."""
        ...

    def data_parallel_rank(self) -> int:
        """Which shard of the data this rank trains on (ranks of one model-parallel group share one)."""
        ...

    def named_tensors(self, names: list[str] | None = None, dtype: torch.dtype | None = None,
                      device: torch.device | str = "cpu") -> NamedTensors:
        """HF-named weights (all, or the named ones; in `dtype` if given), full tensors on `device` at rank 0."""
        ...

    def weight_layout(self) -> list[tuple[str, int]]:
        """(HF name, bytes) of every weight in order: weight sync plans its buckets from it."""
        ...

    def weight_shapes(self) -> dict[str, list[int]]: ...

    def save(self, path: str | Path, storage: StorageConfig | None = None, background: bool = False) -> None:
        """Model, optimizer, scheduler and RNG state under `path` (safetensors + JSON, no pickle). With `storage`
        (the torch backend), `path` is a run store folder's URI that every rank writes its shards to itself.
        `background` (the torch backend; checkpoint.async_save): return once the state is in host memory, write
        it from a thread, and leave `written_rank<r>.json` in `path` when done."""
        ...

    def wait_saved(self, raise_error: bool = True) -> None:
        """Wait for this rank's background checkpoint write, if one runs (raising its error with `raise_error`)."""
        ...

    def save_state(self) -> str:
        """This rank's background checkpoint write: 'none', 'writing', 'written' or 'failed: <error>'."""
        ...

    def load(self, path: str | Path, storage: StorageConfig | None = None) -> None: ...

    def offload(self, keep_weights: bool = False) -> dict[str, float]:
        """Colocated: park this rank's optimizer state and (unless `keep_weights`: a weight sync still reads them)
        its weights in host memory, drop the gradients and give the GPU memory back, so the rollout engine
        sharing the GPU can use it. Idempotent. Returns {"bytes": moved, "seconds": ...}."""
        ...

    def onload(self) -> dict[str, float]:
        """Bring back what `offload` parked, exactly as it was, before the trainer runs again."""
        ...

    def pid(self) -> int: ...

    def num_parameters(self) -> int: ...


class TeacherBackend(Protocol):
    """A distillation teacher's rank that also gives its top-k distribution (distill.loss forward_kl / jsd)."""

    def forward_topk(self, batch: TrainBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [N, L, k], logprobs [N, L, k]): the k likeliest tokens at each position, aligned with input_ids."""
        ...


class CriticBackend(Protocol):
    """One rank of the value model's worker group (PPO with GAE)."""

    def forward_values(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token values [N, L], aligned with input_ids."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Value-loss optimizer steps on this rank's shard (returns and old values in the batch)."""
        ...

    def save(self, path: str | Path, storage: StorageConfig | None = None, background: bool = False) -> None: ...

    def wait_saved(self, raise_error: bool = True) -> None: ...

    def save_state(self) -> str: ...

    def load(self, path: str | Path, storage: StorageConfig | None = None) -> None: ...


class RewardModelBackend(Protocol):
    """One worker of a reward model's group (reward.sources of kind model): scores whole texts, a batch a call."""

    def score(self, prompts: list, responses: list[str], labels: list) -> list[float]:
        """One score per (prompt, response): the reward model's logit of its configured class."""
        ...

    def pid(self) -> int: ...


class RolloutBackend(Protocol):
    """One rollout worker: an engine behind an HTTP server that speaks SGLang's API (embedded or SGLang)."""

    def start_server(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> str:
        """Serve the engine over HTTP on `host` (port 0: any free one); returns the URL built from the address it
        bound (rollout functions reach it via the router). With `token`, its control routes require it."""
        ...

    def server_url(self) -> str | None: ...

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Any]: ...

    def update_weights(self, named_tensors: Any, version: int | None = None) -> int:
        """Load HF-named tensors (an iterable of (name, tensor)) as weight version `version`; returns bytes loaded."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of the weights a sync delivers to this worker, in its own dtype."""
        ...

    def pause_generation(self) -> None:
        """Hold generation (requests in flight keep their state) until `continue_generation`: a weight update
        under generation (rollout.max_staleness >= 2) lands whole, between decode steps."""
        ...

    def continue_generation(self) -> None: ...

    def last_update_seconds(self) -> float: ...

    def end_weight_update(self) -> None:
        """A weight update's last bucket has arrived (called once per update, after all of them): what waits for the
        whole update happens here (SGLang: the prefix cache is flushed once)."""
        ...

    def release_memory_occupation(self) -> None:
        """Give the weights' (and KV cache's) GPU memory back while a colocated trainer trains."""
        ...

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take the memory back: SGLang's kinds `tags` ('weights', 'kv_cache', 'cuda_graph'), None: all. A weight
        update takes the weights first; the session takes the rest before generating."""
        ...

    def drain_trace(self) -> list[dict]:
        """Trace events recorded since the last drain (Chrome-trace dicts)."""
        ...

    def pid(self) -> int: ...

    def close(self) -> None: ...


def missing_methods(cls: type, protocol: type) -> list[str]:
    """The protocol's methods that `cls` does not implement itself (a subclass that forgets one would
    otherwise inherit the protocol's empty body and return None)."""
    names = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    return [n for n in names if getattr(cls, n, None) is None or getattr(cls, n) is getattr(protocol, n)]


def method_name(method: Callable[..., Any]) -> str:
    """The name a worker implements `method` under, for a method of a backend class or protocol."""
    name, qualname = getattr(method, "__name__", None), getattr(method, "__qualname__", "")
    if not callable(method) or not name or "." not in qualname:
        raise TypeError(f"a worker group calls a backend's method (e.g. TrainBackend.save), got {method!r}")
    return name


def bound(worker: Any, method: Callable[..., Any]) -> Any:
    """`worker`'s own implementation of `method`: a bound method of a backend object, or the actor method of a
    Ray actor handle (Ray dispatches actor calls by name; this is the one place a name is looked up)."""
    return getattr(worker, method_name(method))


class WorkerGroup(Protocol[B]):
    """N workers of one backend type, called together: objects in this process (`LocalWorkerGroup`) or Ray
    actors (`RayWorkerGroup`), so a stage is written once for both."""

    def __len__(self) -> int: ...

    def call(self, method: Callable[Concatenate[B, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Same arguments to every worker; results in rank order."""
        ...

    def call_each(self, method: Callable[..., R], per_worker_args: Sequence[tuple]) -> list[R]:
        """Worker i gets per_worker_args[i] (e.g. its shard of a batch)."""
        ...

    def call_rank0(self, method: Callable[Concatenate[B, P], R], *args: P.args, **kwargs: P.kwargs) -> R: ...

    def call_one(self, rank: int, method: Callable[..., R], *args: Any, **kwargs: Any) -> R: ...

    def submit(self, method: Callable[Concatenate[B, P], Any], *args: P.args, **kwargs: P.kwargs) -> list[Any]:
        """Start a call on every worker (a collective every rank joins); handles in rank order."""
        ...

    def submit_each(self, method: Callable[..., Any], per_worker_args: Sequence[tuple]) -> list[Any]: ...

    def submit_rank0(self, method: Callable[Concatenate[B, P], Any], *args: P.args, **kwargs: P.kwargs) -> Any:
        """Start a call on rank 0; the handle passed to another group's call moves the result actor to actor."""
        ...

    def wait(self, handles: Sequence[Any]) -> list[Any]: ...

    def alive(self) -> list[bool]: ...

    def restart(self, rank: int) -> None: ...

    def shutdown(self) -> None: ...
