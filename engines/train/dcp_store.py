"""torch.distributed.checkpoint storage straight into the run store (any fsspec filesystem: file://, s3://).

Why not torch's own classes: HuggingFaceStorageWriter/Reader write safetensors with the sharding offsets in
each file's header (so no pickled `.metadata` is ever written or read), but they are bound to local files (the
reader opens each file with safetensors' `safe_open`, which takes a local path). FsspecWriter/FsspecReader
reach any fsspec URL, but their format is DCP's default: one pickled `.metadata` per checkpoint. Here the HF
storage keeps its format and planning, and only the file access goes through a RunStore:
- every write is one `pipe_file` of the finished safetensors bytes, under the store's RetryPolicy (the one
  retry layer: engines/core/retry.py), so a transient S3 error re-sends the file, never half of it;
- a read fetches the file's safetensors header, then only the byte ranges of the tensors this rank's plan
  needs (ranged GETs), so a rank of a different world size reads just the slices of its new shards.
Nothing here commits: the driver writes the checkpoint's COMMITTED marker after every rank returned.
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Generator
from contextlib import contextmanager

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import (
    CUSTOM_METADATA_KEY,
    DEFAULT_EXTRA_METADATA_KEY,
    SAVED_OFFSETS_KEY,
    SUFFIX,
    _get_dtype,
    _HFStorageInfo,
)
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from rlflow.engines.store.run_store import RunStore

_HEADER_LEN = 8  # safetensors: a little-endian u64 header length, the JSON header, then the data


class _Upload(io.BytesIO):
    """DCP closes the stream it wrote before leaving create_stream: keep the bytes for the upload."""

    data = b""

    def close(self) -> None:
        if not self.closed:
            self.data = self.getvalue()
        super().close()


class StoreFileSystem(FileSystemBase):
    """DCP's file access as RunStore calls; DCP's paths are relative to the store's folder."""

    def __init__(self, store: RunStore):
        self.store = store

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "r" in mode:
            yield io.BytesIO(self.store.read_bytes(str(path)))
            return
        buf = _Upload()
        yield buf
        buf.close()
        self.store.write_bytes(buf.data, str(path))

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{path}/{suffix}" if str(path) else suffix

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise NotImplementedError("the run store commits with markers, never by renaming")

    def mkdir(self, path: str | os.PathLike) -> None:
        """Object stores have no folders; the store makes local ones as it writes."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def exists(self, path: str | os.PathLike) -> bool:
        return self.store.exists(str(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.store.remove(str(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        return [self.concat_path(path, f) for f in self.store.files(str(path)) if "/" not in f]


class StoreWriter(HuggingFaceStorageWriter):
    """HuggingFaceStorageWriter (save_distributed: every rank writes `shard-<rank>-model-*.safetensors`, offsets in
    the header, no metadata file) into the folder `folder` of `store`."""

    def __init__(self, store: RunStore, folder: str):
        super().__init__(folder, save_distributed=True)
        self.fs = StoreFileSystem(store)
        self.path = folder
        self.sync_files = False  # a BytesIO has no fd: DCP would os.sync() the whole host; the upload is the commit


class StoreReader(HuggingFaceStorageReader):
    """Reads HF-storage safetensors (sharded or consolidated) from `folder` of `store` by byte ranges."""

    def __init__(self, store: RunStore, folder: str):
        super().__init__(folder)
        self.store = store
        self.fs = StoreFileSystem(store)
        self.path = folder
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (data start, safetensors header)

    def _header(self, file: str) -> tuple[int, dict]:
        if file not in self._headers:
            self._headers[file] = safetensors_header(self.store, file)
        return self._headers[file]

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The checkpoint's tensors and their chunks, from the safetensors headers alone (no pickle)."""
        sd_meta: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _HFStorageInfo] = {}
        files = [f for f in self.fs.ls(self.path) if f.endswith(SUFFIX)]
        if not files:
            raise FileNotFoundError(f"checkpoint {self.store.uri(self.path)}: no *{SUFFIX} files")
        for file in files:
            _, header = self._header(file)
            extra = header.get(DEFAULT_EXTRA_METADATA_KEY) or {}
            sharding = json.loads(extra[CUSTOM_METADATA_KEY]) if CUSTOM_METADATA_KEY in extra else None
            for key, info in header.items():
                if key == DEFAULT_EXTRA_METADATA_KEY:
                    continue
                shape, dtype = info["shape"], _get_dtype(info["dtype"])
                offset = sharding[key][SAVED_OFFSETS_KEY] if sharding else [0] * len(shape)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))
                end = [o + s for o, s in zip(offset, shape, strict=True)]
                if key in sd_meta:
                    sd_meta[key].chunks.append(chunk)
                    sd_meta[key].size = torch.Size(max(a, b) for a, b in zip(sd_meta[key].size, end, strict=True))
                else:
                    sd_meta[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(end), [chunk])
                storage[MetadataIndex(fqn=key, offset=offset)] = _HFStorageInfo(file, torch.Size(shape), dtype)
        metadata = Metadata(state_dict_metadata=sd_meta, storage_data=storage)
        metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each requested chunk's bytes by one ranged read, narrowed to the slice this rank's shard takes."""
        for req in plan.items:
            info: _HFStorageInfo = self.storage_data[req.storage_index]
            start, header = self._header(info.relative_path)
            tensor = read_stored_tensor(self.store, info.relative_path, start, header[req.storage_index.fqn])
            for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                tensor = tensor.narrow(dim, offset, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise ValueError(
                    f"checkpoint {self.store.uri(info.relative_path)}: {req.storage_index.fqn} slice "
                    f"{tuple(tensor.size())} does not fit this run's {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def safetensors_header(store: RunStore, file: str) -> tuple[int, dict]:
    """(where the data starts, the JSON header) of the safetensors file `file` of `store`: two ranged reads."""
    (n,) = struct.unpack("<Q", store.read_range(0, _HEADER_LEN, file))
    return _HEADER_LEN + n, json.loads(store.read_range(_HEADER_LEN, _HEADER_LEN + n, file))


def read_stored_tensor(store: RunStore, file: str, start: int, info: dict,
                       rows: tuple[int, int] | None = None) -> torch.Tensor:
    """One tensor of a safetensors file by one ranged read: `start` and `info` (its header entry) from
    safetensors_header. `rows` (lo, hi): only those indices of the first dimension, which lie contiguously in
    the file (a reader resharding along it fetches only its part)."""
    begin, end = info["data_offsets"]
    dtype, shape = _get_dtype(info["dtype"]), list(info["shape"])
    if rows is not None and shape:
        row_bytes = (end - begin) // shape[0] if shape[0] else 0
        begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
        shape[0] = rows[1] - rows[0]
    raw = bytearray(store.read_range(start + begin, start + end, file))
    return torch.frombuffer(raw, dtype=dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)
