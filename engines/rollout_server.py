"""The embedded rollout server: SGLang's native HTTP routes (and the OpenAI-compatible ones, in
engines/openai_api.py) for one TorchRolloutBackend, on an ephemeral port.

The engine runs in its own background loop; handlers submit requests and await their futures, so
concurrent HTTP requests share decode steps (continuous batching). Field names and meanings are
SGLang's; where the embedded server differs it is written in docs/rollout.md.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from safetensors.torch import load_file

from engines.rollout_http import (
    BackgroundServer,
    BadRequest,
    EngineClient,
    deserialize_named_tensors,
    finite,
    sampling_params,
)

# /generate fields the embedded server reads; others it accepts only at their no-op default
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "stream"}
# (sglang-router 0.3.2 fills in model, background, no_logs, return_bytes, return_entropy, ... on every request)
GENERATE_NO_OP = {"logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False,
                  "log_metrics": True, "return_hidden_states": False, "image_data": None, "lora_path": None,
                  "custom_logit_processor": None, "session_params": None, "token_ids_logprob": None, "model": None,
                  "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False}


def _body_error(exc: BadRequest) -> JSONResponse:
    return JSONResponse({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}}, status_code=400)


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body: not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest("request body: expected a JSON object")
    return body


def _fast_json(obj: Any) -> Response:
    """Serialize with orjson, skipping FastAPI's per-element encoder: a batch's token and logprob lists are
    most of a /generate response, and encoding them element by element cost more than generating them."""
    return Response(orjson.dumps(obj), media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _check_fields(body: dict, known: set[str], no_op: dict[str, Any], route: str) -> None:
    for key, value in body.items():
        if key in known:
            continue
        if key in no_op:
            if value is not None and value != no_op[key]:
                raise BadRequest(f"{route}: field {key!r} is not supported by the embedded server (only "
                                 f"{no_op[key]!r})")
        else:
            raise BadRequest(f"{route}: unknown field {key!r} (known: {sorted(known)})")


def build_app(backend) -> FastAPI:
    from engines.openai_api import add_openai_routes
    from engines.weights_distributed import add_distributed_routes

    app = FastAPI(title="rlflow embedded rollout server")
    client = EngineClient(backend)
    app.state.client = client

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
        return _body_error(exc)

    # ---- generation ------------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        body = await _json(request)
        _check_fields(body, GENERATE_FIELDS, GENERATE_NO_OP, "/generate")
        prompts, batched = _prompts(client, body)
        raw_params = body.get("sampling_params")
        per_item = raw_params if isinstance(raw_params, list) else [raw_params] * len(prompts)
        if len(per_item) != len(prompts):
            raise BadRequest(f"sampling_params: {len(per_item)} items for {len(prompts)} prompts")
        rids = body.get("rid")
        if not isinstance(rids, list):
            rids = [rids if rids is None or not batched else f"{rids}_{i}" for i in range(len(prompts))]
        if len(rids) != len(prompts):
            raise BadRequest(f"rid: {len(rids)} ids for {len(prompts)} prompts")
        return_logprob = body.get("return_logprob") or False
        if isinstance(return_logprob, list) and len(return_logprob) != len(prompts):
            raise BadRequest(f"return_logprob: {len(return_logprob)} flags for {len(prompts)} prompts")
        requests, logprob_of = [], []
        for i, (prompt, raw, rid) in enumerate(zip(prompts, per_item, rids, strict=True)):
            params, seed = sampling_params(raw, "sampling_params" + (f"[{i}]" if isinstance(raw_params, list) else ""))
            new = client.requests([prompt], params, seed, rid)
            requests += new
            flag = return_logprob[i] if isinstance(return_logprob, list) else return_logprob
            logprob_of += [bool(flag)] * len(new)
        t0 = time.perf_counter()
        if body.get("stream"):
            return StreamingResponse(_generate_stream(client, requests, logprob_of, t0), media_type="text/event-stream")
        gens = await client.run(requests)
        out = [_generate_item(client, g.prompt_ids, g.output_ids, g.output_logprobs, g.finish_reason, g.rid,
                              g.weight_version, logprob_of[i], time.perf_counter() - t0) for i, g in enumerate(gens)]
        return _fast_json(out if batched or len(out) > 1 else out[0])

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _json(request)
        _check_fields(body, {"rid", "abort_all"}, {}, "/abort_request")
        if not body.get("abort_all") and not body.get("rid"):
            raise BadRequest("/abort_request: give a rid or abort_all: true")
        client.engine.abort(body.get("rid"), bool(body.get("abort_all")))
        return Response(status_code=200)

    # ---- weights and memory ----------------------------------------------------------------------------
    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await _json(request)
        _check_fields(body, {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
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
        return await _update(backend, client, body, named)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _json(request)
        _check_fields(body, {"model_path", "load_format", "abort_all_requests", "weight_version"}, {},
                      "/update_weights_from_disk")
        path = Path(str(body.get("model_path") or ""))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise BadRequest(f"model_path: no *.safetensors files in {str(path)!r}")
        named: dict = {}
        for f in files:
            named.update(load_file(f))
        result = await _update(backend, client, body, named)
        return result | {"num_paused_requests": 0} if isinstance(result, dict) else result

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if await asyncio.to_thread(client.engine.drop_cache):
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: requests are running.\n", status_code=400)

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        _tags(await _json(request))
        try:
            await asyncio.to_thread(backend.release_memory_occupation)
        except RuntimeError as exc:
            raise BadRequest(str(exc)) from None
        return Response(status_code=200)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        _tags(await _json(request))
        await asyncio.to_thread(backend.resume_memory_occupation)
        return Response(status_code=200)

    # ---- information -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        from engines.sampling import SamplingParams

        prompt = [client.tokenizer.bos_token_id if client.tokenizer.bos_token_id is not None else 0]
        await client.run(client.requests([prompt], SamplingParams(max_new_tokens=1), seed=0))
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info():
        cfg = backend.model.config
        return {"model_path": backend.model_path, "tokenizer_path": backend.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": str(backend.weight_version),
                "model_type": cfg.model_type, "architectures": list(cfg.architectures or []),
                "has_image_understanding": False, "has_audio_understanding": False}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info():
        engine = client.engine
        return {"model_path": backend.model_path, "tokenizer_path": backend.model_path,
                "served_model_name": backend.model_path, "device": str(backend.device),
                "dtype": str(backend.model.dtype).removeprefix("torch."), "context_length": engine.max_len,
                "max_running_requests": engine.max_running, "max_total_num_tokens": engine.max_running * engine.max_len,
                "weight_version": str(backend.weight_version), "version": "rlflow-embedded",
                "internal_states": [{"num_requests": engine.num_requests(),
                                     "memory_released": bool(backend._released)}]}

    add_openai_routes(app, backend, client)
    add_distributed_routes(app, backend, client)  # SGLang's /init_weights_update_group, ..._from_distributed
    return app


def _prompts(client: EngineClient, body: dict) -> tuple[list[list[int]], bool]:
    """(token ids per prompt, whether the request was a batch) from `text` or `input_ids`."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("/generate: give exactly one of text or input_ids")
    if text is not None:
        if isinstance(text, str):
            return [client.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [client.encode(t) for t in text], True
        raise BadRequest("text: expected a string or a non-empty list of strings")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return [ids], False
    if isinstance(ids, list) and ids and all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in ids):
        return ids, True
    raise BadRequest("input_ids: expected a list of token ids or a non-empty list of such lists")


def _generate_item(client: EngineClient, prompt_ids, output_ids, output_logprobs, finish_reason, rid, version,
                   with_logprobs: bool, latency: float) -> dict:
    meta = {"id": rid, "finish_reason": finish_reason, "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(output_ids), "cached_tokens": 0, "weight_version": str(version),
            "e2e_latency": latency}
    if with_logprobs:
        meta["output_token_logprobs"] = [[finite(lp), tok, None] for lp, tok in zip(output_logprobs, output_ids,
                                                                                     strict=True)]
    return {"text": client.output_text(output_ids, finish_reason), "output_ids": list(output_ids), "meta_info": meta}


async def _generate_stream(client: EngineClient, requests, logprob_of: list[bool], t0: float):
    """SGLang's stream: one `data:` event per new token with the cumulative text, output ids and meta_info
    (finish_reason null until the last), an `index` per batch item, then `data: [DONE]`."""
    try:
        async for ev in client.stream(requests):
            r = requests[ev.index]
            finish = ev.final.finish_reason if ev.final is not None else None
            version = ev.final.weight_version if ev.final is not None else r.weight_version
            item = _generate_item(client, r.prompt, ev.output_ids, ev.output_logprobs, finish, r.rid, version,
                                  logprob_of[ev.index], time.perf_counter() - t0)
            yield _sse(item | {"index": ev.index})
    except BadRequest as exc:
        yield _sse({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}})
    yield b"data: [DONE]\n\n"


async def _update(backend, client: EngineClient, body: dict, named: dict) -> JSONResponse | dict:
    version = body.get("weight_version")
    if version is not None:
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise BadRequest(f"weight_version: the embedded engine numbers versions with integers, got {version!r}"
                             ) from None
    if body.get("abort_all_requests"):
        client.engine.abort(abort_all=True)
    unknown = sorted(set(named) - set(backend.params))
    if unknown:
        return JSONResponse({"success": False, "message": f"unknown parameter names: {unknown[:5]}"}, status_code=400)
    await asyncio.to_thread(backend.update_weights, named.items(), version)
    return {"success": True, "message": f"Updated {len(named)} tensors; weight_version {backend.weight_version}."}


def _tags(body: dict) -> None:
    _check_fields(body, {"tags"}, {}, "memory occupation")
    tags = body.get("tags")
    if tags is not None and not set(tags) <= {"weights", "kv_cache"}:
        raise BadRequest(f"tags: the embedded server releases 'weights' and 'kv_cache' together, got {tags!r}")


class RolloutServer(BackgroundServer):
    """`build_app(backend)` served from a background thread, on a port the OS picks."""

    def __init__(self, backend, host: str = "127.0.0.1", port: int = 0):
        super().__init__(build_app(backend), "rollout server", host, port)


# ---- the command line: `python -m engines.rollout_server`, a stand-in for `python -m sglang.launch_server` ------
# SGLang's launch_server flags the embedded server takes (names, defaults and meanings from SGLang's server_args);
# any other flag is refused by name rather than ignored
DTYPE_FLAGS = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
               "float32": "float32"}


def main(argv: list[str] | None = None) -> None:
    """Serve one model as `sglang.launch_server` would, with the subset of its flags the embedded engine has:
    --model-path (--model), --host, --port, --dtype, --device, --context-length, --max-running-requests,
    --random-seed. Stops on SIGTERM / SIGINT."""
    import argparse
    import random

    import numpy as np
    import torch

    from engines.rollout_torch import TorchRolloutBackend

    parser = argparse.ArgumentParser(prog="python -m engines.rollout_server", allow_abbrev=False,
                                     description="rlflow's embedded rollout server with SGLang's routes and a "
                                     "subset of sglang.launch_server's flags.")
    parser.add_argument("--model-path", "--model", dest="model_path", required=True,
                        help="A local Hugging Face model folder.")
    parser.add_argument("--host", default="127.0.0.1", help="The host of the HTTP server.")
    parser.add_argument("--port", type=int, default=30000, help="The port of the HTTP server.")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_FLAGS],
                        help="Weights and compute dtype; auto: the checkpoint's (SGLang's auto serves FP32 "
                        "checkpoints in FP16).")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="Default: cuda when a GPU is visible, else cpu.")
    parser.add_argument("--context-length", type=int, default=None,
                        help="Tokens per sequence, prompt included (default: min(4096, the model's maximum)).")
    parser.add_argument("--max-running-requests", type=int, default=None,
                        help="Requests decoded together (KV-cache slots; default 512).")
    parser.add_argument("--random-seed", type=int, default=None,
                        help="Seeds the server's random generators (requests without a sampling_seed).")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")] or unknown
        known = sorted({s for a in parser._actions for s in a.option_strings} - {"-h", "--help"})
        parser.error(f"the embedded server does not support {', '.join(flags)} (it takes SGLang's {', '.join(known)})")

    if args.random_seed is not None:
        random.seed(args.random_seed)
        np.random.seed(args.random_seed % 2**32)
        torch.manual_seed(args.random_seed)
    dtype_name = DTYPE_FLAGS.get(args.dtype)
    if dtype_name is None:  # auto: the dtype the checkpoint was saved in
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        saved = config.get("torch_dtype") or config.get("dtype")
        dtype_name = saved if saved in ("float32", "bfloat16", "float16") else "float32"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = {"batch_size": args.max_running_requests, "context_len": args.context_length}
    backend = TorchRolloutBackend(args.model_path, device=device, dtype=getattr(torch, dtype_name),
                                  **{k: v for k, v in kwargs.items() if v is not None})
    server = uvicorn.Server(uvicorn.Config(build_app(backend), host=args.host, port=args.port, log_level="warning",
                                          lifespan="off", timeout_keep_alive=30))
    print(f"rlflow embedded rollout server: {args.model_path} ({device}, {dtype_name}) on "
          f"http://{args.host}:{args.port}", flush=True)
    try:
        server.run()  # returns on SIGTERM / SIGINT
    finally:
        backend.close()


if __name__ == "__main__":
    main()
