"""The checkpoint stage's work on the engines: every worker saves or loads its own state (the policy's, the
critic's), the tokenizer goes beside the model, and the controller state (data cursor, weight version, adaptive
KL coefficient) is returned to store beside them. The commit protocol is the run store's (tasks/run_context.py,
engines/store/run_store.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from rlflow.engines.core.config import StorageConfig
from rlflow.engines.core.protocols import CriticBackend, TrainBackend, WorkerGroup
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.store.run_store import RunStore


def save(s: RunEngines, path: str | Path, step: int, storage: StorageConfig | None = None, background: bool = False
         ) -> dict:
    """Every worker saves its state into `path`; returns the controller state to store beside it.

    With `storage`, `path` is the checkpoint's folder in that run store (s3:// too) and every worker writes
    there itself (tasks/run_context.py commits it after this returns). The cursor is saved as it was after
    `step` took its prompts: with asynchronous training (rollout.max_staleness) later steps have already
    taken their own, and a resumed run reuses their batches from the store. `background`
    (checkpoint.async_save): the workers return once their state is in host memory and write it from threads,
    each leaving one of `written_markers()` when done."""
    s.gpu.resident()  # the next rollout parks the state again
    how = {"background": True} if background else {}
    s.train_group.call(TrainBackend.save, *worker_target(path, "", storage), **how)
    save_tokenizer(s.tokenizer, path, storage, s.vision.image_processor if s.vision else None)
    if s.critic_group is not None:
        s.critic_group.call(CriticBackend.save, *worker_target(path, "critic", storage), **how)
    state = s.prompts.state_after(step) | {"weight_version": s.weight_version}
    if s.cfg.algorithm.kl_ctrl == "adaptive":  # the controller's state: resume must continue from it
        state["kl_coef"] = s.kl_coef
    return state


def written_markers(s: RunEngines) -> list[str]:
    """The files a background save leaves in the checkpoint's folder, one a worker, once its write is done
    (fsdp.BackgroundSave); a worker whose write failed leaves the same name with `failed` for `written`."""
    critic = len(s.critic_group) if s.critic_group is not None else 0
    return ([f"written_rank{r}.json" for r in range(len(s.train_group))]
            + [f"critic/written_rank{r}.json" for r in range(critic)])


def drain_saves(s: RunEngines) -> None:
    """Wait for every worker's background checkpoint write to end (a failure was reported by its marker)."""
    for group, protocol in _savers(s):
        group.call(protocol.wait_saved, raise_error=False)


def save_problem(s: RunEngines) -> str | None:
    """Why a background checkpoint's markers may never all come, asked while the run waits for them: a worker
    gone, or a writer that failed (its own marker may be what failed). None while they may still come."""
    try:
        states = [state for group, protocol in _savers(s) for state in group.call(protocol.save_state)]
    except Exception as exc:  # a dead actor's call raises
        return f"a worker is gone ({type(exc).__name__}: {exc})"
    failed = [state for state in states if state.startswith("failed")]
    return failed[0] if failed else None


def _savers(s: RunEngines) -> list[tuple[WorkerGroup, type]]:
    """The worker groups that write checkpoints, each with its protocol: the policy's, and the critic's."""
    critic = [(s.critic_group, CriticBackend)] if s.critic_group is not None else []
    return [(s.train_group, TrainBackend), *critic]


def load(s: RunEngines, path: str | Path, controller_state: dict, storage: StorageConfig | None = None) -> None:
    """Every worker loads its state from `path` (with `storage`: straight from that run store's folder)."""
    s.gpu.resident()
    s.train_group.call(TrainBackend.load, *worker_target(path, "", storage))
    if s.critic_group is not None:
        s.critic_group.call(CriticBackend.load, *worker_target(path, "critic", storage))
    s.prompts.load_state(controller_state)
    s.weight_version = controller_state["weight_version"]
    s.kl_coef = controller_state.get("kl_coef", s.cfg.algorithm.kl_coef)
    if s.weight_transport is not None:
        # by the transport's own route, connecting first as at a run's first sync: not through Ray's object
        # store, where 1.5B's fp32 weights were one 6 GB object, spilled to disk (2.5 min, bench/gpu_fault.py)
        s.weight_transport.update(s.weight_version)
        s.fresh_adapter_due = False  # the checkpoint's adapter is served


def worker_target(path: str | Path, sub: str, storage: StorageConfig | None) -> tuple:
    """The arguments of a worker's save/load: a local folder, or a run store folder's URI and the storage
    settings the worker reaches it with (endpoint, credentials)."""
    target = f"{str(path).rstrip('/')}/{sub}" if sub else str(path)
    return (target,) if storage is None else (target, storage)


def save_tokenizer(tokenizer, path: str | Path, storage: StorageConfig | None, image_processor=None) -> None:
    """The tokenizer's files (and a vision-language model's image processor config) into the checkpoint's model/
    (uploaded when the checkpoint is in a run store), so model/ loads with transformers as it is."""
    parts = [tokenizer] + ([image_processor] if image_processor is not None else [])
    if storage is None:
        for part in parts:
            part.save_pretrained(Path(path) / "model")
        return
    store = RunStore.at(storage, str(path))
    with tempfile.TemporaryDirectory(prefix="rlflow-tokenizer-") as tmp:
        files = [f for part in parts for f in part.save_pretrained(tmp)]
        for f in dict.fromkeys(map(str, files)):
            store.upload_file(f, "model", Path(f).name)
