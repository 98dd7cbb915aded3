"""OpenAI-compatible routes of the embedded rollout server: `/v1/models`, `/v1/completions` and
`/v1/chat/completions` (also streamed), usable by the official `openai` client. SGLang's extra sampling
fields (top_k, min_p, stop_token_ids, ignore_eos) may come in the body (the client's `extra_body`).
A LoRA adapter is chosen as SGLang chooses it, by `"model": "<base>:<adapter name>"` (engines/rollout/lora_routes.py).
Token in, token out for agent harnesses (docs/agents.md): `"return_token_ids": true` adds each choice's
`prompt_token_ids` and `token_ids` (the engine's ids, never re-encoded text), as SGLang's OpenAI server does, and
/v1/completions takes `prompt` as token ids (a list of ints, or a list of such lists). Chat messages may carry
OpenAI's image_url content parts (data URIs) for a vision-language model (`chat_messages`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from rlflow.engines.models.vision_language import messages_with_images
from rlflow.engines.rollout.http_api import BadRequest, EngineClient, finite, read_json, sampling_params, sse
from rlflow.engines.rollout.lora_routes import check_adapter

COMMON = {"model", "n", "temperature", "top_p", "stop", "seed", "stream", "user", "max_tokens", "top_k", "min_p",
          "stop_token_ids", "ignore_eos", "rid", "stream_options", "return_token_ids"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
NO_OP = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "echo": False, "top_logprobs": 0, "tools": None,
         "tool_choice": None, "response_format": None, "logit_bias": None, "best_of": 1, "suffix": None,
         "parallel_tool_calls": None, "no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False,
         "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True}
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _params(body: dict, max_tokens: int | None) -> tuple[Any, int | None]:
    raw = {k: body[k] for k in ("n", "temperature", "top_p", "stop", "top_k", "min_p", "stop_token_ids", "ignore_eos")
           if body.get(k) is not None}
    if max_tokens is not None:
        raw["max_new_tokens"] = max_tokens
    if body.get("seed") is not None:
        raw["sampling_seed"] = body["seed"]
    return sampling_params(raw, "request")


def _check(body: dict, known: set[str], route: str) -> None:
    for key, value in body.items():
        if key in known:
            continue
        if key not in NO_OP:
            raise BadRequest(f"{route}: unknown field {key!r}")
        if value is not None and value != NO_OP[key]:
            raise BadRequest(f"{route}: field {key!r} is not supported by the embedded server")


def _token_ids(body: dict, route: str) -> bool:
    """The request's return_token_ids (a bool)."""
    want = body.get("return_token_ids")
    if want is not None and not isinstance(want, bool):
        raise BadRequest(f"{route}: return_token_ids: expected true or false")
    return bool(want)


def _with_ids(choice: dict, g, want: bool) -> dict:
    if want:
        choice |= {"prompt_token_ids": list(g.prompt_ids), "token_ids": list(g.output_ids)}
    return choice


def _usage(gens) -> dict:
    prompt = sum(len(p) for p in {id(g.prompt_ids): g.prompt_ids for g in gens}.values())
    completion = sum(len(g.output_ids) for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def requested_adapter(model: Any, base: str) -> str | None:
    """The adapter an OpenAI request names in `model` ("<base>:<adapter>", SGLang's syntax), or None (the base)."""
    if not isinstance(model, str) or model == base or ":" not in model:
        return None
    return model.rsplit(":", 1)[1]


def add_openai_routes(app: FastAPI, backend, client: EngineClient) -> None:
    model_name = backend.model_path

    @app.get("/v1/models")
    async def models():
        cards = [{"id": model_name, "object": "model", "created": 0, "owned_by": "rlflow", "root": model_name,
                  "max_model_len": client.engine.max_len}]
        for name, path in backend.loaded_adapters().items():  # as SGLang lists a loaded adapter
            cards.append({"id": name, "object": "model", "created": 0, "owned_by": "rlflow", "root": path,
                          "parent": model_name, "max_model_len": client.engine.max_len})
        return {"object": "list", "data": cards}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        _check(body, COMPLETION_FIELDS, "/v1/completions")
        check_adapter(backend, requested_adapter(body.get("model"), model_name), 1, "model")
        prompts = _completion_prompts(client, body.get("prompt"))
        params, seed = _params(body, body.get("max_tokens") if body.get("max_tokens") is not None else 16)
        requests = [r for p in prompts for r in client.requests([p], params, seed)]
        with_logprobs = body.get("logprobs") is not None and body.get("logprobs") is not False
        want_ids = _token_ids(body, "/v1/completions")
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.get("stream"):
            return StreamingResponse(_stream(client, requests, cid, created, model_name, chat=False, ids=want_ids),
                                     media_type="text/event-stream")
        gens = await client.run(requests)
        choices = []
        for i, g in enumerate(gens):
            choice = {"index": i, "text": client.output_text(g.output_ids, g.finish_reason),
                      "finish_reason": FINISH[g.finish_reason["type"]], "matched_stop": g.finish_reason.get("matched"),
                      "logprobs": None}
            if with_logprobs:
                tokens = [client.decode([t]) for t in g.output_ids]
                offsets = [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": [finite(x) for x in g.output_logprobs],
                                      "top_logprobs": None, "text_offset": offsets}
            choices.append(_with_ids(choice, g, want_ids))
        return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": _usage(gens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        _check(body, CHAT_FIELDS, "/v1/chat/completions")
        check_adapter(backend, requested_adapter(body.get("model"), model_name), 1, "model")
        messages, images = chat_messages(body.get("messages"))
        want_ids = _token_ids(body, "/v1/chat/completions")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        params, seed = _params(body, max_tokens)
        if images and getattr(client.backend, "vision", None) is None:
            raise BadRequest(f"messages: {len(images)} image part(s) for {model_name}, which is not a vision-language "
                             "model (Qwen2-VL, Qwen2.5-VL)")
        if images:  # decoding and processing pictures must not hold the event loop (as /generate's)
            requests = await asyncio.to_thread(client.requests, [client.chat_prompt(messages)], params, seed, None,
                                               [images])
        else:
            requests = client.requests([client.chat_prompt(messages)], params, seed)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.get("stream"):
            return StreamingResponse(_stream(client, requests, cid, created, model_name, chat=True, ids=want_ids),
                                     media_type="text/event-stream")
        gens = await client.run(requests)
        choices = []
        for i, g in enumerate(gens):
            logprobs = None
            if body.get("logprobs"):
                logprobs = {"content": [{"token": client.decode([t]), "logprob": finite(x), "bytes": None,
                                         "top_logprobs": []} for t, x in zip(g.output_ids, g.output_logprobs,
                                                                             strict=True)]}
            choices.append(_with_ids({"index": i, "message": {
                "role": "assistant", "content": client.output_text(g.output_ids, g.finish_reason)},
                "finish_reason": FINISH[g.finish_reason["type"]], "matched_stop": g.finish_reason.get("matched"),
                "logprobs": logprobs}, g, want_ids))
        return {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": _usage(gens)}


def chat_messages(messages: Any) -> tuple[list[dict], list[str]]:
    """OpenAI chat messages as the tokenizer's chat template takes them, and their images in order. A message's
    content is a string or a list of parts: {"type": "text", "text"} and {"type": "image_url", "image_url": {"url":
    "data:image/...;base64,..."}} (or the url as a string). With images, parts become the template's {"type":
    "image"} / {"type": "text"} parts (a vision-language model's template places one image pad per picture; the
    engine expands it). Without, a message's text parts are joined by newlines into one string, as text-only
    templates expect. Only data URIs: this server fetches nothing from the network."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of {role, content} objects")
    images: list[str] = []
    parts_of: list[list[dict] | None] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}]: expected {{'role': str, 'content': str or a list of parts}}")
        content = m.get("content")
        if isinstance(content, str):
            parts_of.append(None)
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{i}].content: expected a string or a list of text / image_url parts")
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url.startswith("data:"):
                    raise BadRequest(f"{where}.image_url.url: expected a data URI (data:image/png;base64,...); this "
                                     "server fetches no URLs")
                images.append(url)
                parts.append({"type": "image"})
            else:
                raise BadRequest(f"{where}: expected {{'type': 'text', 'text': str}} or {{'type': 'image_url', "
                                 "'image_url': {'url': data URI}}")
        parts_of.append(parts)
    if images:  # the content-parts form (string contents as one text part), as data rows' messages are placed
        placed = [m if parts is None else {**m, "content": parts} for m, parts in zip(messages, parts_of, strict=True)]
        return messages_with_images(placed, len(images), "messages"), images
    return [m if parts is None else {**m, "content": "\n".join(p["text"] for p in parts)}
            for m, parts in zip(messages, parts_of, strict=True)], images


def _completion_prompts(client: EngineClient, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [client.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [client.encode(p) for p in prompt]
        if all(isinstance(t, int) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return prompt
    raise BadRequest("prompt: expected a string, a list of strings, a list of token ids or a list of such lists")


async def _stream(client: EngineClient, requests, cid: str, created: int, model: str, chat: bool, ids: bool = False):
    """OpenAI's streamed chunks: text deltas per choice, the finish_reason on the choice's last chunk. `ids`
    (return_token_ids): each chunk's new `token_ids` too, and the choice's first chunk its `prompt_token_ids`."""
    sent = [""] * len(requests)
    sent_ids = [-1] * len(requests)  # token ids sent per choice; -1: none yet (the prompt's ids not sent either)
    obj = "chat.completion.chunk" if chat else "text_completion"
    try:
        async for ev in client.stream(requests):
            finish = ev.final.finish_reason if ev.final is not None else None
            text = client.output_text(ev.output_ids, finish)
            if finish is None and "\ufffd" in text[len(sent[ev.index]):]:
                continue  # an incomplete multi-byte character: wait for the next token
            delta, sent[ev.index] = text[len(sent[ev.index]):], text
            reason = None if finish is None else FINISH[finish["type"]]
            if chat:
                choice = {"index": ev.index, "delta": {"role": "assistant", "content": delta}, "logprobs": None,
                          "finish_reason": reason}
            else:
                choice = {"index": ev.index, "text": delta, "logprobs": None, "finish_reason": reason}
            if ids:
                if sent_ids[ev.index] < 0:
                    choice["prompt_token_ids"], sent_ids[ev.index] = list(requests[ev.index].prompt), 0
                choice["token_ids"] = list(ev.output_ids[sent_ids[ev.index]:])
                sent_ids[ev.index] = max(sent_ids[ev.index], len(ev.output_ids))
            yield sse({"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]})
    except BadRequest as exc:
        yield sse({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}})
    yield b"data: [DONE]\n\n"
