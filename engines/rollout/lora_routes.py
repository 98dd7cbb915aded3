"""SGLang's LoRA routes on the embedded rollout server: `/load_lora_adapter`, `/unload_lora_adapter`,
`/update_weight_version`, and the `lora_path` check of generation requests. Field names and answers are SGLang's
(`{"success", "error_message", "loaded_adapters"}`; a failed load or unload is a 400 with success false).

The engine serves one adapter at a time, merged into its weights (engines/rollout/lora.py): a request must name
that adapter (`lora_path` in /generate, `"model": "<base>:<adapter>"` on the OpenAI routes); naming another, or
the base model while an adapter is merged, is a 400. Adapter folders are read from the same folders as
/update_weights_from_disk (the model's and `weight_dirs`); these routes need the control token like it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlflow.engines.rollout.http_api import (
    BadRequest,
    EngineClient,
    check_fields,
    parse_weight_version,
    read_json,
    weight_version_text,
)
from rlflow.engines.rollout.weight_routes import outside_message, weight_roots, within


def add_lora_routes(app: FastAPI, backend, client: EngineClient, weight_dirs: Sequence[str | Path] = ()) -> None:
    """The adapter routes of `backend` (a TorchRolloutBackend); adapters load from its weight folders only."""
    roots = weight_roots(backend, weight_dirs)

    def answer(error: str | None = None, status: int = 200) -> JSONResponse:
        """SGLang's LoRAUpdateOutput (lora_manager.create_lora_update_result: error_message "" on success)."""
        return JSONResponse(
            {"success": error is None, "error_message": error or "", "loaded_adapters": backend.loaded_adapters()},
            status_code=status,
        )

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await read_json(request)
        check_fields(body, {"lora_name", "lora_path", "pinned"}, {"lora_id": None}, "/load_lora_adapter")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"lora_name: a non-empty string, got {name!r}")
        if not isinstance(path, str) or not path:
            raise BadRequest(f"lora_path: a local folder of a PEFT adapter, got {path!r}")
        if name in backend.loaded_adapters():  # as SGLang: a loaded name is unloaded before it is loaded again
            return answer(f"lora_name: {name!r} is already loaded (/unload_lora_adapter it first)", 400)
        if not within(Path(path), roots):
            return answer(outside_message("lora_path", Path(path), roots), 403)
        try:
            await asyncio.to_thread(backend.load_lora_adapter, name, path)
        except (ValueError, RuntimeError) as exc:
            return answer(str(exc), 400)
        return answer()

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await read_json(request)
        check_fields(body, {"lora_name"}, {"lora_id": None}, "/unload_lora_adapter")
        try:
            await asyncio.to_thread(backend.unload_lora_adapter, body.get("lora_name"))
        except ValueError as exc:
            return answer(str(exc), 400)
        return answer()

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await read_json(request)
        check_fields(body, {"new_version", "abort_all_requests"}, {}, "/update_weight_version")
        if body.get("new_version") is None:
            raise BadRequest("new_version: required (the weight version to stamp on generations)")
        try:
            version = parse_weight_version(body["new_version"], "new_version")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if body.get("abort_all_requests", True):  # SGLang's default
            client.engine.abort(abort_all=True)
        await asyncio.to_thread(backend.update_weight_version, version)
        text = weight_version_text(version)
        return {"success": True, "message": f"Weight version updated to {text}", "new_version": text}


def check_adapter(backend, names: Any, count: int, field: str = "lora_path") -> None:
    """The adapter each of `count` prompts asks for (`names`: one name or None for all, or a list with one per
    prompt) must be the one merged, or None while none is: BadRequest naming `field` and the adapter served."""
    items = names if isinstance(names, list) else [names] * count
    if len(items) != count:
        raise BadRequest(f"{field}: {len(items)} items for {count} prompts (one adapter name or null per prompt)")
    served = backend.served_adapter()
    for item in items:
        if item is not None and not isinstance(item, str):
            raise BadRequest(f"{field}: an adapter name (a string) or null, got {item!r}")
        if item == served:
            continue
        if served is None:
            raise BadRequest(
                f"{field}: LoRA adapter {item!r} is not loaded; this server serves the base model "
                "(/load_lora_adapter first)"
            )
        if item is None:
            raise BadRequest(
                f"{field}: this server serves LoRA adapter {served!r}, merged into its weights; name "
                "it (the base model is not served while an adapter is loaded)"
            )
        raise BadRequest(
            f"{field}: LoRA adapter {item!r} is not loaded; this server serves {served!r} (the "
            "embedded engine merges one adapter at a time; several at once need SGLang)"
        )
