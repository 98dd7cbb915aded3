"""The `delta` transport's format in the run store, and what each side keeps between versions.

Version v is published as the xor of its bytes with v-1's, in the sync dtype (the rollout engines' own: bf16 on
GPUs), not as a sparse (index, value) diff: at a small learning rate most bf16 weights round to the same value
after a step, so the xor is mostly zero bytes and, where a weight changed, it changed in its low mantissa bits;
zstd squeezes the zero runs to nearly nothing without the 4-8 bytes of index a sparse diff pays per changed
weight (measured on a 16M-weight tensor after an lr 1e-6 step, 4.2% of weights changed: xor+zstd 4.4% of the
bf16 bytes, a sparse int32+bf16 diff 12.7% before any compression). The xor is split into byte planes first
(every element's byte 0, then every byte 1, ...): sign and exponent rarely change, so the high plane is zeros
and compresses apart from the noisy low one (10-20% smaller). The xor is exact for any dtype and needs no
arithmetic, so a receiver rebuilds v's bytes bit for bit; a per-tensor xxh3 of the full new bytes checks it.

Layout under the run's folder (`LAYOUT`):
    weights-delta/v<version>/delta-<bucket>.zst   every tensor's frame of one bucket, concatenated
    weights-delta/v<version>/delta.json           the manifest, written last: without it the version does not exist
    weights-delta/v<version>/full-<bucket>.zst    a snapshot: each tensor's whole bytes (same planes, same zstd)
    weights-delta/v<version>/full.json            ... and its manifest, also written last
A version has a delta, a snapshot or both (a snapshot written later for a receiver that could not follow the
delta). A manifest names the publisher's `epoch` (one per sender process) and a delta's `base` version: a
receiver applies a delta only onto exactly those bytes.

What each side holds (host memory, in the sync dtype): the sender (train rank 0) a copy of the last version it
published, the whole model (`DeltaPublisher`); each rollout worker a mirror of the last version it applied, the
whole model again (`DeltaFollower`). The mirror is kept instead of reading the engine's weights back: the embedded
engine's weights may be released (colocated), quantized or fused, and an SGLang server's are out of reach; the
mirror is exactly what was received, so the checksum checks the reconstruction and nothing else.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash
import zstandard

from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.base import NamedTensors

LAYOUT = "weights-delta"
FORMAT = 1
CHUNK = 16 << 20  # a tensor is coded in frames of this many bytes, several at once (zstd and numpy free the GIL)
WIDE = {2: np.uint16, 4: np.uint32, 8: np.uint64}  # an element of this many bytes as one unsigned integer


class ChecksumError(ValueError):
    """A rebuilt tensor whose bytes are not the ones the sender published (a corrupt object or a wrong base)."""


def version_folder(version: int) -> tuple[str, str]:
    return LAYOUT, f"v{version:08d}"


def manifest_name(kind: str) -> str:
    return f"{kind}.json"


def object_name(kind: str, index: int) -> str:
    return f"{kind}-{index:04d}.zst"


# ---- bytes ---------------------------------------------------------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array (a view where the tensor is contiguous on the CPU)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def torch_dtype(name: str) -> torch.dtype:
    """"bfloat16" -> torch.bfloat16 (the rollout workers' `weight_dtype()` names)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"delta weight sync: {name!r} is not a torch dtype")
    return dtype


def as_tensor(data: np.ndarray, dtype: str, shape: list[int]) -> torch.Tensor:
    """A view of `data` (uint8) as a tensor of `dtype` and `shape`: no copy."""
    if not data.nbytes:  # torch views no empty byte array as a wider dtype
        return torch.empty(shape, dtype=torch_dtype(dtype))
    return torch.from_numpy(data).view(torch_dtype(dtype)).reshape(shape)


def checksum(data: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(data))


@functools.cache
def pool() -> ThreadPoolExecutor:
    """The threads a large tensor's frames are coded on (made at the first sync that needs them)."""
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="delta-sync")


def chunked(nbytes: int, fn: Callable[[slice], object]) -> list:
    """fn over the CHUNK-sized slices of [0, nbytes), in order: on the pool when there are several."""
    slices = [slice(i, min(i + CHUNK, nbytes)) for i in range(0, nbytes, CHUNK)] or [slice(0, 0)]
    return [fn(slices[0])] if len(slices) == 1 else list(pool().map(fn, slices))


def encode(x: np.ndarray, itemsize: int, level: int) -> bytes:
    """One frame: `x` (new xor base, or the new bytes alone) in byte planes, zstd-compressed."""
    planes = np.ascontiguousarray(x.reshape(-1, itemsize).T) if itemsize > 1 else x
    return zstandard.ZstdCompressor(level=level).compress(planes)


def decode_into(frame: memoryview, out: np.ndarray, itemsize: int, xor: bool) -> None:
    """Undo `encode` into `out` (uint8): xor the decoded bytes onto it (a delta) or write them (a snapshot). An
    element is rebuilt from its planes by shifts on little-endian hosts (a strided copy is 5x slower)."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=out.nbytes)
    except zstandard.ZstdError as err:
        raise ChecksumError(f"a frame does not decompress ({err})") from err
    if len(raw) != out.nbytes:
        raise ChecksumError(f"a frame of {len(raw)} bytes where {out.nbytes} were published")
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, -1)
    wide = WIDE.get(itemsize) if sys.byteorder == "little" else None
    if wide is None:
        plain = np.ascontiguousarray(planes.T).reshape(-1)
        np.bitwise_xor(out, plain, out=out) if xor else np.copyto(out, plain)
        return
    u = out.view(wide)
    for i in range(itemsize):
        part = np.left_shift(planes[i], 8 * i, dtype=wide)
        np.bitwise_xor(u, part, out=u) if xor or i else np.copyto(u, part)


# ---- the store -----------------------------------------------------------------------------------------------------
def committed(store: RunStore) -> dict[int, set[str]]:
    """Version -> the kinds ("delta", "full") whose manifest is there: one listing of the layout's folder. A
    version's objects without its manifest (a kill mid-write) are not listed."""
    out: dict[int, set[str]] = {}
    for rel in store.files(LAYOUT):
        folder, _, name = rel.partition("/")
        kind = name.removesuffix(".json")
        if folder.startswith("v") and folder[1:].isdigit() and name == manifest_name(kind) and kind in ("delta",
                                                                                                         "full"):
            out.setdefault(int(folder[1:]), set()).add(kind)
    return out


def stored_versions(store: RunStore) -> list[int]:
    """Every version with a folder, committed or torn."""
    return sorted({int(rel[1:9]) for rel in store.files(LAYOUT) if rel.startswith("v") and rel[1:9].isdigit()})


def remove_from(store: RunStore, version: int) -> None:
    """Every version folder at or after `version`, committed or torn: the version about to be written replaces
    them (a retried sync, or a resumed run's timeline after the one that was killed)."""
    for v in stored_versions(store):
        if v >= version:
            store.remove(*version_folder(v))


def prune_before(store: RunStore, version: int) -> list[int]:
    """Delete every version older than `version` (the newest snapshot): no receiver needs them any more."""
    doomed = [v for v in stored_versions(store) if v < version]
    for v in doomed:
        store.remove(*version_folder(v))
    return doomed


def write_manifest(store: RunStore, version: int, kind: str, epoch: str, base: int | None, dtype: str,
                   buckets: list[dict]) -> dict:
    """Commit a version: its manifest, written after every object it names."""
    manifest = {"format": FORMAT, "version": version, "kind": kind, "epoch": epoch, "base": base, "dtype": dtype,
                "buckets": buckets, "full_bytes": sum(b["full_bytes"] for b in buckets),
                "stored_bytes": sum(b["stored_bytes"] for b in buckets)}
    store.write_json(manifest, *version_folder(version), manifest_name(kind))
    return manifest


# ---- the sender ----------------------------------------------------------------------------------------------------
class DeltaPublisher:
    """Train rank 0's side: the bytes of the version it published last, per bucket, to diff the next one against.
    A new process (a restart) starts a new epoch with nothing held, so its first version is a snapshot."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex
        self.held: dict[int, tuple[int, list[tuple[str, list[int], np.ndarray]]]] = {}

    def held_version(self, buckets: int) -> tuple[str, int] | None:
        """(epoch, version) when every one of `buckets` holds the same version, else None (a push that died
        halfway leaves some buckets newer: only a snapshot is safe then)."""
        versions = {v for v, _ in self.held.values()}
        if len(self.held) != buckets or len(versions) != 1:
            return None
        return self.epoch, versions.pop()

    def put(self, store: RunStore, version: int, index: int, tensors: NamedTensors, base: int | None,
            level: int) -> dict:
        """Write bucket `index` of `version`: its delta against the held `base` (None: a snapshot), and hold the
        new bytes. Returns the bucket's manifest entry."""
        kind = "full" if base is None else "delta"
        before = self.held.pop(index, None)  # a put that fails halfway leaves this bucket unheld: a snapshot next
        before = None if base is None else before
        if base is not None and (before is None or before[0] != base):
            raise RuntimeError(f"delta weight sync: bucket {index} holds version "
                               f"{None if before is None else before[0]}, not the base {base} asked for")
        old = {} if before is None else {name: data for name, _, data in before[1]}
        frames, entries, kept, offset, full = [], [], [], 0, 0
        for name, t in tensors:
            new = tensor_bytes(t)
            prev = old.get(name)
            if prev is not None and prev.nbytes != new.nbytes:
                raise RuntimeError(f"delta weight sync: {name} changed size ({prev.nbytes} -> {new.nbytes} bytes)")
            held = new.copy() if prev is None else prev  # never a view of the trainer's own parameter
            coded = chunked(new.nbytes, functools.partial(_code_chunk, new, prev, held, t.element_size(), level))
            entry = {"name": name, "shape": list(t.shape), "nbytes": int(new.nbytes), "xxh3": checksum(new)}
            if any(changed for _, changed in coded):
                entry |= {"offset": offset, "lengths": [len(frame) for frame, _ in coded]}
                frames += [frame for frame, _ in coded]
                offset += sum(entry["lengths"])
            else:
                entry["same"] = True
            entries.append(entry)
            full += new.nbytes
            kept.append((name, list(t.shape), held))
        store.write_bytes(b"".join(frames), *version_folder(version), object_name(kind, index))
        self.held[index] = version, kept
        return {"object": object_name(kind, index), "tensors": entries, "full_bytes": full, "stored_bytes": offset}

    def put_snapshot(self, store: RunStore, version: int, level: int) -> list[dict]:
        """A snapshot of the held version, written from the held bytes (no gather): for receivers that could
        not follow a delta. Returns the buckets' manifest entries."""
        if not self.held or {v for v, _ in self.held.values()} != {version}:
            raise RuntimeError(f"delta weight sync: a snapshot of version {version} asked for, but the sender "
                               f"holds {sorted({v for v, _ in self.held.values()})}")
        buckets = []
        for index in sorted(self.held):
            frames, entries, offset = [], [], 0
            for name, shape, data in self.held[index][1]:
                size = itemsize(data, shape)
                coded = chunked(data.nbytes, lambda sl, data=data, size=size: encode(data[sl], size, level))
                entries.append({"name": name, "shape": shape, "nbytes": int(data.nbytes), "xxh3": checksum(data),
                                "offset": offset, "lengths": [len(frame) for frame in coded]})
                frames += coded
                offset += sum(entries[-1]["lengths"])
            store.write_bytes(b"".join(frames), *version_folder(version), object_name("full", index))
            buckets.append({"object": object_name("full", index), "tensors": entries,
                            "full_bytes": sum(e["nbytes"] for e in entries), "stored_bytes": offset})
        return buckets


def itemsize(data: np.ndarray, shape: list[int]) -> int:
    return data.nbytes // max(math.prod(shape), 1) or 1


def _decode_tensor(data: memoryview, entry: dict, out: np.ndarray, xor: bool) -> None:
    """A tensor's frames (`entry` of a manifest, in the bucket object `data`) into `out`, several at once."""
    starts = np.cumsum([entry["offset"], *entry["lengths"]]).tolist()
    if len(starts) - 1 != max(1, -(-out.nbytes // CHUNK)) or starts[-1] > len(data):
        raise ChecksumError("its frames do not fit the object")
    size = out.nbytes // (math.prod(entry["shape"]) or 1) or 1

    def one(sl: slice) -> None:
        i = sl.start // CHUNK
        decode_into(data[starts[i]:starts[i + 1]], out[sl], size, xor)

    chunked(out.nbytes, one)


def _code_chunk(new: np.ndarray, prev: np.ndarray | None, held: np.ndarray, size: int, level: int,
                sl: slice) -> tuple[bytes, bool]:
    """One chunk of a tensor: its frame (of the xor with `prev`, computed in place there, or of `new`) and whether
    any byte changed; `held` gets the new bytes."""
    if prev is None:
        return encode(new[sl], size, level), True
    x = prev[sl]
    np.bitwise_xor(x, new[sl], out=x)
    changed = bool(x.any())
    frame = encode(x, size, level) if changed else b""
    np.copyto(held[sl], new[sl])
    return frame, changed


# ---- the receiver --------------------------------------------------------------------------------------------------
@dataclass
class FollowResult:
    """What one `DeltaFollower.follow` did: whether the mirror is at the version now, how many snapshots it read
    in place of the delta it was sent (missed versions, a failed checksum, a restart), and the bytes it read."""

    applied: bool
    full_fetches: int = 0
    read_bytes: int = 0
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"applied": self.applied, "full_fetches": self.full_fetches, "read_bytes": self.read_bytes,
                "problems": self.problems}


class DeltaFollower:
    """A rollout worker's side: a host mirror of the last version applied (uint8 bytes per HF name, in the sync
    dtype), rebuilt version by version from the store. `at` is (epoch, version) while the mirror is whole."""

    def __init__(self) -> None:
        self.mirror: dict[str, tuple[str, list[int], np.ndarray]] = {}
        self.at: tuple[str, int] | None = None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The mirror as HF-named tensors (views, no copy): what the engine loads after a follow."""
        for name, (dtype, shape, data) in self.mirror.items():
            yield name, as_tensor(data, dtype, shape)

    def follow(self, store: RunStore, version: int) -> FollowResult:
        """Bring the mirror to `version`: its delta when the mirror holds the delta's base, else the newest
        snapshot at or before it and the deltas after that. `applied` False: no chain reaches it (the sender
        then writes a snapshot of it and asks again)."""
        result = FollowResult(applied=False)
        kinds = committed(store)
        if version not in kinds:
            raise FileNotFoundError(f"delta weight sync: version {version} has no manifest in "
                                    f"{store.uri(*version_folder(version))}")
        if self.at is not None and self.at[1] == version:
            kind = "delta" if "delta" in kinds[version] else "full"
            if self.at[0] == store.read_json(*version_folder(version), manifest_name(kind))["epoch"]:
                # asked again (a retried sync, or others needed a snapshot): the mirror is there already
                result.applied = True
                return result
        if "delta" in kinds[version] and self.at is not None:
            manifest = store.read_json(*version_folder(version), manifest_name("delta"))
            if self.at == (manifest["epoch"], manifest["base"]):
                try:
                    result.read_bytes += self._apply(store, manifest)
                    result.applied = True
                    return result
                except ChecksumError as e:  # the object or the mirror: only a snapshot of this version is sure
                    result.problems.append(str(e))
                    if "full" not in kinds[version]:
                        return result
        # rebuild from a snapshot: a recovery when this version was sent as a delta (missed versions, a failed
        # checksum, a restarted receiver); a version published as a snapshot is read so by everyone
        start = max((v for v, k in kinds.items() if v <= version and "full" in k), default=None)
        if start is None:
            result.problems.append(f"no snapshot at or before version {version}")
            return result
        result.full_fetches += int("delta" in kinds[version])
        try:
            result.read_bytes += self._apply(store, store.read_json(*version_folder(start), manifest_name("full")))
            for v in range(start + 1, version + 1):
                if "delta" not in kinds.get(v, ()):
                    raise ChecksumError(f"version {v} has no delta (a gap in the chain)")
                manifest = store.read_json(*version_folder(v), manifest_name("delta"))
                if self.at != (manifest["epoch"], manifest["base"]):
                    raise ChecksumError(f"version {v}'s delta is over {manifest['base']} of another sender")
                result.read_bytes += self._apply(store, manifest)
        except ChecksumError as e:
            result.problems.append(str(e))
            return result
        result.applied = True
        return result

    def _apply(self, store: RunStore, manifest: dict) -> int:
        """One version's manifest onto the mirror (a snapshot replaces it): every tensor checked against its
        checksum. A failure leaves the mirror marked not whole (`at` None). Returns the bytes read."""
        self.at, dtype, full = None, manifest["dtype"], manifest["kind"] == "full"
        if full:
            self.mirror = {}
        read = 0
        folder = version_folder(manifest["version"])
        for bucket in manifest["buckets"]:
            try:
                data = store.read_bytes(*folder, bucket["object"]) if bucket["stored_bytes"] else b""
            except FileNotFoundError as err:  # pruned under a slow reader, or deleted by hand
                raise ChecksumError(f"{bucket['object']} of version {manifest['version']} is missing") from err
            read += len(data)
            view = memoryview(data)
            for e in bucket["tensors"]:
                name, nbytes = e["name"], e["nbytes"]
                have = self.mirror.get(name)
                if not full and (have is None or have[2].nbytes != nbytes):
                    raise ChecksumError(f"{name}: not in the mirror, or of another size")
                if full:
                    self.mirror[name] = have = dtype, e["shape"], np.empty(nbytes, dtype=np.uint8)
                try:
                    if not e.get("same"):
                        _decode_tensor(view, e, have[2], xor=not full)
                except ChecksumError as err:
                    raise ChecksumError(f"{name} ({bucket['object']} of version {manifest['version']}): {err}") from err
                if checksum(self.mirror[name][2]) != e["xxh3"]:
                    raise ChecksumError(f"{name}: checksum of version {manifest['version']} "
                                        f"({bucket['object']}) does not match")
        self.at = manifest["epoch"], manifest["version"]
        return read
