"""The run store: everything a run needs to resume, on any fsspec filesystem (local path, file://, s3://).

Layout (see docs/architecture.md):
    <root>/<run>/RUN                              written when the run is created: its name and a creation id
    <root>/<run>/LEASE                            the process writing the run (engines/store/lease.py)
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

A run's folder is always one level inside the root (a name such as `..` is refused here, whatever validated it
before), and nothing is deleted by listing a run's folder unless its RUN marker says the folder is that run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import SecretStr

from rlflow.engines.core.config import RLConfig, StorageConfig
from rlflow.engines.core.images import image_digest
from rlflow.engines.core.retry import RetriesExhausted, ServiceError

log = logging.getLogger("rlflow.store")
T = TypeVar("T")


class StorageError(ServiceError):
    """A storage call that failed for good: the message names the URI and the reason."""


class RunNameError(StorageError, ValueError):
    """A run name that would put the run's folder anywhere but directly inside the store's root."""


class NotThisRun(StorageError):
    """A run folder this store cannot prove is the run's own (no RUN marker of that name): never written to by
    `claim`, never cleaned."""


class Conflict(Exception):
    """A conditional write lost to another writer: the file changed between its read and the write."""


MARKER = "RUN"
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}


def lost_a_race(err: BaseException) -> bool:
    """Whether a failed conditional write means another writer came first: S3's 412 PreconditionFailed (s3fs: an
    OSError, or FileExistsError for If-None-Match), 409 ConditionalRequestConflict, or the file gone (If-Match on a
    deleted key)."""
    seen: BaseException | None = err
    for _ in range(6):
        if seen is None:
            return False
        if isinstance(seen, FileExistsError | FileNotFoundError):
            return True
        resp = getattr(seen, "response", None)
        if isinstance(resp, dict) and str(resp.get("Error", {}).get("Code", "")) in _CONFLICT_CODES:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def check_run_name(root: str, run: str, protocol: str, uri: str) -> None:
    """Refuse a run name whose folder would not be strictly inside the store's root: empty, `.`, `..`, a path
    separator, or (local stores) a folder that resolves elsewhere through a symlink. The config validates `name`
    too; this check holds for every caller that builds a store, whatever it validated."""
    problem = None
    if run in ("", ".", "..") or any(c in run for c in ("/", "\\", "\0")):
        problem = "is not a single folder name"
    elif protocol == "file":
        real_root = os.path.realpath(root)
        if os.path.dirname(os.path.realpath(f"{root}/{run}")) != real_root:
            problem = f"resolves to {os.path.realpath(f'{root}/{run}')}, not a folder of {real_root}"
    if problem:
        raise RunNameError(f"name: run name {run!r} {problem}: a run's folder must be directly inside the run "
                           f"store (storage.uri {uri})")


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
        check_run_name(self.root, run, self.protocol, storage.uri)
        self.run = run
        self.run_dir = f"{self.root}/{run}"
        self.endpoint = storage.endpoint_url
        self.policy = dataclasses.replace(storage.retry_policy(), backoff_s=backoff_s)
        self._marker: dict | None = None  # this run's RUN marker, once read or written

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

    # ---- the run's own folder: its marker, and files that concurrent processes contend for ------------------
    def claim(self) -> dict:
        """Make this folder the run's, or prove it is: the RUN marker (JSON: run name, creation id and time) is
        written when the folder holds nothing yet, read back when it is there. A folder of an earlier version
        (no marker, a config.json naming this run) is adopted and given one. Anything else is a NotThisRun naming
        the folder, raised before anything is written there: the folder was not made by this run, and nothing
        here writes into it or cleans it."""
        before = self.read_json(MARKER) if self.exists(MARKER) else None
        self._new_marker(before)  # a folder that is not this run's is refused before anything is written into it
        self._marker = self.update_json(self._new_marker, MARKER)
        if before is None and self._marker.get("adopted"):
            log.warning("run folder %s had no %s marker (made before rlflow wrote one): adopted as run %r, "
                        "its config.json naming it", self.uri(), MARKER, self.run)
        return self._marker

    def _new_marker(self, marker: dict | None) -> dict | None:
        """The marker to write over `marker` (the one there, or None): None to keep it, else a new one."""
        if marker is not None:
            if marker.get("run") != self.run:
                raise NotThisRun(f"{self.uri(MARKER)} belongs to run {marker.get('run')!r}, not {self.run!r}")
            return None
        made = {"run": self.run, "id": uuid.uuid4().hex,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        others = sorted(set(self._list()) - {MARKER, f"{MARKER}.lock", "LEASE", "LEASE.lock"})
        if not others:
            return made
        stored = self.read_json("config.json") if "config.json" in others else {}
        if isinstance(stored, dict) and stored.get("name") == self.run:
            return made | {"adopted": True}
        raise NotThisRun(
            f"name: {self.uri()} holds {', '.join(others[:5])}{' ...' if len(others) > 5 else ''} but no {MARKER} "
            f"marker of run {self.run!r} (nor a config.json naming it): not a run folder, so rlflow neither writes "
            f"into nor cleans it (storage.uri {self._uri(self.root)})")

    def require_marker(self) -> None:
        """Before a delete that lists the run's folder to find what to delete: the folder must carry this run's
        RUN marker (claim writes it), else a NotThisRun naming the folder and nothing is deleted."""
        if self._marker is not None:
            return
        marker = self.read_json(MARKER) if self.exists(MARKER) else None
        if not isinstance(marker, dict) or marker.get("run") != self.run:
            raise NotThisRun(f"refusing to delete anything in {self.uri()}: it has no {MARKER} marker of run "
                             f"{self.run!r} (a folder that is not provably this run's is never cleaned)")
        self._marker = marker

    def update_json(self, change: Callable[[Any], Any], *parts: str | int, attempts: int = 8) -> Any:
        """Read-modify-write of a small JSON file that several processes may contend for (RUN, LEASE):
        `change(current or None)` returns the new content (None: keep the current one; raise: leave it and say why),
        written only if the file did not change since it was read, else read and decided again. Returns what the
        file then holds.

        Local stores hold an exclusive flock on `<file>.lock` over the read and the write (also between hosts
        sharing an NFS mount with working locks). Object stores write conditionally: on S3 `If-None-Match: *` to
        create and `If-Match: <ETag read>` to replace (AWS S3, MinIO and moto honour both); every remote write is
        then read back, which catches a server that ignores the conditions, except for two writers whose writes
        both land between the other's read and read-back (a window of one round trip)."""
        path = self.path(*parts)
        for _ in range(attempts):
            with self._file_lock(path):
                current, version = self._read_versioned(path)
                new = change(current)
                if new is None:
                    return current
                try:
                    self._write_if_unchanged(path, json.dumps(new, indent=1, sort_keys=True).encode(), version)
                except Conflict:
                    continue
                if self.protocol == "file" or self._read_versioned(path)[0] == new:
                    return new
        raise StorageError(f"update {self._uri(path)}: {attempts} attempts in a row lost to other writers")

    @contextlib.contextmanager
    def _file_lock(self, path: str) -> Iterator[None]:
        if self.protocol != "file":
            yield
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read_versioned(self, path: str) -> tuple[Any, str | None]:
        """(parsed JSON or None if absent, the version a conditional write compares: S3's ETag, else None). The
        ETag is read before the body: a body newer than it makes the conditional write fail, never succeed."""
        if self.protocol in ("s3", "s3a"):
            try:
                etag = self._call("stat", path, self.fs.info, path, refresh=True).get("ETag")
            except FileNotFoundError:
                return None, None
        elif not self._call("stat", path, self.fs.exists, path):
            return None, None
        else:
            etag = None
        try:
            data = self._call("read", path, self.fs.cat_file, path)
        except FileNotFoundError:
            return None, None
        try:
            return json.loads(data), etag
        except ValueError as e:
            raise StorageError(f"{self._uri(path)}: not JSON ({e}); expected the file rlflow writes there") from None

    def _write_if_unchanged(self, path: str, data: bytes, version: str | None) -> None:
        if self.protocol == "file":  # under the flock: write a new file and move it over, so readers never see half
            tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            return
        condition = {}
        if self.protocol in ("s3", "s3a"):
            condition = {"IfMatch": version} if version else {"IfNoneMatch": "*"}
        try:
            self._call("write", path, self.fs.pipe_file, path, data, **condition)
        except FileNotFoundError as e:  # If-Match on a key deleted since it was read
            raise Conflict from e
        except StorageError as e:
            if lost_a_race(e):
                raise Conflict from e
            raise
        finally:
            self.fs.invalidate_cache(path)

    def _list(self, *parts: str | int) -> list[str]:
        path = self.path(*parts)
        if not self._call("stat", path, self.fs.exists, path):
            return []
        self.fs.invalidate_cache(path)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in self._call("list", path, self.fs.ls, path, detail=False)]

    # ---- images of vision-language prompts: stored once, by content ---------------------------------------
    image_digest = staticmethod(image_digest)  # an image's key (engines/models/vision_language.py)

    def put_image(self, data: bytes) -> str:
        """Store an image's encoded bytes at `images/<digest>` unless they are there already; its digest."""
        digest = self.image_digest(data)
        if not self.exists("images", digest):
            self.write_bytes(data, "images", digest)
        return digest

    def get_image(self, digest: str) -> bytes:
        """An image's encoded bytes by digest; a StorageError naming the digest and the run when it is not stored."""
        try:
            return self.read_bytes("images", digest)
        except FileNotFoundError as e:
            raise StorageError(f"image {digest} is not in the run store ({self.uri('images')}): the rollout "
                               "batch names an image this run never stored") from e

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
        """Delete checkpoints and rollout batches that never got their COMMITTED marker: only in a folder that
        carries this run's RUN marker (require_marker)."""
        self.require_marker()
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
        self.require_marker()
        steps = self.committed_steps()
        doomed = steps[: max(len(steps) - max(keep_last, 1), 0)]
        for s in doomed:
            self.remove("checkpoints", s)
        return doomed

    def prune_rollouts(self, before_step: int) -> None:
        """Rollout batches older than the newest checkpoint are never read again on resume."""
        self.require_marker()
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
    """Every run under a store root with its latest committed step and whether it finished. A root that is not
    there is a StorageError naming it: a local folder that does not exist, or a bucket (an S3 prefix without
    objects is an empty store: S3 has no folders)."""
    probe = RunStore(storage, "_")
    try:  # _call names a missing bucket and its endpoint
        names = probe._call("list", probe.root, probe.fs.ls, probe.root, detail=False)
    except FileNotFoundError as e:
        if probe.protocol == "file":
            raise StorageError(f"run store {probe._uri(probe.root)}: no such folder (storage.uri: the folder that "
                               "holds the runs)") from e
        return []
    out = []
    for p in names:
        name = p.rstrip("/").rsplit("/", 1)[-1]
        try:
            store = RunStore(storage, name)
        except RunNameError:  # e.g. a symlink out of a local store: not a run here
            continue
        if not store.exists("config.json"):
            continue
        latest = store.latest_step()
        status = store.read_json("status.json") if store.exists("status.json") else {"status": "unknown"}
        out.append({"run": name, "latest_step": latest, **status})
    return out


def replay_storage(cfg: RLConfig) -> StorageConfig:
    """The storage of the run whose rollout batches this run replays: debug.replay_store, with storage's endpoint
    and credentials, or storage itself."""
    return cfg.storage.model_copy(update={"uri": cfg.debug.replay_store}) if cfg.debug.replay_store else cfg.storage


def replay_source(cfg: RLConfig) -> RunStore | None:
    """The store of the run whose rollout batches this run replays (debug.replay_run), checked to exist."""
    d = cfg.debug
    if not d.replay_run:
        return None
    storage = replay_storage(cfg)
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
