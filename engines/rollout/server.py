"""The embedded rollout server: SGLang's native HTTP routes (and the OpenAI-compatible ones, in
engines/rollout/openai_api.py) for one TorchRolloutBackend, on an ephemeral port.

The engine runs in its own background loop; handlers submit requests and await their futures, so
concurrent HTTP requests share decode steps (continuous batching). Field names and meanings are
SGLang's; where the embedded server differs it is written in docs/rollout.md. `GET /metrics` is rlflow's
(Prometheus, engines/rollout/metrics.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models.routing import routing_to_text
from rlflow.engines.rollout.http_api import (
    MEMORY_TAGS,
    BackgroundServer,
    BadRequest,
    EngineClient,
    body_error,
    check_fields,
    fast_json,
    finite,
    image_items,
    read_json,
    require_token,
    sampling_params,
    sse,
    weight_version_text,
)
from rlflow.engines.rollout.lora_routes import add_lora_routes, check_adapter
from rlflow.engines.rollout.metrics import RolloutCollector, add_metrics_route
from rlflow.engines.rollout.openai_api import add_openai_routes
from rlflow.engines.rollout.weight_routes import add_weight_routes

# /generate fields the embedded server reads; others it accepts only at their no-op default
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "stream", "lora_path",
                   "return_routed_experts", "image_data"}
# (sglang-router 0.3.2 fills in model, background, no_logs, return_bytes, return_entropy, ... on every request)
GENERATE_NO_OP = {"logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False,
                  "log_metrics": True, "return_hidden_states": False,
                  "custom_logit_processor": None, "session_params": None, "token_ids_logprob": None, "model": None,
                  "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False}


def build_app(backend, token: str | None = None, weight_dirs: Sequence[str | Path] = ()) -> FastAPI:
    """The server's routes; with `token`, control routes need it (http_api.require_token). /update_weights_from_disk
    loads from the backend's model folder and `weight_dirs` only (weight_routes.within)."""
    app = FastAPI(title="rlflow embedded rollout server")
    require_token(app, token)
    client = EngineClient(backend)
    app.state.client = client
    app.state.model_path = backend.model_path  # as SGLang: the folder of the last /update_weights_from_disk

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
        return body_error(exc)

    # ---- generation ------------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        body = await read_json(request)
        check_fields(body, GENERATE_FIELDS, GENERATE_NO_OP, "/generate")
        prompts, batched = _prompts(client, body)
        check_adapter(backend, body.get("lora_path"), len(prompts))
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
        images = image_items(body.get("image_data"), len(prompts), batched)
        routed = bool(body.get("return_routed_experts"))
        if routed and not backend.engine.record_routing:
            raise BadRequest("return_routed_experts: this server does not record expert routing (the rollout workers "
                             "record it when algorithm.routing_replay is r3, on an MoE model)")
        requests, logprob_of = [], []
        for i, (prompt, raw, rid) in enumerate(zip(prompts, per_item, rids, strict=True)):
            params, seed = sampling_params(raw, "sampling_params" + (f"[{i}]" if isinstance(raw_params, list) else ""))
            if images is None or not images[i]:
                new = client.requests([prompt], params, seed, rid, None)
            else:  # decoding and processing pictures (the vision encoder's cache misses) must not hold the loop
                new = await asyncio.to_thread(client.requests, [prompt], params, seed, rid, [images[i]])
            requests += new
            flag = return_logprob[i] if isinstance(return_logprob, list) else return_logprob
            logprob_of += [bool(flag)] * len(new)
        t0 = time.perf_counter()
        if body.get("stream"):
            return StreamingResponse(_generate_stream(client, requests, logprob_of, t0, routed),
                                     media_type="text/event-stream")
        gens = await client.run(requests)
        out = [_generate_item(client, g.prompt_ids, g.output_ids, g.output_logprobs, g.finish_reason, g.rid,
                              _versions(g), logprob_of[i], time.perf_counter() - t0,
                              g.routed_experts if routed else None) for i, g in enumerate(gens)]
        return fast_json(out if batched or len(out) > 1 else out[0])

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_json(request)
        check_fields(body, {"rid", "abort_all"}, {}, "/abort_request")
        if not body.get("abort_all") and not body.get("rid"):
            raise BadRequest("/abort_request: give a rid or abort_all: true")
        client.engine.abort(body.get("rid"), bool(body.get("abort_all")))
        return Response(status_code=200)

    # ---- memory ----------------------------------------------------------------------------------------
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if await asyncio.to_thread(client.engine.drop_cache):
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: requests are running.\n", status_code=400)

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        _tags(await read_json(request))
        try:
            await asyncio.to_thread(backend.release_memory_occupation)
        except RuntimeError as exc:
            raise BadRequest(str(exc)) from None
        return Response(status_code=200)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        tags = _tags(await read_json(request))
        await asyncio.to_thread(backend.resume_memory_occupation, tags)
        return Response(status_code=200)

    # ---- pausing (a weight update under generation lands whole, between decode steps) --------------------
    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await read_json(request)
        check_fields(body, {"mode"}, {}, "/pause_generation")
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode: one of abort, retract, in_place; got {mode!r}")
        if mode == "abort":  # SGLang's default: what is queued or running returns now, aborted
            client.engine.abort(abort_all=True)
        # retract and in_place alike: requests keep their KV cache here and continue after /continue_generation
        await asyncio.to_thread(backend.pause_generation)
        return Response(status_code=200)

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        check_fields(await read_json(request), set(), {}, "/continue_generation")
        backend.continue_generation()
        return Response(status_code=200)

    # ---- information -----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        prompt = [client.tokenizer.bos_token_id if client.tokenizer.bos_token_id is not None else 0]
        await client.run(client.requests([prompt], SamplingParams(max_new_tokens=1), seed=0))
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info():
        cfg = backend.model.config
        return {"model_path": app.state.model_path, "tokenizer_path": backend.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": weight_version_text(backend.weight_version),
                "model_type": cfg.model_type, "architectures": list(cfg.architectures or []),
                "has_image_understanding": False, "has_audio_understanding": False}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info():
        engine = client.engine
        return {"model_path": app.state.model_path, "tokenizer_path": backend.model_path,
                "served_model_name": backend.model_path, "device": str(backend.device),
                "dtype": str(backend.model.dtype).removeprefix("torch."), "context_length": engine.max_len,
                "tp_size": 1, "pp_size": 1, "dp_size": 1, "max_running_requests": engine.max_running,
                "max_total_num_tokens": engine.max_total_tokens,
                "page_size": engine.kv.page_size, "chunked_prefill_size": engine.kv.prefill_chunk_tokens,
                "weight_version": weight_version_text(backend.weight_version), "version": "rlflow-embedded",
                "enable_lora": backend.lora is not None,
                "max_lora_rank": backend.lora.rank if backend.lora else None,
                "lora_target_modules": backend.lora.target_modules if backend.lora else None,
                "max_loras_per_batch": 1, "loaded_adapters": backend.loaded_adapters(),
                "internal_states": [{"num_requests": engine.num_requests(),
                                     "memory_released": bool(backend._released), **engine.stats()}]}

    add_openai_routes(app, backend, client)
    add_weight_routes(app, backend, client, weight_dirs)  # SGLang's weight routes (engines/rollout/weight_routes.py)
    add_lora_routes(app, backend, client, weight_dirs)  # SGLang's LoRA routes (engines/rollout/lora_routes.py)
    add_metrics_route(app, RolloutCollector(backend))  # Prometheus, open and read-only (engines/rollout/metrics.py)
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


def _versions(g) -> tuple[int, int]:
    """(first, last) weight version of a Generation or a running Request: they differ when an update landed
    while it generated."""
    last = g.last_weight_version
    return g.weight_version, g.weight_version if last is None else last


def _generate_item(client: EngineClient, prompt_ids, output_ids, output_logprobs, finish_reason, rid,
                   versions: tuple[int, int], with_logprobs: bool, latency: float,
                   routed_experts: np.ndarray | None = None) -> dict:
    """SGLang's item. `weight_version` is the version it finished with, as SGLang's is; `first_weight_version`
    (rlflow's) the version it started with; `routed_experts` as SGLang's (base64 int32, [tokens - 1, layers,
    k] flat)."""
    meta = {"id": rid, "finish_reason": finish_reason, "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(output_ids), "cached_tokens": 0,
            "weight_version": weight_version_text(versions[1]),
            "first_weight_version": weight_version_text(versions[0]), "e2e_latency": latency}
    if with_logprobs:
        meta["output_token_logprobs"] = [[finite(lp), tok, None] for lp, tok in zip(output_logprobs, output_ids,
                                                                                     strict=True)]
    if routed_experts is not None:
        meta["routed_experts"] = routing_to_text(routed_experts)
    return {"text": client.output_text(output_ids, finish_reason), "output_ids": list(output_ids), "meta_info": meta}


async def _generate_stream(client: EngineClient, requests, logprob_of: list[bool], t0: float, routed: bool = False):
    """SGLang's stream: one `data:` event per new token with the cumulative text, output ids and meta_info
    (finish_reason null until the last; `routed`: the last one carries the routed experts), an `index` per batch
    item, then `data: [DONE]`."""
    try:
        async for ev in client.stream(requests):
            r = requests[ev.index]
            finish = ev.final.finish_reason if ev.final is not None else None
            versions = _versions(ev.final if ev.final is not None else r)
            item = _generate_item(client, r.prompt, ev.output_ids, ev.output_logprobs, finish, r.rid, versions,
                                  logprob_of[ev.index], time.perf_counter() - t0,
                                  ev.final.routed_experts if routed and ev.final is not None else None)
            yield sse(item | {"index": ev.index})
    except BadRequest as exc:
        yield sse({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}})
    yield b"data: [DONE]\n\n"


def _tags(body: dict) -> list[str] | None:
    check_fields(body, {"tags"}, {}, "memory occupation")
    tags = body.get("tags")
    if tags is not None and not set(tags) <= set(MEMORY_TAGS):
        raise BadRequest(f"tags: SGLang's are {list(MEMORY_TAGS)} (the embedded server releases them together and "
                         f"resumes its weights by the 'weights' tag; its KV cache is allocated as it generates), "
                         f"got {tags!r}")
    return tags


class RolloutServer(BackgroundServer):
    """`build_app(backend)` served from a background thread, on a port the OS picks."""

    def __init__(self, backend, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 weight_dirs: Sequence[str | Path] = ()):
        super().__init__(build_app(backend, token, weight_dirs), "rollout server", host, port)
