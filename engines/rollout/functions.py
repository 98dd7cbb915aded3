"""Rollout functions: how one prompt becomes samples, by talking HTTP to the rollout router.

A rollout function is async and named by import path in the recipe (`rollout.fn`):

    async def my_rollout(prompt: PromptSample, router_url: str, sampling_params: dict) -> list[Sample]

It returns `prompt.n` samples (one group). It may talk to the router however it likes: SGLang's native
`/generate` (through `generate` below), the OpenAI-compatible `/v1` routes, several turns with tool calls
in between. The router fronts the embedded servers or real SGLang alike, so the function never knows which.
`single_turn` is the default rollout, written on this same interface.

The framework (`RolloutRunner`) calls the function once per prompt, all prompts concurrently, on one event
loop. `generate` gathers the /generate calls that are pending on that loop into one batched request per
rollout worker, so a step's 64 x 8 single-turn samples cost a couple of HTTP requests, not 512.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import itertools
import math
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import numpy as np

from rlflow.engines.data.rewards import load_callable
from rlflow.engines.models.routing import routing_from_text
from rlflow.engines.models.vision_language import IMAGE_PAD, collapse_image_pads
from rlflow.engines.rollout.http_api import DEFAULT_WEIGHT_VERSION, auth_headers, parse_weight_version

FINISH_REASONS = ("stop", "length", "abort")
# requests sent while a tag is set get rids "<tag>-<n>", so a dynamic-sampling collection can abort its own
REQUEST_TAG: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlflow_request_tag", default=None)
# calls made under one group key go out as their own request (dynamic sampling: one per prompt group, so a
# group's answer arrives as soon as the group is done, not when the whole batch is)
REQUEST_GROUP: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlflow_request_group", default=None)
_OUTSTANDING: dict[str, set[str]] = {}  # tag -> rids sent and not answered yet
_ABORTED: set[str] = set()  # tags whose requests are aborted: later calls return at once, aborted


@dataclass
class PromptSample:
    """One prompt of the step, as the rollout function receives it."""

    index: int  # position in the step's batch of prompts
    prompt: str
    label: Any
    prompt_ids: list[int]  # the prompt encoded with the recipe's chat template
    n: int  # samples to return: rollout.samples_per_prompt (1 at evaluation)
    seed: int  # sampling seed of the group's first sample; sample j uses seed + j (reproducible runs)
    row: dict = field(default_factory=dict)  # the data row the prompt came from (extra keys included)
    tokenizer: Any = field(default=None, repr=False)  # the policy's tokenizer (to tokenize tool outputs)
    # routing replay r3: ask the engine for each token's experts (generate's return_routed_experts) and keep them
    # in Sample.routed_experts
    record_routing: bool = False
    # vision-language prompts: the images' content digests (sha256 hex, the run store's keys), in prompt order, and
    # the same images as /generate's `image_data` takes them (base64 data URIs); empty for text prompts
    images: list[str] = field(default_factory=list)
    image_data: list[str] = field(default_factory=list, repr=False)


@dataclass
class Sample:
    """One generated response. `response_ids` is everything after the prompt: the model's tokens and, in
    multi-turn rollouts, the tool or environment tokens between its turns (with loss_mask 0 there)."""

    response_ids: list[int]
    logprobs: list[float] | None = None  # behaviour-policy logprob per response token (0 where loss_mask is 0);
    # None: the trainer computes them before training (the sample is then treated as on-policy)
    loss_mask: list[int] | None = None  # 1: a model token trained on; 0: a tool/environment token; None: all 1
    reward: float | None = None  # None: the recipe's reward.fn scores the sample
    response: str | None = None  # the text the reward sees; None: decoded from response_ids
    finish_reason: str = "stop"  # stop | length | abort
    weight_version: int | None = None  # weights that generated it (the oldest, if it spanned an update)
    last_weight_version: int | None = None  # the newest weights that generated a token of it (None: weight_version)
    prompt_ids: list[int] | None = None  # None: the PromptSample's
    metadata: dict = field(default_factory=dict)
    # routing replay r3: the experts of every token fed to the model (prompt and response but the last token), in
    # SGLang's layout [tokens, MoE layers, k] flattened, int16; rows past the end route live in the trainer
    routed_experts: np.ndarray | None = None


RolloutFn = Callable[[PromptSample, str, dict], Awaitable[list[Sample]]]


def load_rollout_fn(path: str) -> RolloutFn:
    """Import the recipe's rollout.fn; it must be an async function."""
    fn = load_callable(path, "rollout.fn")
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"rollout.fn: {path!r} must be an async function (async def f(prompt, router_url, "
                        "sampling_params) -> list[Sample])")
    return fn


def check_group(samples: Any, prompt: PromptSample, name: str) -> list[Sample]:
    """The function's result, or an error naming the function and what was wrong."""
    if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
        raise TypeError(f"rollout.fn: {name} returned {type(samples).__name__}; expected a list of Sample")
    if len(samples) != prompt.n:
        raise ValueError(f"rollout.fn: {name} returned {len(samples)} samples for prompt {prompt.index}; "
                         f"expected {prompt.n} (rollout.samples_per_prompt)")
    for j, s in enumerate(samples):
        where = f"rollout.fn: {name}, prompt {prompt.index} sample {j}"
        n = len(s.response_ids)
        if s.logprobs is not None and len(s.logprobs) != n:
            raise ValueError(f"{where}: {len(s.logprobs)} logprobs for {n} response tokens")
        if s.loss_mask is not None and (len(s.loss_mask) != n or any(m not in (0, 1) for m in s.loss_mask)):
            raise ValueError(f"{where}: loss_mask must hold {n} zeros and ones")
        if s.reward is not None and not math.isfinite(s.reward):
            raise ValueError(f"{where}: reward {s.reward!r} is not a finite number")
        if s.finish_reason not in FINISH_REASONS:
            raise ValueError(f"{where}: finish_reason {s.finish_reason!r}; expected one of {FINISH_REASONS}")
    return samples


# ---- talking to the router ------------------------------------------------------------------------------
async def generate(router_url: str, input_ids: Sequence[int], sampling_params: dict, *,
                   return_logprob: bool = True, return_routed_experts: bool = False,
                   image_data: Sequence[str] | None = None, image_pad_id: int | None = None) -> dict:
    """One SGLang /generate item for `input_ids`: {"text", "output_ids", "meta_info"}. Calls pending on the
    same event loop are sent together as batched requests (SGLang's list form of input_ids).
    `return_routed_experts`: meta_info.routed_experts holds each token's experts (routing replay r3).
    `image_data`: the prompt's images (vision-language models: base64 data URIs, as PromptSample.image_data), in the
    order of its image placeholders; None or empty for a text prompt (whose request then has no image_data).
    `image_pad_id`: with images, each run of this token is sent as one (SGLang's form, which expands it from the
    image's grid; the embedded server takes both forms). The item's output is the same either way."""
    ids = list(input_ids)
    if image_data and image_pad_id is not None:
        ids = collapse_image_pads(ids, image_pad_id)
    item = await _batcher(router_url).submit(ids, dict(sampling_params), return_logprob, return_routed_experts,
                                             list(image_data or []))
    meta = item.get("meta_info") or {}
    served, finish = meta.get("prompt_tokens"), (meta.get("finish_reason") or {}).get("type")
    # an aborted item may never have reached a server (answered locally, `_aborted_item`): nothing to compare
    if image_data and served is not None and served != len(input_ids) and finish != "abort":
        # the server expanded the pictures to another number of tokens than the trainer will see: its image
        # processor (min/max pixels) or tokenizer is not the model's, and its log-probs are of another prompt
        raise RuntimeError(f"/generate on {router_url}: the server ran a {served}-token prompt for a "
                           f"{len(input_ids)}-token one with {len(image_data)} image(s): its image processor or "
                           "tokenizer differs from the model's (docs/multimodal.md)")
    return item


def sample_from_item(item: dict) -> Sample:
    """A Sample from a /generate item returned with return_logprob."""
    meta = item["meta_info"]
    logprobs = [(-math.inf if lp is None else lp) for lp, _tok, _ in meta.get("output_token_logprobs") or []]
    last = parse_weight_version(meta.get("weight_version"), "meta_info.weight_version")  # the version it finished with
    routed = meta.get("routed_experts")
    return Sample(
        response_ids=list(item["output_ids"]), logprobs=logprobs if "output_token_logprobs" in meta else None,
        response=item.get("text"), finish_reason=(meta.get("finish_reason") or {}).get("type", "stop"),
        weight_version=parse_weight_version(meta.get("first_weight_version", last), "meta_info.first_weight_version"),
        last_weight_version=last,  # first_weight_version is the embedded server's; SGLang gives none
        routed_experts=None if routed is None else routing_from_text(routed),
    )


async def single_turn(prompt: PromptSample, router_url: str, sampling_params: dict) -> list[Sample]:
    """The default rollout: n independent completions of the prompt, each with its own sampling seed."""
    items = await asyncio.gather(*(
        generate(router_url, prompt.prompt_ids, sampling_params | {"sampling_seed": prompt.seed + j},
                 return_routed_experts=prompt.record_routing, image_data=prompt.image_data or None,
                 image_pad_id=image_pad_id(prompt))
        for j in range(prompt.n)
    ))
    # the reward decodes the tokens itself (models.hf.decode_responses): the server's text drops special tokens, so
    # a response ending in `<unk>` instead of EOS would read, and score, as the answer
    return [replace(sample_from_item(item), response=None) for item in items]


def image_pad_id(prompt: PromptSample) -> int | None:
    """The image pad token of a prompt with images, from its tokenizer (None without either): `generate` then sends
    SGLang's one pad per image, which a real SGLang behind the router needs."""
    if not prompt.image_data or prompt.tokenizer is None:
        return None
    pad = prompt.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    return pad if isinstance(pad, int) and pad != prompt.tokenizer.unk_token_id else None


def outstanding_rids(tag: str) -> list[str]:
    return sorted(_OUTSTANDING.get(tag, ()))


async def abort_tagged(router_url: str, tag: str) -> None:
    """Abort the requests sent under `tag` on every worker (running ones return what they generated, with
    finish_reason abort); calls made under the tag from now on return aborted without being sent. The aborts go to
    each worker's server directly (`worker_urls`): sglang-router does not forward /abort_request."""
    _ABORTED.add(tag)
    async with aiohttp.ClientSession(headers=control_headers(router_url)) as session:
        async def one(url: str, rid: str) -> None:
            async with session.post(f"{url}/abort_request", json={"rid": rid}) as resp:
                resp.raise_for_status()

        await asyncio.gather(*(one(url, rid) for url in worker_urls(router_url) for rid in outstanding_rids(tag)))


def end_tag(tag: str) -> None:
    _ABORTED.discard(tag)
    _OUTSTANDING.pop(tag, None)


def _aborted_item(input_ids: list[int]) -> dict:
    return {"text": "", "output_ids": [], "meta_info": {
        "finish_reason": {"type": "abort", "message": "aborted before it was sent"}, "prompt_tokens": len(input_ids),
        "completion_tokens": 0, "output_token_logprobs": [], "weight_version": DEFAULT_WEIGHT_VERSION,
        "first_weight_version": DEFAULT_WEIGHT_VERSION}}


class _Batcher:
    """Coalesces the /generate calls pending on one event loop for one router into batched requests.

    A call queues its item and the first one schedules a flush with `call_soon`: it runs after every task
    that is ready now has reached its own await, so the prompts a step starts together go out together,
    split into `parts` requests (one per rollout worker, which the router spreads least-loaded). A router that
    takes one item a request (sglang-router refuses a list of sampling_params) gets every item on its own.
    """

    def __init__(self, url: str, parts: int, batched: bool = True):
        self.url, self.parts, self.batched = url, parts, batched
        # (input_ids, sampling params, return_logprob, rid, group, routed, images, future)
        self.pending: list[tuple[list[int], dict, bool, str, str | None, bool, list[str], asyncio.Future]] = []
        self.session: aiohttp.ClientSession | None = None
        prefix = uuid.uuid4().hex[:8]  # request ids unique across batchers and runs sharing a server
        self._rids = (f"{prefix}-{i}" for i in itertools.count())

    async def submit(self, input_ids: list[int], params: dict, return_logprob: bool, routed: bool = False,
                     images: list[str] | None = None) -> dict:
        tag = REQUEST_TAG.get()
        if tag in _ABORTED:
            return _aborted_item(input_ids)
        rid = f"{tag or 'r'}-{next(self._rids)}"
        if tag is not None:
            _OUTSTANDING.setdefault(tag, set()).add(rid)
        fut = asyncio.get_running_loop().create_future()
        if not self.pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self.pending.append((input_ids, params, return_logprob, rid, REQUEST_GROUP.get(), routed, images or [], fut))
        try:
            return await fut
        finally:
            if tag is not None:
                _OUTSTANDING.get(tag, set()).discard(rid)

    def _flush(self) -> None:
        items, self.pending = self.pending, []
        by_group: dict[str | None, list] = {}
        for it in items:
            by_group.setdefault(it[4], []).append(it)
        for group, batch in by_group.items():
            per = len(batch) if group is not None else -(-len(batch) // self.parts)
            per = per if self.batched else 1
            for i in range(0, len(batch), per):
                asyncio.ensure_future(self._post(batch[i : i + per]))

    async def _post(self, items: list) -> None:
        adapter = _ADAPTERS.get(self.url)
        if self.batched:
            body = {"input_ids": [it[0] for it in items], "sampling_params": [it[1] for it in items],
                    "return_logprob": [it[2] for it in items], "rid": [it[3] for it in items]}
            if adapter is not None:
                body["lora_path"] = [adapter] * len(items)
        else:  # one item, in SGLang's single-request form
            (ids, params, logprob, rid, *_), = items
            body = {"input_ids": ids, "sampling_params": params, "return_logprob": logprob, "rid": rid}
            if adapter is not None:
                body["lora_path"] = adapter
        if any(it[5] for it in items):  # a request-wide flag, sent only when asked (a plain SGLang server has it too)
            body["return_routed_experts"] = True
        if any(it[6] for it in items):  # only with images: a text request stays as it was
            # a list for every item, [] for a text one: SGLang reads a batch's image_data as one list per request only
            # when its first entry is a list (docs/multimodal.md)
            body["image_data"] = [it[6] for it in items] if self.batched else items[0][6]
        try:
            if self.session is None or self.session.closed:
                self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                                     connector=aiohttp.TCPConnector(limit=0))
            async with self.session.post(f"{self.url}/generate", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"/generate on {self.url}: HTTP {resp.status}: {(await resp.text())[:500]}")
                out = await resp.json()
            out = out if self.batched else [out]
        except Exception as exc:
            for *_, fut in items:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (*_, fut), item in zip(items, out, strict=True):
            if not fut.done():
                fut.set_result(item)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


_BATCHERS: dict[tuple[int, str], _Batcher] = {}
_WORKERS: dict[str, list[str]] = {}  # router url -> its rollout workers' server URLs (RolloutRunner registers them)
_SINGLE: set[str] = set()  # router urls that take one /generate item a request (sglang-router)
_TOKENS: dict[str, str] = {}  # router url -> the run's control token (RolloutRunner registers it)
_ADAPTERS: dict[str, str] = {}  # router url -> the LoRA adapter its requests name (train.lora runs)


def adapter_name(router_url: str) -> str | None:
    """The LoRA adapter the policy is served as behind this router (train.lora), which /generate requests
    name in `lora_path` (`generate` adds it); None: the model's own weights."""
    return _ADAPTERS.get(router_url)


def control_headers(router_url: str) -> dict[str, str]:
    """Headers a rollout function sends with a control request (/abort_request) to the router: the run's
    control token. Generation requests need none."""
    return auth_headers(_TOKENS.get(router_url))


def worker_urls(router_url: str) -> list[str]:
    """The servers behind a router the framework started (control routes go to each), or the router itself."""
    return list(_WORKERS.get(router_url) or [router_url])


def _batcher(url: str) -> _Batcher:
    key = (id(asyncio.get_running_loop()), url)
    if key not in _BATCHERS:
        _BATCHERS[key] = _Batcher(url, len(_WORKERS.get(url) or [url]), batched=url not in _SINGLE)
    return _BATCHERS[key]


# ---- the framework's side -------------------------------------------------------------------------------
class RolloutRunner:
    """Runs a rollout function over a batch of prompts on a private event loop (one thread for the run),
    so HTTP sessions and batching live across steps and both the training thread and the one-step-off
    rollout thread can submit work. `token`: the run's control token, which `control_headers(router_url)`
    gives rollout functions for the router's control routes."""

    def __init__(self, fn: RolloutFn, router_url: str, worker_urls: list[str], token: str | None = None,
                 batched: bool = True, adapter: str | None = None):
        """`worker_urls`: the servers behind the router (control requests it may not forward go to each; the
        list is shared, so a restarted worker's new URL reaches them). `batched`: the router takes SGLang's
        batched /generate (rlflow's does; sglang-router does not). `adapter`: the LoRA adapter every request
        names (train.lora)."""
        self.fn, self.router_url, self.worker_urls = fn, router_url, worker_urls
        self.name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
        _WORKERS[router_url] = worker_urls
        if adapter is not None:
            _ADAPTERS[router_url] = adapter
        if not batched:
            _SINGLE.add(router_url)
        if token:
            _TOKENS[router_url] = token
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-fn", daemon=True)
        self._thread.start()

    def run(self, prompts: list[PromptSample], sampling_params: dict) -> list[list[Sample]]:
        """Every prompt's group, in prompt order (blocks the calling thread; raises if the runner closes
        meanwhile)."""
        return self.submit(self._run(prompts, sampling_params))

    async def _run(self, prompts: list[PromptSample], sampling_params: dict) -> list[list[Sample]]:
        groups = await asyncio.gather(*(self.fn(p, self.router_url, dict(sampling_params)) for p in prompts))
        return [check_group(g, p, self.name) for g, p in zip(groups, prompts, strict=True)]

    def submit(self, coro) -> Any:
        """Run a coroutine on the runner's loop and wait for it (dynamic sampling drives its own)."""
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        except concurrent.futures.CancelledError:
            raise RuntimeError(f"rollout function {self.name}: stopped, the rollout runner was closed while it "
                               "generated (the run is shutting down)") from None

    def close(self) -> None:
        """Cancel what is still generating (a one-step-off rollout when a step failed: its thread waits on this
        loop and would wait forever once the loop stops), close the HTTP sessions, stop the loop."""

        async def _close() -> None:
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for key in [k for k in _BATCHERS if k[0] == id(self.loop)]:
                await _BATCHERS.pop(key).close()

        asyncio.run_coroutine_threadsafe(_close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        _WORKERS.pop(self.router_url, None)
        _SINGLE.discard(self.router_url)
        _TOKENS.pop(self.router_url, None)
        _ADAPTERS.pop(self.router_url, None)
