"""SGLang's weight-update routes on the embedded server: `/update_weights_from_tensor`,
`/update_weights_from_disk`, and the distributed pair `/init_weights_update_group` +
`/update_weights_from_distributed` (+ `/destroy_weights_update_group`), whose other end is the trainer's
`DistributedWeightSender` (engines/sync/distributed.py). Field names and meanings are SGLang's.

`/update_weights_from_disk` loads only from the server's own model folder and the folders it was started with
(`weight_dirs`: the run's weight-sync and checkpoint folders): a caller holding the control token still cannot
make the server read whatever the process can (another user's or another run's files)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file

from rlflow.engines.rollout.http_api import (
    BadRequest,
    EngineClient,
    check_fields,
    deserialize_named_tensors,
    parse_weight_version,
    read_json,
    weight_version_text,
)
from rlflow.engines.sync.distributed import (
    GROUP_NAME,
    INIT_FIELDS,
    UPDATE_FIELDS,
    destroy_weights_update_group,
    join_weights_update_group,
)

# the folders a launched server's /update_weights_from_disk may read (os.pathsep-separated), set by the SGLang
# backend for its server: rlflow's launch module reads it, a real SGLang ignores it
WEIGHT_DIRS_ENV = "RLFLOW_WEIGHT_DIRS"


def add_weight_routes(app: FastAPI, backend, client: EngineClient, weight_dirs: Sequence[str | Path] = ()) -> None:
    """SGLang's weight routes on the embedded server of `backend` (a TorchRolloutBackend); `/update_weights_from_disk`
    reads from backend.model_path and `weight_dirs` only."""
    roots = weight_roots(backend, weight_dirs)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await read_json(request)
        check_fields(body, {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                             "weight_version"}, {}, "/update_weights_from_tensor")
        if body.get("load_format") not in (None, "safetensors"):
            raise BadRequest(f"load_format: the embedded server takes 'safetensors' (base64), got "
                             f"{body['load_format']!r}")
        items = body.get("serialized_named_tensors")
        if not isinstance(items, list) or not items:
            raise BadRequest("serialized_named_tensors: expected a non-empty list of base64 safetensors strings")
        named: dict = {}
        for i, item in enumerate(items):
            named.update(deserialize_named_tensors(item, f"serialized_named_tensors[{i}]"))
        return await update(backend, client, body, named)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await read_json(request)
        check_fields(body, {"model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache"}, {},
                     "/update_weights_from_disk")
        if not body.get("model_path"):
            raise BadRequest("model_path: required (a folder of *.safetensors files)")
        path = Path(str(body["model_path"]))
        if not within(path, roots):
            return JSONResponse({"error": {"message": outside_message("model_path", path, roots), "code": 403}},
                                status_code=403)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise BadRequest(f"model_path: no *.safetensors files in {str(path)!r}")
        named: dict = {}
        for f in files:
            named.update(load_file(f))
        result = await update(backend, client, body, named)
        if not isinstance(result, dict):
            return result
        app.state.model_path = str(path)  # SGLang reports the folder it loaded last as its model_path
        return result | {"num_paused_requests": 0}

    add_distributed_routes(app, backend, client)


def weight_roots(backend, weight_dirs: Sequence[str | Path]) -> list[Path]:
    """The folders the server loads weights and LoRA adapters from: its model's and `weight_dirs`, resolved."""
    return [Path(d).resolve() for d in (backend.model_path, *weight_dirs)]


def outside_message(field: str, path: Path, roots: Sequence[Path]) -> str:
    """Why a path outside `roots` is refused (403), naming the field and the folders allowed."""
    return (f"{field}: {str(path)!r} is outside the folders this server loads weights from "
            f"({', '.join(map(str, roots))}): its model and the run's weight-sync and checkpoint folders")


def within(path: Path, roots: Sequence[Path]) -> bool:
    """`path` is one of `roots` or inside one, after resolving symlinks and '..' (a link out of a root is out)."""
    resolved = path.resolve()
    return any(resolved.is_relative_to(root) for root in roots)


async def update(backend, client: EngineClient, body: dict, named: dict) -> JSONResponse | dict:
    version = body.get("weight_version")
    if version is not None:
        try:
            version = parse_weight_version(version)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    refusal = backend.base_update_refusal("update_weights")
    if refusal is not None:
        return JSONResponse({"success": False, "message": refusal}, status_code=400)
    if body.get("abort_all_requests"):
        client.engine.abort(abort_all=True)
    unknown = sorted(set(named) - backend.weight_names())
    if unknown:
        return JSONResponse({"success": False, "message": f"unknown parameter names: {unknown[:5]}"}, status_code=400)
    await asyncio.to_thread(backend.update_weights, named.items(), version)
    return {"success": True,
            "message": f"Updated {len(named)} tensors; weight_version {weight_version_text(backend.weight_version)}."}


def dtype_from_name(name: object, where: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise BadRequest(f"{where}: {name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return dtype


def add_distributed_routes(app: FastAPI, backend, client: EngineClient) -> None:
    """SGLang's distributed weight-update routes on the embedded server of `backend` (a TorchRolloutBackend)."""
    groups: dict[str, dist.ProcessGroup] = {}
    lock = threading.Lock()  # one collective at a time: a group's broadcasts must not interleave

    def failed(message: str) -> JSONResponse:
        return JSONResponse({"success": False, "message": message}, status_code=400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await read_json(request)
        check_fields(body, INIT_FIELDS, {}, "/init_weights_update_group")
        missing = sorted({"master_address", "master_port", "rank_offset", "world_size"} - set(body))
        if missing:
            raise BadRequest(f"/init_weights_update_group: missing {missing}")
        name, kind = str(body.get("group_name") or GROUP_NAME), str(body.get("backend") or "nccl")
        if kind not in ("gloo", "nccl"):
            raise BadRequest(f"backend: 'gloo' (CPU tensors) or 'nccl' (GPU tensors), got {kind!r}")
        if (kind == "nccl") != (torch.device(backend.device).type == "cuda"):
            raise BadRequest(
                f"backend: {kind!r} does not fit the engine's device {backend.device!r} (nccl: cuda, gloo: cpu)"
            )
        if name in groups:
            return failed(f"group {name!r} exists already (destroy it first)")

        def join() -> dist.ProcessGroup:
            return join_weights_update_group(
                str(body["master_address"]),
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                name,
                kind,
            )

        try:
            groups[name] = await asyncio.to_thread(join)
        except Exception as exc:  # noqa: BLE001 - the rendezvous' error goes back to the caller
            return failed(f"joining {name!r} failed: {type(exc).__name__}: {exc}")
        return {"success": True, "message": f"joined {name!r} as rank {body['rank_offset']} of {body['world_size']}"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await read_json(request)
        check_fields(body, UPDATE_FIELDS, {}, "/update_weights_from_distributed")
        if body.get("load_format") is not None:
            raise BadRequest(
                f"load_format: the embedded server receives one broadcast per tensor (no {body['load_format']!r})"
            )
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not (
            len(names) == len(dtypes) == len(shapes)
        ):
            raise BadRequest("names, dtypes, shapes: three lists of the same length")
        group = groups.get(str(body.get("group_name") or GROUP_NAME))
        if group is None:
            return failed(
                f"no weight update group {body.get('group_name') or GROUP_NAME!r} (/init_weights_update_group first)"
            )
        device = backend.device if torch.device(backend.device).type == "cpu" else torch.cuda.current_device()
        tensors = [
            torch.empty([int(d) for d in shape], dtype=dtype_from_name(dt, f"dtypes[{i}]"), device=device)
            for i, (dt, shape) in enumerate(zip(dtypes, shapes, strict=True))
        ]

        def receive() -> None:
            with lock:
                works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
                for w in works:
                    w.wait()

        try:
            await asyncio.to_thread(receive)
        except Exception as exc:  # noqa: BLE001 - a broken group or a timeout goes back to the caller
            return failed(f"receiving the broadcast failed: {type(exc).__name__}: {exc}")
        return await update(backend, client, body, dict(zip(names, tensors, strict=True)))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group_route(request: Request):
        body = await read_json(request)
        check_fields(body, {"group_name"}, {}, "/destroy_weights_update_group")
        name = str(body.get("group_name") or GROUP_NAME)
        group = groups.pop(name, None)
        if group is None:
            return failed(f"no weight update group {name!r}")
        await asyncio.to_thread(destroy_weights_update_group, group)
        return {"success": True, "message": f"destroyed {name!r}"}
