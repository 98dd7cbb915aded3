"""The run store: everything a run needs to resume, on any fsspec filesystem (local path, file://, s3://).

Layout (see docs/architecture.md):
    <root>/<run>/config.json
    <root>/<run>/checkpoints/<step>/...           worker state, controller.json
    <root>/<run>/checkpoints/<step>/COMMITTED     written last: a checkpoint without it does not exist
    <root>/<run>/latest                           newest committed step, written after COMMITTED
Object stores have no rename, so a checkpoint is committed by writing a marker last, never by moving.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fsspec


class RunStore:
    def __init__(self, root: str, run: str, storage_options: dict[str, Any] | None = None):
        self.fs, root_path = fsspec.core.url_to_fs(root, **(storage_options or {}))
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.root = root_path.rstrip("/")
        self.run = run
        self.run_dir = f"{self.root}/{run}"

    # ---- paths and small files -----------------------------------------------------------------------
    def path(self, *parts: str | int) -> str:
        return "/".join([self.run_dir, *map(str, parts)])

    def uri(self, *parts: str | int) -> str:
        p = self.path(*parts)
        return p if self.protocol in ("file", "local") else f"{self.protocol}://{p}"

    def exists(self, *parts: str | int) -> bool:
        return self.fs.exists(self.path(*parts))

    def write_text(self, text: str, *parts: str | int) -> None:
        path = self.path(*parts)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(path, "w") as f:
            f.write(text)

    def read_text(self, *parts: str | int) -> str:
        with self.fs.open(self.path(*parts), "r") as f:
            return f.read()

    def write_json(self, obj: Any, *parts: str | int) -> None:
        self.write_text(json.dumps(obj, indent=1, sort_keys=True), *parts)

    def read_json(self, *parts: str | int) -> Any:
        return json.loads(self.read_text(*parts))

    # ---- checkpoints ---------------------------------------------------------------------------------
    def commit_checkpoint(self, step: int, local_dir: str | Path, meta: dict) -> str:
        """Upload a checkpoint written in `local_dir`, then COMMITTED, then `latest`. Returns its URI."""
        target = self.path("checkpoints", step)
        if self.fs.exists(target):  # a torn attempt at this step: replace it whole
            self.fs.rm(target, recursive=True)
        self.fs.makedirs(target, exist_ok=True)
        for f in sorted(Path(local_dir).rglob("*")):
            if f.is_file():
                rel = f.relative_to(local_dir).as_posix()
                self.fs.makedirs(f"{target}/{rel}".rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(str(f), f"{target}/{rel}")
        self.write_json(meta, "checkpoints", step, "meta.json")
        self.write_text(str(step), "checkpoints", step, "COMMITTED")
        self.write_text(str(step), "latest")
        return self.uri("checkpoints", step)

    def committed_steps(self) -> list[int]:
        base = self.path("checkpoints")
        if not self.fs.exists(base):
            return []
        steps = []
        for p in self.fs.ls(base, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            if name.isdigit() and self.fs.exists(f"{base}/{name}/COMMITTED"):
                steps.append(int(name))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest committed checkpoint (`latest` is a hint; COMMITTED markers are the truth)."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def download_checkpoint(self, step: int, local_dir: str | Path) -> Path:
        local_dir = Path(local_dir)
        src = self.path("checkpoints", step)
        for p in self.fs.find(src):
            rel = p[len(src) + 1 :]
            (local_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(p, str(local_dir / rel))
        return local_dir

    def prune(self, keep_last: int) -> list[int]:
        """Delete all but the newest `keep_last` committed checkpoints; never the newest one."""
        steps = self.committed_steps()
        doomed = steps[: max(len(steps) - max(keep_last, 1), 0)]
        for s in doomed:
            self.fs.rm(self.path("checkpoints", s), recursive=True)
        return doomed
