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
Transient errors (timeouts, 5xx, throttling) are retried with backoff within storage.retries and
storage.deadline_s (engines/core/retry.py, the only retry layer); anything else stops the run with a
StorageError naming the URI (a missing bucket: naming the bucket and the endpoint).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import SecretStr

from rlflow.engines.core.config import RLConfig, StorageConfig
from rlflow.engines.core.retry import RetriesExhausted

log = logging.getLogger("rlflow.store")
T = TypeVar("T")


class StorageError(RuntimeError):
    """A storage call that failed for good: the message names the URI and the reason."""


def missing_bucket(err: BaseException) -> bool:
    """s3fs reports a missing bucket as a FileNotFoundError caused by S3's NoSuchBucket."""
    seen: BaseException | None = err
    for _ in range(6):
        if seen is None:
            return False
        resp = getattr(seen, "response", None)
        if isinstance(resp, dict) and resp.get("Error", {}).get("Code") == "NoSuchBucket":
            return True
        if "NoSuchBucket" in str(seen) or "bucket does not exist" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class RunStore:
    def __init__(self, storage: StorageConfig | str, run: str, backoff_s: float = 0.5):
        storage = StorageConfig(uri=storage) if isinstance(storage, str) else storage
        self.fs, root_path = fsspec.core.url_to_fs(storage.uri, **storage.run_store_options())
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.protocol = "file" if protocol in ("file", "local") else protocol
        if self.protocol in ("s3", "s3a"):
            self.fs.retries = 1  # s3fs's own retry loop (a class attribute, 5): the policy below is the only one
        self.root = root_path.rstrip("/")
        self.run = run
        self.run_dir = f"{self.root}/{run}"
        self.endpoint = storage.endpoint_url
        self.policy = dataclasses.replace(storage.retry_policy(), backoff_s=backoff_s)

    # ---- the one place storage is called ------------------------------------------------------------
    def _call(self, what: str, path: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) under the store's RetryPolicy (the only retry layer: s3fs and botocore try once).
        A missing file stays a FileNotFoundError; every other failure is a StorageError naming the URI."""
        uri = self._uri(path)
        try:
            return self.policy.call(f"{what} {uri}", lambda: fn(*args, **kwargs))
        except FileNotFoundError as e:
            if self.protocol != "file" and missing_bucket(e):
                bucket = self.root.split("/", 1)[0]
                where = f"endpoint {self.endpoint}" if self.endpoint else "AWS S3"
                raise StorageError(
                    f"{what} {uri} failed: bucket {bucket!r} does not exist at {where} "
                    f"(storage.uri {self._uri(self.root)})"
                ) from e
            raise
        except RetriesExhausted as e:
            raise StorageError(str(e)) from e.__cause__
        except Exception as e:  # noqa: BLE001 - a permanent error: say which object and why
            raise StorageError(f"{what} {uri} failed (error): {type(e).__name__}: {e}") from e

    def probe(self) -> None:
        """Write, read back and delete a small object at the store's root: a StorageError (naming the URI) if
        the store cannot hold a run. What `rlflow validate` checks."""
        path = f"{self.root}/.rlflow-probe-{uuid.uuid4().hex[:12]}"
        if self.protocol == "file":
            self._call("mkdir", self.root, self.fs.makedirs, self.root, exist_ok=True)
        self._call("write", path, self.fs.pipe_file, path, b"rlflow")
        try:
            if self._call("read", path, self.fs.cat_file, path) != b"rlflow":
                raise StorageError(f"read {self._uri(path)}: got other bytes than were written")
        finally:
            self._call("delete", path, self.fs.rm, path)

    def _uri(self, path: str) -> str:
        return path if self.protocol == "file" else f"{self.protocol}://{path}"

    @classmethod
    def at(cls, storage: StorageConfig, uri: str) -> RunStore:
        """A store whose run folder is `uri` itself (e.g. one checkpoint, `<root>/<run>/checkpoints/<step>`):
        a worker writing or reading that folder gets the same filesystem, options and retry policy."""
        parent, name = uri.rstrip("/").rsplit("/", 1)
        return cls(storage.model_copy(update={"uri": parent}), name)

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

    def read_range(self, start: int, end: int, *parts: str | int) -> bytes:
        """Bytes [start, end) of a file: a ranged GET on object storage, so a reader fetches only its tensors."""
        path = self.path(*parts)
        return self._call("read", path, self.fs.cat_file, path, start=start, end=end)

    def upload_file(self, local: str | Path, *parts: str | int) -> None:
        """A local file into the store, streamed (s3fs: a multipart upload), retried whole on transient errors."""
        path = self.path(*parts)
        if self.protocol == "file":
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self._call("write", path, self.fs.put_file, str(local), path)

    def files(self, *parts: str | int) -> list[str]:
        """Every file under a folder, as paths relative to it ([] if there is none)."""
        path = self.path(*parts)
        if not self._call("stat", path, self.fs.exists, path):
            return []
        self.fs.invalidate_cache(path)
        return sorted(p[len(path) + 1 :] for p in self._call("list", path, self.fs.find, path))

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
        self.begin_checkpoint(step)
        for f in sorted(Path(local_dir).rglob("*")):
            if f.is_file():
                self.write_bytes(f.read_bytes(), "checkpoints", step, f.relative_to(local_dir).as_posix())
        return self.finish_checkpoint(step, meta)

    def begin_checkpoint(self, step: int) -> str:
        """Clear the step's folder (a torn attempt at this step is replaced whole); returns its URI, where the
        workers then write their shards straight (fsdp.save_checkpoint through fsspec)."""
        self.remove("checkpoints", step)
        return self.uri("checkpoints", step)

    def finish_checkpoint(self, step: int, meta: dict) -> str:
        """meta.json, then COMMITTED, then `latest`: called by the driver only after every worker's save returned,
        so a checkpoint whose shards are partly written never has its marker. Returns its URI."""
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


def workers_write_checkpoints(cfg: RLConfig) -> bool:
    """Whether the train workers write (and read back) checkpoints straight in the run store: on object storage
    (both backends: the torch one through DCP, megatron's ranks each uploading their own files). A local store
    keeps the driver's staged folder, uploaded after the save (same files)."""
    return fsspec.utils.get_protocol(cfg.storage.uri) not in ("file", "local")


def worker_storage(storage: StorageConfig) -> StorageConfig:
    """The storage settings the train workers reach the run store with: the driver's own credentials when the
    recipe names none (workers on other nodes, or under a Ray started elsewhere, lack the driver's AWS_*
    environment). Kept in memory and sent only to the run's workers; never persisted (stored_config drops them)."""
    if storage.key or storage.profile or not storage.uri.startswith(("s3://", "s3a://")):
        return storage
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not (key and secret):
        return storage  # the workers' own environment or instance role
    return storage.model_copy(update={"key": SecretStr(key), "secret": SecretStr(secret),
                                      "region": storage.region or os.environ.get("AWS_DEFAULT_REGION")})


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
