"""`python -m tests.sglang_fixture_server`: a process that answers SGLang's routes with the recorded answers of
tests/fixtures/sglang/ (SGLang's shapes, read from its source), so the SGLang backend's client code meets SGLang's
answers rather than the embedded server's. It generates nothing: /generate returns the recorded items in turn.

It takes launch_server's flags the worker passes (--model-path, --host, --port, --api-key, and ignores the rest);
`--legacy-info` makes it a server older than /server_info and /model_info (404; only the deprecated /get_* names).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"


def fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


def build_app(model_path: str, legacy_info: bool) -> FastAPI:
    app = FastAPI()
    items = fixture("generate_batch.json")
    state = {"weight_version": "default", "model_path": model_path}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        ids = body["input_ids"]
        if isinstance(ids[0], int):
            return items[0]
        return [items[i % len(items)] for i in range(len(ids))]

    def model_info():
        return fixture("model_info.json") | state

    def server_info():
        return fixture("server_info.json") | state

    for route, answer in (("/model_info", model_info), ("/server_info", server_info)):
        app.add_api_route("/get" + "_" + route[1:], answer, methods=["GET"])
        if not legacy_info:
            app.add_api_route(route, answer, methods=["GET"])

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await request.json()
        if not Path(body["model_path"]).is_dir():
            return JSONResponse(fixture("update_weights_failed.json"), status_code=400)
        state.update(model_path=body["model_path"], weight_version=body.get("weight_version") or "default")
        return fixture("update_weights_from_disk.json")

    flushes: list[int] = []  # /flush_cache calls, reported by /get_flushes (the tests' own route, not SGLang's)

    @app.get("/get_flushes")
    async def get_flushes():
        return {"flushes": len(flushes)}

    loras: dict[str, str] = {}  # SGLang's LoRA registry: a loaded name is refused, an unknown one cannot unload

    def lora_answer(error: str | None = None) -> JSONResponse:
        if error is not None:
            return JSONResponse(fixture("lora_update_failed.json") | {"error_message": error}, status_code=400)
        return JSONResponse(fixture("lora_update.json") | {"loaded_adapters": dict(loras)})

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        if name in loras:
            return lora_answer(f"LoRA with name {name} already exists. Loaded LoRAs: dict_keys({list(loras)})")
        if not (Path(path) / "adapter_config.json").is_file():
            return lora_answer(f"Can't find 'adapter_config.json' at '{path}'")
        loras[name] = path
        return lora_answer()

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        name = (await request.json())["lora_name"]
        if loras.pop(name, None) is None:
            return lora_answer(f"LoRA with name {name} does not exist. Loaded LoRAs: dict_keys({list(loras)})")
        return lora_answer()

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await request.json()
        state["weight_version"] = body["new_version"]
        return fixture("update_weight_version.json") | {"message": f"Weight version updated to {body['new_version']}",
                                                         "new_version": body["new_version"]}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        flushes.append(len(flushes))
        return Response("Cache flushed.\n", status_code=200)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--legacy-info", action="store_true")
    args, _ = parser.parse_known_args()
    uvicorn.run(build_app(args.model_path, args.legacy_info), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
