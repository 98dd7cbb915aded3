"""`python -m tests.sglang_fixture_server`: a process that answers SGLang's routes with the recorded answers of
tests/fixtures/sglang/ (SGLang's shapes, read from its source), so the SGLang backend's client code meets SGLang's
answers rather than the embedded server's. It generates nothing: /generate returns the recorded items in turn.

It takes launch_server's flags the worker passes (--model-path, --host, --port, --api-key, and ignores the rest);
`--legacy-info` makes it a server older than /server_info and /model_info (404; only the deprecated /get_* names).

With a vision-language model (Qwen2-VL) it does to a request's images what sglang 0.5.10.post1 does before its model
runs, and refuses what SGLang would fail on: `image_data` read per request as GenerateReqInput normalizes it, each
image loaded as `load_image` loads a string, the prompt's image spans expanded as its Qwen-VL processor expands them
(one pad per image in, the expanded length back in meta_info.prompt_tokens), and weight updates named as the
checkpoint on disk, the names SGLang's Qwen2-VL modules have (docs/multimodal.md, "SGLang", has the source lines).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import io
import json
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image
from safetensors import safe_open

from rlflow.engines.models.vision_language import VisionProcessor, is_vision_language

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"


def fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif")  # utils/common.py image_extension_names


def image_lists(body: dict) -> list[list]:
    """Each request's images, as GenerateReqInput reads a body's image_data (io_struct.py:423-462; a single request's
    list is its images, tokenizer_manager.py:707-708): batched, a list as long as the batch whose entries are lists
    when the first one is (None or [None]: no images), and otherwise one image each."""
    data, ids = body.get("image_data"), body["input_ids"]
    if isinstance(ids[0], int):
        return [[] if data is None else data if isinstance(data, list) else [data]]
    if data is None or data == []:
        return [[] for _ in ids]
    if not isinstance(data, list):
        return [[data] for _ in ids]
    if len(data) != len(ids):
        raise ValueError("The length of image_data should be equal to the batch size.")
    if isinstance(data[0], list):
        return [[] if d is None or d == [None] else d for d in data]
    return [[] if d is None else [d] for d in data]


def load_image(data) -> Image.Image:
    """An image as SGLang's load_image (utils/common.py:809-847) reads a string: a data URI or bare base64 (decoded
    with validation), a file path or file:// URL (no http(s) here: the stand-in fetches nothing)."""
    if not isinstance(data, str) or data.startswith(("http://", "https://")):
        raise ValueError(f"Invalid image: {str(data)[:80]}")
    if data.startswith("file://") or data.lower().endswith(IMAGE_SUFFIXES):
        return Image.open(data.removeprefix("file://")).convert("RGB")
    try:
        raw = base64.b64decode(data.split(",", 1)[1] if data.startswith("data:") else data, validate=True)
    except (binascii.Error, ValueError, IndexError) as e:
        raise ValueError(f"Error while loading data {data[:80]}: {e}") from None
    return Image.open(io.BytesIO(raw)).convert("RGB")


def expanded_length(ids: list[int], images: list, vision: VisionProcessor) -> int:
    """The prompt's length once SGLang's Qwen-VL processor expanded its images. Its image spans
    (<|vision_start|><|image_pad|>+<|vision_end|>, multimodal/processors/qwen_vl.py:273-279) must number the
    images, and each must hold one pad: transformers 5.3.0's Qwen2VLProcessor (processing_qwen2_vl.py:103-111), which
    SGLang runs on the decoded prompt, expands every pad with the next image's grid, so an expanded span's pads run
    past the images (torch's IndexError)."""
    pad = vision.image_token_id
    runs = sum(1 for i, t in enumerate(ids) if t == pad and (i == 0 or ids[i - 1] != pad))
    if runs != len(images):
        raise ValueError(f"{runs} image spans in input_ids for {len(images)} images in image_data")
    if ids.count(pad) != runs:
        raise ValueError(f"index {len(images)} is out of bounds for dimension 0 with size {len(images)}")
    return len(vision.expand(ids, vision.grids([load_image(x) for x in images])))


def checkpoint_names(model_path: str) -> set[str]:
    """The tensor names of the checkpoint SGLang loaded at launch: its Qwen2-VL parameters' names
    (models/qwen2_vl.py:458-478), the only ones its load_weights takes (573-614, a KeyError otherwise)."""
    names: set[str] = set()
    for path in Path(model_path).glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            names |= set(f.keys())
    return names


def build_app(model_path: str, legacy_info: bool) -> FastAPI:
    app = FastAPI()
    items = fixture("generate_batch.json")
    state = {"weight_version": "default", "model_path": model_path}
    vision = VisionProcessor(model_path) if is_vision_language(model_path) else None
    known = checkpoint_names(model_path) if vision is not None else None

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        ids = body["input_ids"]
        single = isinstance(ids[0], int)
        answers = [items[0]] if single else [items[i % len(items)] for i in range(len(ids))]
        if vision is not None and "image_data" in body:
            try:
                lengths = [expanded_length(p, images, vision) for p, images in
                           zip([ids] if single else ids, image_lists(body), strict=True)]
            except (ValueError, OSError) as e:
                return JSONResponse({"error": {"message": str(e)}}, status_code=400)
            answers = [a | {"meta_info": a["meta_info"] | {"prompt_tokens": n}}
                       for a, n in zip(answers, lengths, strict=True)]
        return answers[0] if single else answers

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
        unknown = sorted(checkpoint_names(body["model_path"]) - known) if known is not None else []
        if unknown:
            return JSONResponse({"success": False, "message": f"Failed to update weights: {unknown[0]!r}.\n"
                                 "Rolling back to original weights."}, status_code=400)
        state.update(model_path=body["model_path"], weight_version=body.get("weight_version") or "default")
        return fixture("update_weights_from_disk.json")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        """The names are checked as SGLang's load_weights takes them; nothing is broadcast to the stand-in."""
        body = await request.json()
        unknown = sorted(set(body["names"]) - known) if known is not None else []
        if unknown:
            return JSONResponse({"success": False, "message": f"Failed to update parameter online: {unknown[0]!r}"},
                                status_code=400)
        state["weight_version"] = body.get("weight_version") or state["weight_version"]
        return {"success": True, "message": "Succeeded to update parameter online."}

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
