"""What the HTTP routes share: SGLang sampling fields -> SamplingParams, awaiting and streaming engine
requests from asyncio, output text, and the tensor payload of `/update_weights_from_tensor`.

Tensor payloads are base64 of safetensors bytes, never pickle (SGLang sends pickled tensors: see
docs/rollout.md).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
import torch
import uvicorn
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.rollout.engine import Generation, Request

# SGLang sampling fields the engine implements, and those it accepts only at their no-op value
SUPPORTED = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "n", "ignore_eos"}
NO_OP = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
         "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False}
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


class BadRequest(ValueError):
    """Bad input from a client: answered with status 400 and this message (which names the field)."""


def sampling_params(raw: dict[str, Any] | None, where: str = "sampling_params") -> tuple[SamplingParams, int | None]:
    """SGLang's sampling_params dict -> (SamplingParams, sampling_seed)."""
    raw = dict(raw or {})
    seed = raw.pop("sampling_seed", None)
    fields: dict[str, Any] = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS}
    for key, value in raw.items():
        if key in SUPPORTED:
            if value is not None:
                fields[key] = value
        elif key in NO_OP:
            if value is not None and value != NO_OP[key]:
                raise BadRequest(f"{where}.{key}: the embedded engine supports only {NO_OP[key]!r}, got {value!r}")
        else:
            raise BadRequest(f"{where}.{key}: unknown sampling parameter (supported: {sorted(SUPPORTED)})")
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    try:
        return SamplingParams(**fields), (None if seed is None else int(seed))
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"{where}: {exc}") from None


def image_items(raw: Any, prompts: int, batched: bool) -> list[list[str] | None] | None:
    """/generate's image_data as a list per prompt (None: no images). SGLang's forms: for one request a list of
    images or one image as a string; for a batch a list with an entry per prompt, each of those forms or null."""
    if raw is None:
        return None
    if not batched:
        raw = [raw]
    if not isinstance(raw, list) or len(raw) != prompts:
        raise BadRequest(f"image_data: expected a list of {prompts} entries (one per prompt), got "
                         f"{len(raw) if isinstance(raw, list) else type(raw).__name__}")
    out: list[list[str] | None] = []
    for i, item in enumerate(raw):
        item = [item] if isinstance(item, str) else item
        if item is not None and not (isinstance(item, list) and all(isinstance(x, str) for x in item)):
            raise BadRequest(f"image_data{f'[{i}]' if batched else ''}: expected an image (a data URI, base64 or a "
                             "path) or a list of them")
        out.append(item or None)
    return out


class EngineClient:
    """The asyncio side of one backend's engine."""

    def __init__(self, backend):
        self.backend, self.engine, self.tokenizer = backend, backend.engine, backend.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self.engine.tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        with self.engine.tokenizer_lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def output_text(self, output_ids: list[int], finish_reason: dict | None) -> str:
        """Decoded output; a matched stop string is cut off, as SGLang does."""
        text = self.decode(output_ids)
        matched = (finish_reason or {}).get("matched")
        if isinstance(matched, str) and matched and text.endswith(matched):
            text = text[: -len(matched)]
        return text

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise BadRequest("messages: the model's tokenizer has no chat template (use /v1/completions)")
        with self.engine.tokenizer_lock:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def requests(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
                 rid: str | None = None, images: list[list[str]] | None = None) -> list[Request]:
        """The backend's requests; `images` per prompt (vision-language models: images that do not match the
        prompt's placeholders are a bad request)."""
        try:
            if images is None:  # text-only backends (and tests' stand-ins) take no images argument
                return self.backend.requests(prompts, params, seed, rid)
            return self.backend.requests(prompts, params, seed, rid, image_data=images)
        except (RuntimeError, ValueError) as exc:
            raise BadRequest(str(exc)) from None

    async def run(self, requests: list[Request]) -> list[Generation]:
        futures = self.engine.submit(requests)
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except (ValueError, RuntimeError) as exc:
            raise BadRequest(str(exc)) from None
        except asyncio.CancelledError:  # the client went away: free the slots
            for r in requests:
                self.engine.abort(r.rid)
            raise

    async def stream(self, requests: list[Request]) -> AsyncIterator[StreamEvent]:
        """Events as tokens arrive: one per new token of any request, and one final (with the
        Generation) per request. A client that disconnects aborts what is still running."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        for i, r in enumerate(requests):
            def on_token(r: Request, i: int = i) -> None:
                snapshot = StreamEvent(i, list(r.output_ids), list(r.output_logprobs), None)
                loop.call_soon_threadsafe(queue.put_nowait, snapshot)

            r.on_token = on_token
        futures = self.engine.submit(requests)
        for i, f in enumerate(futures):
            f.add_done_callback(lambda f, i=i: loop.call_soon_threadsafe(queue.put_nowait, StreamEvent(i, future=f)))
        done = 0
        try:
            while done < len(requests):
                event = await queue.get()
                if event.future is not None:
                    done += 1
                    try:
                        event.final = event.future.result()
                    except (ValueError, RuntimeError) as exc:
                        raise BadRequest(str(exc)) from None
                    event.output_ids, event.output_logprobs = event.final.output_ids, event.final.output_logprobs
                yield event
        finally:
            if done < len(requests):
                for r in requests:
                    self.engine.abort(r.rid)


@dataclass
class StreamEvent:
    index: int
    output_ids: list[int] | None = None
    output_logprobs: list[float] | None = None
    future: Any = None
    final: Generation | None = None


# SGLang's GPU memory tags for /release_memory_occupation and /resume_memory_occupation (sglang/srt/constants.py)
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
# SGLang's --weight-version default: what a fresh server reports until an update names a version
DEFAULT_WEIGHT_VERSION = "default"


def parse_weight_version(value: Any, where: str = "weight_version") -> int:
    """rlflow's integer weight version from SGLang's string one. SGLang numbers weights with any string and a fresh
    server says "default" (its launch weights: rlflow's version 0); rlflow only ever sends integers."""
    if value is None or value == DEFAULT_WEIGHT_VERSION:
        return 0
    if isinstance(value, bool):
        raise ValueError(f"{where}: {value!r} is not a weight version (an integer, or SGLang's 'default')")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {value!r} is not a weight version rlflow sent (an integer, or SGLang's "
                         f"{DEFAULT_WEIGHT_VERSION!r} for a server's launch weights)") from None


def weight_version_text(version: int) -> str:
    """The weight_version field as SGLang answers it: "default" for the launch weights, else the number sent."""
    return DEFAULT_WEIGHT_VERSION if version == 0 else str(version)


def finite(x: float) -> float | None:
    """JSON has no -inf: a zero-probability token's logprob is reported as null."""
    return x if math.isfinite(x) else None


# ---- tensor payloads --------------------------------------------------------------------------------------
def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """HF-named tensors -> base64 of safetensors bytes: one item of `serialized_named_tensors`."""
    return base64.b64encode(safetensors_save({n: t.detach().cpu().contiguous() for n, t in named})).decode()


def deserialize_named_tensors(item: Any, where: str) -> dict[str, torch.Tensor]:
    if not isinstance(item, str):
        raise BadRequest(f"{where}: expected a base64 string of safetensors bytes, got {type(item).__name__}")
    try:
        return safetensors_load(base64.b64decode(item, validate=True))
    except Exception as exc:
        raise BadRequest(f"{where}: not base64 of safetensors bytes ({exc}); the embedded server never "
                         "unpickles, so SGLang's pickled MultiprocessingSerializer payload is refused") from None


# routes that change a server's state or make it act (weights, memory, aborts, the cache, process groups); with a
# control token, each needs `Authorization: Bearer <token>` (SGLang's --api-key header), generation does not
CONTROL_ROUTES = frozenset({
    "/abort_request", "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
    "/update_weights_from_tensor", "/update_weights_from_disk", "/update_weights_from_distributed",
    "/init_weights_update_group", "/destroy_weights_update_group", "/pause_generation", "/continue_generation",
    "/load_lora_adapter", "/unload_lora_adapter", "/update_weight_version",
})


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def require_token(app, token: str | None) -> None:
    """Refuse control routes without the run's token (401). A server reachable beyond loopback (a run over
    several nodes) must not take weights or aborts from whoever can reach its port."""
    if not token:
        return
    expected = f"Bearer {token}".encode()

    @app.middleware("http")
    async def check(request: HTTPRequest, call_next):
        if request.url.path in CONTROL_ROUTES and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), expected):
            return JSONResponse({"error": {"message": f"{request.url.path}: needs the run's control token "
                                           "(Authorization: Bearer ...)", "code": 401}}, status_code=401)
        return await call_next(request)


class BackgroundServer:
    """uvicorn serving an ASGI app from a daemon thread on `port` (0: one the OS picks); `url` once started."""

    def __init__(self, app, name: str, host: str = "127.0.0.1", port: int = 0):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.host, self.port = host, sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        # log_config=None: uvicorn's own dictConfig would reconfigure this whole process's logging, closing every
        # handler (Prefect's API log handler included) under logging's lock; that deadlocked a flow run whose
        # heartbeat thread asked for a logger meanwhile
        self._server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", lifespan="off",
                                                     timeout_keep_alive=30))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name=name)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name} on {self.url} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def body_error(exc: BadRequest) -> JSONResponse:
    return JSONResponse({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}}, status_code=400)


async def read_json(request: HTTPRequest) -> dict[str, Any]:
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


def fast_json(obj: Any) -> Response:
    """Serialize with orjson, skipping FastAPI's per-element encoder: a batch's token and logprob lists are
    most of a /generate response, and encoding them element by element cost more than generating them."""
    return Response(orjson.dumps(obj), media_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def check_fields(body: dict, known: set[str], no_op: dict[str, Any], route: str) -> None:
    for key, value in body.items():
        if key in known:
            continue
        if key in no_op:
            if value is not None and value != no_op[key]:
                raise BadRequest(f"{route}: field {key!r} is not supported by the embedded server (only "
                                 f"{no_op[key]!r})")
        else:
            raise BadRequest(f"{route}: unknown field {key!r} (known: {sorted(known)})")
