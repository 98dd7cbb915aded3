"""The run store: everything a run needs to resume, on any fsspec filesystem (local path, file://, s3://).

Layout (see docs/architecture.md):
    <root>/<run>/config.json
    <root>/<run>/steps/<step>/rollout.parquet     the step's generated samples
    <root>/<run>/steps/<step>/COMMITTED           written after rollout.parquet
    <root>/<run>/checkpoints/<step>/...           worker state, meta.json
    <root>/<run>/checkpoints/<step>/COMMITTED     written last: a checkpoint without it does not exist
    <root>/<run>/latest                           newest committed step, written after COMMITTED
    <root>/<run>/rounds/<round>/samples.parquet   rejection sampling: a round's scored samples (+ COMMITTED)
Object stores have no rename, so everything is committed by writing a marker last, never by moving.
Transient errors (timeouts, 5xx, throttling) are retried with backoff; anything else stops the run
with a StorageError naming the URI.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from rlflow.engines.core.config import RLConfig, StorageConfig

log = logging.getLogger("rlflow.store")
T = TypeVar("T")

TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                   "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "503", "500"}
TRANSIENT_TYPES = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                   "ServerDisconnectedError", "ClientOSError", "ResponseStreamingError"}


class StorageError(RuntimeError):
    """A storage call that failed for good: the message names the URI and the reason."""


def is_transient(err: BaseException, _depth: int = 0) -> bool:
    """Timeouts, connection drops, 5xx and throttling are worth retrying; missing files and denials are not."""
    if isinstance(err, TimeoutError | ConnectionError):
        return True
    if any(c.__name__ in TRANSIENT_TYPES for c in type(err).__mro__):
        return True
    resp = getattr(err, "response", None)
    if isinstance(resp, dict):
        code = str(resp.get("Error", {}).get("Code", ""))
        status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or code in TRANSIENT_CODES
    cause = err.__cause__ or err.__context__
    return _depth < 5 and cause is not None and is_transient(cause, _depth + 1)


class RunStore:
    def __init__(self, storage: StorageConfig | str, run: str, backoff_s: float = 0.5):
        storage = StorageConfig(uri=storage) if isinstance(storage, str) else storage
        self.fs, root_path = fsspec.core.url_to_fs(storage.uri, **storage.fsspec_options())
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.protocol = "file" if protocol in ("file", "local") else protocol
        self.root = root_path.rstrip("/")
        self.run = run
        self.run_dir = f"{self.root}/{run}"
        self.retries, self.backoff_s = storage.retries, backoff_s

    # ---- the one place storage is called ------------------------------------------------------------
    def _call(self, what: str, path: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        for attempt in range(self.retries + 1):
            try:
                return fn(*args, **kwargs)
            except FileNotFoundError:
                raise
            except Exception as e:  # noqa: BLE001 - classified below
                if not is_transient(e) or attempt == self.retries:
                    kind = "transient error, retries exhausted" if is_transient(e) else "error"
                    raise StorageError(f"{what} {self._uri(path)} failed ({kind}): {type(e).__name__}: {e}") from e
                delay = self.backoff_s * 2**attempt
                log.warning("%s %s: %s; retry %d/%d in %.1fs", what, self._uri(path), e, attempt + 1,
                            self.retries, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _uri(self, path: str) -> str:
        return path if self.protocol == "file" else f"{self.protocol}://{path}"

    # ---- paths and small files -----------------------------------------------------------------------
    def path(self, *parts: str | int) -> str:
        return "/".join([self.run_dir, *map(str, parts)])

    def uri(self, *parts: str | int) -> str:
        return self._uri(self.path(*parts))

    def exists(self, *parts: str | int) -> bool:
        path = self.path(*parts)
        return self._call("stat", path, self.fs.exists, path)

    def write_bytes(self, data: bytes, *parts: str | int) -> None:
        path = self.path(*parts)
        if self.protocol == "file":
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self._call("write", path, self.fs.pipe_file, path, data)

    def read_bytes(self, *parts: str | int) -> bytes:
        path = self.path(*parts)
        return self._call("read", path, self.fs.cat_file, path)

    def write_json(self, obj: Any, *parts: str | int) -> None:
        self.write_bytes(json.dumps(obj, indent=1, sort_keys=True).encode(), *parts)

    def read_json(self, *parts: str | int) -> Any:
        return json.loads(self.read_bytes(*parts))

    def remove(self, *parts: str | int) -> None:
        path = self.path(*parts)
        if self._call("stat", path, self.fs.exists, path):
            self._call("delete", path, self.fs.rm, path, recursive=True)

    def _list(self, *parts: str | int) -> list[str]:
        path = self.path(*parts)
        if not self._call("stat", path, self.fs.exists, path):
            return []
        self.fs.invalidate_cache(path)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in self._call("list", path, self.fs.ls, path, detail=False)]

    # ---- rollout batches -----------------------------------------------------------------------------
    def save_rollout(self, step: int, table: pa.Table) -> str:
        """Write the step's samples, then its marker. Returns the parquet URI."""
        buf = io.BytesIO()
        pq.write_table(table, buf)
        self.write_bytes(buf.getvalue(), "steps", step, "rollout.parquet")
        self.write_bytes(b"", "steps", step, "COMMITTED")
        return self.uri("steps", step, "rollout.parquet")

    def load_rollout(self, step: int) -> pa.Table | None:
        """The committed samples of `step`, or None (a parquet without its marker is a torn write)."""
        if not self.exists("steps", step, "COMMITTED"):
            return None
        return pq.read_table(io.BytesIO(self.read_bytes("steps", step, "rollout.parquet")))

    # ---- rejection-sampling rounds -------------------------------------------------------------------
    def save_round(self, rnd: int, table: pa.Table) -> str:
        """A rejection-sampling round's scored samples, then its marker. Kept for the whole run: later rounds
        (and a resumed run) train on what earlier rounds accepted."""
        buf = io.BytesIO()
        pq.write_table(table, buf)
        self.write_bytes(buf.getvalue(), "rounds", rnd, "samples.parquet")
        self.write_bytes(b"", "rounds", rnd, "COMMITTED")
        return self.uri("rounds", rnd, "samples.parquet")

    def load_round(self, rnd: int) -> pa.Table | None:
        if not self.exists("rounds", rnd, "COMMITTED"):
            return None
        return pq.read_table(io.BytesIO(self.read_bytes("rounds", rnd, "samples.parquet")))

    # ---- checkpoints ---------------------------------------------------------------------------------
    def commit_checkpoint(self, step: int, local_dir: str | Path, meta: dict) -> str:
        """Upload a checkpoint written in `local_dir`, then COMMITTED, then `latest`. Returns its URI."""
        self.remove("checkpoints", step)  # a torn attempt at this step: replace it whole
        for f in sorted(Path(local_dir).rglob("*")):
            if f.is_file():
                self.write_bytes(f.read_bytes(), "checkpoints", step, f.relative_to(local_dir).as_posix())
        self.write_json(meta, "checkpoints", step, "meta.json")
        self.write_bytes(str(step).encode(), "checkpoints", step, "COMMITTED")
        self.write_bytes(str(step).encode(), "latest")
        return self.uri("checkpoints", step)

    def committed_steps(self) -> list[int]:
        names = self._list("checkpoints")
        return sorted(int(n) for n in names if n.isdigit() and self.exists("checkpoints", n, "COMMITTED"))

    def latest_step(self) -> int | None:
        """The newest committed checkpoint (`latest` is a hint; COMMITTED markers are the truth)."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def committed_step(self, step: int | None = None) -> int:
        """`step` (None: the newest) if it is a committed checkpoint, else a StorageError listing the steps there
        are, so a user who asked for a missing one sees what to ask for."""
        committed = self.committed_steps()
        if committed and (step is None or step in committed):
            return committed[-1] if step is None else step
        where = self.uri("checkpoints")
        if not committed:
            missing = "" if self.exists("config.json") else f" (no run {self.run!r} here: no {self.uri('config.json')})"
            raise StorageError(f"run {self.run!r} has no committed checkpoint in {where}{missing}")
        torn = " (it was started but never committed)" if self.exists("checkpoints", step) else ""
        raise StorageError(f"run {self.run!r} has no committed checkpoint at step {step}{torn}; committed steps in "
                           f"{where}: {', '.join(map(str, committed))}")

    def clean_torn(self) -> list[str]:
        """Delete checkpoints and rollout batches that never got their COMMITTED marker."""
        removed = []
        for kind in ("checkpoints", "steps", "rounds"):
            for name in self._list(kind):
                if not self.exists(kind, name, "COMMITTED"):
                    self.remove(kind, name)
                    removed.append(f"{kind}/{name}")
        return removed

    def download_checkpoint(self, step: int, local_dir: str | Path, only: str | None = None) -> Path:
        """Copy a checkpoint (or only its subfolder `only`, e.g. "model") into `local_dir`."""
        local_dir = Path(local_dir)
        src = self.path("checkpoints", step, *([only] if only else []))
        for p in self._call("list", src, self.fs.find, src):
            rel = p[len(src) + 1 :]
            (local_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (local_dir / rel).write_bytes(self._call("read", p, self.fs.cat_file, p))
        return local_dir

    def export_model(self, step: int, local_dir: str | Path) -> Path:
        """The checkpoint's Hugging Face export (model/: safetensors, config, tokenizer) as a local directory
        that AutoModelForCausalLM.from_pretrained loads."""
        return self.download_checkpoint(self.committed_step(step), local_dir, only="model")

    def prune(self, keep_last: int) -> list[int]:
        """Delete all but the newest `keep_last` committed checkpoints; never the newest one."""
        steps = self.committed_steps()
        doomed = steps[: max(len(steps) - max(keep_last, 1), 0)]
        for s in doomed:
            self.remove("checkpoints", s)
        return doomed

    def prune_rollouts(self, before_step: int) -> None:
        """Rollout batches older than the newest checkpoint are never read again on resume."""
        for name in self._list("steps"):
            if name.isdigit() and int(name) <= before_step:
                self.remove("steps", name)


def list_runs(storage: StorageConfig | str) -> list[dict]:
    """Every run under a store root with its latest committed step and whether it finished."""
    probe = RunStore(storage, "_")
    if not probe._call("stat", probe.root, probe.fs.exists, probe.root):
        return []
    out = []
    for p in probe._call("list", probe.root, probe.fs.ls, probe.root, detail=False):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        store = RunStore(storage, name)
        if not store.exists("config.json"):
            continue
        latest = store.latest_step()
        status = store.read_json("status.json") if store.exists("status.json") else {"status": "unknown"}
        out.append({"run": name, "latest_step": latest, **status})
    return out


def replay_source(cfg: RLConfig) -> RunStore | None:
    """The store of the run whose rollout batches this run replays (debug.replay_run), checked to exist."""
    d = cfg.debug
    if not d.replay_run:
        return None
    storage = cfg.storage.model_copy(update={"uri": d.replay_store}) if d.replay_store else cfg.storage
    store = RunStore(storage, d.replay_run)
    if not store.exists("config.json"):
        raise FileNotFoundError(f"debug.replay_run: no run {d.replay_run!r} in store {storage.uri} "
                                f"(no {store.uri('config.json')})")
    return store


def locate_checkpoint(uri: str, storage: StorageConfig) -> tuple[RunStore, int]:
    """`<store>/<run>/checkpoints/<step>` or `<store>/<run>` (its newest committed step) -> (run store, step).

    `storage` gives the endpoint and credentials; its uri is replaced by the one in `uri`."""
    text = uri.rstrip("/")
    step: int | None = None
    if "/checkpoints/" in text:
        text, tail = text.rsplit("/checkpoints/", 1)
        if not tail.isdigit():
            raise StorageError(f"{uri}: expected <store>/<run>/checkpoints/<step>, step {tail!r} is not a number")
        step = int(tail)
    if "/" not in text.split("://", 1)[-1]:
        raise StorageError(f"{uri}: expected <store>/<run>[/checkpoints/<step>]")
    root, run = text.rsplit("/", 1)
    store = RunStore(storage.model_copy(update={"uri": root}), run)
    try:
        return store, store.committed_step(step)
    except StorageError as e:
        raise StorageError(f"{uri}: {e}") from None
