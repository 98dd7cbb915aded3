"""Continuous batching: one background loop that decodes every running request one token per step.

A request that arrives while others run joins at the next step (its prompt is prefilled into pages of the
paged KV cache, engines/models/kv_pages.py, then it decodes alongside the rest in a row of the page table);
a finished or aborted request leaves and frees its row and pages at once. Requests with the same prompt (a
GRPO group) prefill once and share the prompt's full pages. A prompt longer than the step's prefill budget
is prefilled in chunks over several steps, interleaved with the running decodes. When a decode needs a page
and none is free, the most recently admitted request is preempted: its pages go back, it waits at the front
of the queue keeping its tokens, logprobs and random stream, and its prompt + output so far is prefilled
again when it is readmitted, so its tokens are those it would have sampled unpreempted.

A request with images (vision-language models) carries its `PromptImages`: its prefill (and any re-prefill) runs
the vision encoder's embeddings at its image pad tokens, cached by digest (engines/models/vision_encoder.py), with
M-RoPE positions; a decode adds the sequence's position delta. Requests share a prefill only when their tokens and
their images' digests are equal.

Callers get a `concurrent.futures.Future` per request (the HTTP server awaits it through asyncio). Each
request samples with its own generator, so its tokens do not depend on its batch-mates.
Weight updates take `engine.lock`, which the loop holds during a step, so weights never change inside one.
`pause()` / `resume()` hold the loop between steps for longer (an update of several parts, SGLang's
pause_generation in place): running requests keep their cache and continue with the weights they find after.

On a GPU a step is: sample every running row at once (on the GPU, one host-to-device copy of the step's
inputs), start the next decode for all of them (a CUDA graph, `engines/models/decoder.py` DecodeRunner), and only then
wait for the sampled tokens, so the host's bookkeeping (stop checks, callbacks) overlaps the decode. A row
that finished in that step was decoded once more for nothing; its row is free from the next step on.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from rlflow.engines.core.config import KVCacheConfig
from rlflow.engines.core.sampling import SamplingParams, sample_rows, scaled_logits
from rlflow.engines.core.trace import TraceRecorder, now_us
from rlflow.engines.models.decoder import DecoderLM, DecodeRunner, SequenceImages
from rlflow.engines.models.head_math import head_logprobs
from rlflow.engines.models.kv_pages import PagedKVCache
from rlflow.engines.models.transfer import to_device
from rlflow.engines.models.triton_kernels import triton_kernel
from rlflow.engines.models.vision_encoder import PromptImages, VisionEncoder

CPU_POOL_TOKENS = 65536  # the page pool on CPU unless kv_cache.tokens says otherwise
QUEUE_TID = 0  # trace lane of queued requests and weight updates; page-table row s is lane s + 1


def slot_lane(slot: int) -> int:
    return slot + 1


@dataclass
class Generation:
    """One finished request, in SGLang's terms: finish_reason is {"type": "stop", "matched": token id or
    stop string}, {"type": "length", "length": n} or {"type": "abort", "message": ...}."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict
    weight_version: int  # the weights of its prefill (its first token)
    rid: str = ""
    meta: dict = field(default_factory=dict)
    last_weight_version: int | None = None  # the weights its last token's logits came from (None: the first's)
    # routing replay (engine record_routing): the experts of every token fed to the model, prompt and output
    # but the last output token, [len(prompt) + len(output) - 1, MoE layers, k] int16 (SGLang's layout)
    routed_experts: np.ndarray | None = None


def request_generator(seed: int, index: int) -> torch.Generator:
    """The generator of request `index` of a call seeded with `seed`: mixed so nearby seeds/indices differ."""
    state = np.random.SeedSequence([seed & (2**63 - 1), index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    on_token: Callable[[Request], None] | None = None  # streaming: called on the engine thread per token
    future: Future = field(default_factory=Future)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    text: str = ""  # decoded output, kept only when the request has stop strings
    slot: int = -1
    weight_version: int = 0
    last_weight_version: int = 0  # the weights its newest token's logits came from (updates land between steps)
    decode_version: int = 0  # the weights of the decode that computed its next logits
    abort_requested: bool = False
    queued_us: float = 0.0
    start_us: float = 0.0
    # set when admitted: token ids that stop it, how many tokens it may generate, whether it needs the sort
    stop_ids: frozenset[int] = frozenset()
    limit: int = 0
    filtered: bool = False
    pages: list[int] = field(default_factory=list)  # KV pages holding its tokens, in order
    admitted: int = -1  # admission order (the newest running request is the one preempted)
    preemptions: int = 0
    routed: np.ndarray | None = None  # the experts recorded before a preemption (its re-prefill recomputes them)
    images: PromptImages | None = None  # a vision-language prompt's images (VisionEncoder.prepare)
    _uniforms: list[float] = field(default_factory=list)

    @property
    def position(self) -> int:
        """Cache position of the newest token."""
        return len(self.prompt) + len(self.output_ids) - 1

    @property
    def tokens(self) -> list[int]:
        """What a (re)admission prefills: the prompt and the output so far."""
        return self.prompt + self.output_ids

    @property
    def image_key(self) -> tuple[str, ...]:
        """Its images' digests: with the tokens, what a shared prefill must agree on (pad ids of images are equal)."""
        return () if self.images is None else self.images.digests

    @property
    def rope_delta(self) -> int:
        """The M-RoPE offset of its generated tokens' positions (0 without images)."""
        return 0 if self.images is None else self.images.delta

    def uniform(self) -> float:
        """The request's next random number, drawn from its own generator 64 at a time (one draw per sampled
        token, so the sequence depends on the seed alone)."""
        if not self._uniforms:
            self._uniforms = torch.rand(64, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self._uniforms.pop()


@dataclass(frozen=True)
class EngineCounters:
    """What the engine has done and holds, read at once for /metrics (engines/rollout/metrics.py)."""

    running: int  # requests admitted: prefilling or decoding
    queued: int  # requests waiting for a row and pages (preempted ones included)
    generated_tokens: int  # tokens sampled since the engine started
    prompt_tokens: int  # prompt tokens of the requests admitted (once each: a re-prefill after preemption is not)
    finished: dict[str, int]  # requests ended, by finish_reason type (stop, length, abort) or "error"
    preemptions: int
    kv_pages_used: int
    kv_pages_total: int  # the pool's pages, page 0 (scratch) left out
    max_running: int


@dataclass(eq=False)
class _Prefill:
    """Requests admitted together whose tokens are the same (a GRPO group; one request usually), prefilled
    once: `pages` hold the tokens (full pages, then the partial last page if any), `partials` one more
    partial page for each request beyond the first (its copy-on-write copy). `done` tokens are cached."""

    requests: list[Request]
    tokens: list[int]
    pages: list[int]
    partials: list[int]
    admitted: int
    done: int = 0

    @property
    def images(self) -> PromptImages | None:
        return self.requests[0].images


class ContinuousBatchEngine:
    def __init__(self, lm: DecoderLM, tokenizer, max_running: int, max_len: int | None, trace: TraceRecorder,
                 weight_version: Callable[[], int], weights_ready: Callable[[], bool],
                 kv: KVCacheConfig | None = None, max_prefill_tokens: int = 16384, compile: bool = False,
                 record_routing: bool = False, cuda_graphs: bool = True, vision: VisionEncoder | None = None):
        """`max_len`: longest prompt + response (None: the model's positions); the page pool may cap it.
        `max_prefill_tokens`: padded tokens per prefill forward. `compile`: on CUDA, the decode step is compiled
        with torch.compile before it is captured (DecodeRunner). `record_routing`: an MoE model's expert choice
        of every token is recorded and returned with each Generation (routing replay, R3). `cuda_graphs`: capture
        decode steps on CUDA where the model allows (off: every step launched eagerly, what a benchmark compares).
        `vision`: a vision-language model's encoder, which requests with images need."""
        if record_routing and lm.routing_shape is None:
            raise ValueError("rollout record_routing: the model has no MoE layers (routing replay needs an MoE model)")
        self.record_routing = record_routing
        self.vision = vision
        self.lm, self.tokenizer, self.trace = lm, tokenizer, trace
        self.kv = kv or KVCacheConfig()
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = max_running
        context = min(max_len or lm.max_positions, lm.max_positions)
        self.num_pages = self._plan_pages(context)
        self.max_len = min(context, (self.num_pages - 1) * self.kv.page_size)  # one sequence fits the pool
        self.weight_version, self.weights_ready = weight_version, weights_ready
        self.lock = threading.RLock()  # held for a whole step; weight updates take it between steps
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers must not be used by two threads at once
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._prefilling: list[_Prefill] = []
        self._running: list[Request] = []
        self._free: list[int] = []  # a heap: the lowest free row first, so busy rows stay packed at the bottom
        self._cache: PagedKVCache | None = None
        self._logits: torch.Tensor | None = None  # [rows, V] next-token logits of each busy row
        self._runner: DecodeRunner | None = None
        self._admissions = 0
        self.preemptions = 0
        # /metrics' counters: plain integers bumped once per step or per request, read when scraped
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.finished: Counter[str] = Counter()  # by finish_reason type, and "error" for a failed request
        self._overlap = lm.device.type == "cuda"  # decode runs while the host reads the sampled tokens
        # true on-policy decode: captured (invariant.attention reads nothing on the host), never compiled (fusion
        # would change the rounding the trainer's eager ops give)
        self.compile = compile and self._overlap and not lm.exact
        self.cuda_graphs = cuda_graphs
        self._stop = False
        self._paused = False
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self._thread.start()

    def _plan_pages(self, context: int) -> int:
        """Pages of the pool (page 0 is scratch): kv.tokens if set, else a share of the free GPU memory on CUDA
        or CPU_POOL_TOKENS; never more than every row's longest sequence needs."""
        size = self.kv.page_size
        useful = self.max_running * -(-context // size) + 1
        if self.kv.tokens is not None:
            pages = -(-self.kv.tokens // size) + 1
        elif self.lm.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.lm.device)
            pages = int(free * self.kv.memory_fraction) // self.lm.page_bytes(size)
        else:
            pages = -(-CPU_POOL_TOKENS // size) + 1
        pages = min(pages, useful)
        if pages < 2:
            raise ValueError(f"rollout kv_cache: the pool holds {pages} pages of {size} tokens; it needs at least 2 "
                             "(raise kv_cache.tokens or kv_cache.memory_fraction)")
        return pages

    # ---- callers -------------------------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> list[Future]:
        """Queue requests together (so a batch call is admitted in its own order, deterministically)."""
        t, version = now_us(), self.weight_version()
        with self._cond:
            for r in requests:
                r.queued_us, r.weight_version = t, version
                self.trace.instant("queued", tid=QUEUE_TID, args={"rid": r.rid, "prompt_tokens": len(r.prompt)},
                                   ts_us=t)
            self._waiting.extend(requests)
            self._cond.notify()
        return [r.future for r in requests]

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort one request by rid (or a batch's `rid_` prefixed items), or all; returns how many. Waiting
        requests return at once with what they generated (nothing, unless preempted); admitted ones at the
        next step."""
        def hit(r: Request) -> bool:
            return abort_all or r.rid == rid or (rid is not None and r.rid.startswith(f"{rid}_"))

        with self._cond:
            queued = [r for r in self._waiting if hit(r)]
            for r in queued:
                self._waiting.remove(r)
                self._finish(r, {"type": "abort", "message": "Aborted while preempted" if r.output_ids else
                                 "Aborted before it started"})
            admitted = [r for r in self._admitted() if hit(r)]
            for r in admitted:
                r.abort_requested = True
            self._cond.notify()
        return len(queued) + len(admitted)

    def num_requests(self) -> int:
        with self._cond:
            return len(self._waiting) + len(self._admitted())

    @property
    def max_total_tokens(self) -> int:
        """Tokens the page pool holds (SGLang's max_total_num_tokens)."""
        return (self.num_pages - 1) * self.kv.page_size

    def stats(self) -> dict[str, int]:
        """The paged cache's counters: pages in use now and at most since the cache was made, preemptions (and a
        vision-language model's vision-encoder calls)."""
        cache = self._cache  # read once: a flush or a failed step may drop it meanwhile
        alloc = cache.allocator if cache is not None else None
        return {"kv_pages": self.num_pages - 1, "kv_page_size": self.kv.page_size,
                "kv_pages_used": alloc.num_used if alloc else 0, "kv_pages_peak": alloc.peak_used if alloc else 0,
                "num_preemptions": self.preemptions,
                **({"vision_encoder_calls": self.vision.calls} if self.vision is not None else {})}

    def counters(self) -> EngineCounters:
        """The engine's load and totals for a metrics scrape: cheap (no step is waited for), so a scrape never
        slows generation down."""
        with self._cond:
            running, queued, finished = len(self._admitted()), len(self._waiting), dict(self.finished)
        stats = self.stats()
        return EngineCounters(running, queued, self.generated_tokens, self.prompt_tokens, finished,
                              self.preemptions, stats["kv_pages_used"], stats["kv_pages"], self.max_running)

    def idle(self) -> bool:
        """No request runs or waits."""
        with self.lock:
            return not (self._running or self._prefilling or self._waiting)

    def drop_cache(self) -> bool:
        """Free the KV cache and the expert record store (flush, or release memory); refused while requests run or
        wait (a queued request would be admitted into a released engine: SGLang, too, releases only an idle
        server)."""
        with self.lock:
            if not self.idle():
                return False
            if self._cache is not None and self._overlap:
                torch.cuda.synchronize()  # the last decode may still be writing the cache
            self._cache = self._logits = self._runner = None
            self.lm.routing = None  # the expert record store (record_routing), reallocated with the cache
            return True

    def pause(self) -> None:
        """Stop between decode steps (returns once the step in flight is done) until `resume()`; requests keep
        their slots and caches, and new ones queue."""
        with self._cond:
            self._paused = True
        with self.lock:
            pass

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)
        self.abort(abort_all=True)

    # ---- the loop ------------------------------------------------------------------------------------
    def _admitted(self) -> list[Request]:
        return self._running + [r for w in self._prefilling for r in w.requests]

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._paused or not (self._waiting or self._running or self._prefilling)):
                    self._cond.wait()
                if self._stop:
                    return
            try:
                with self.lock:
                    if self._paused:  # paused while this thread waited for the lock
                        continue
                    self._step()
            except Exception as exc:  # a failed step fails its requests, never the loop
                logging.getLogger(__name__).exception("rollout engine step failed")
                with self._cond:
                    for r in self._admitted():
                        if not r.future.done():
                            r.future.set_exception(exc)
                            self.finished["error"] += 1
                    self._running.clear()
                    self._prefilling.clear()
                    self._cache = self._logits = self._runner = None  # page accounting restarts from empty

    @torch.no_grad()
    def _step(self) -> None:
        with self._cond:  # abort() reads the admitted requests from other threads: change them under the condition
            self._drop_aborted()
        self._admit()
        self._prefill()
        self._reserve_pages()
        if not self._running:
            return
        running, dev = self._running, self.lm.device
        slots = [r.slot for r in running]
        positions = [len(r.prompt) + len(r.output_ids) for r in running]  # where each new token goes
        temps = [r.params.temperature for r in running]
        uniforms = [r.uniform() if t > 0 else 0.0 for r, t in zip(running, temps, strict=True)]
        offsets = [r.rope_delta for r in running] if self.lm.mrope_section else None
        ints = to_device([slots, positions] + ([offsets] if offsets else []), torch.long, dev)
        rope = ints[2] if offsets else None
        floats = to_device([uniforms, temps], torch.float64, dev)
        tokens, logps = self._sample(running, ints[0], floats[0], floats[1], temps)
        version = self.weight_version()  # this step's decode's (a weight update waits for `lock`, between steps)
        for r in running:  # the logits just sampled came from the prefill, or from the previous step's decode
            r.last_weight_version = r.decode_version if r.output_ids else r.weight_version
            r.decode_version = version
        if self._overlap:
            tokens_host, logps_host = tokens.to("cpu", non_blocking=True), logps.to("cpu", non_blocking=True)
            sampled = torch.cuda.Event()
            sampled.record()
            self._runner.run(ints[0], tokens, ints[1], max(slots) + 1, max(positions) + 1, rope)
            sampled.synchronize()  # the tokens are here; the decode goes on
            tokens, logps = tokens_host, logps_host
        still, keep = self._emit(running, tokens.tolist(), logps.tolist())
        with self._cond:
            self._running = still
        if still and not self._overlap:
            self._runner.run(ints[0, keep], tokens[keep], ints[1, keep], max(r.slot for r in still) + 1,
                             max(positions[i] for i in keep) + 1, None if rope is None else rope[keep])

    def _drop_aborted(self) -> None:
        """Finish the admitted requests whose abort was asked for, with the tokens they have."""
        for r in [r for r in self._running if r.abort_requested]:
            self._running.remove(r)
            self._release(r)
            self._finish(r, {"type": "abort", "message": "Aborted by request"})
        for work in list(self._prefilling):
            for r in [r for r in work.requests if r.abort_requested]:
                work.requests.remove(r)
                self._free_row(r.slot)
                if work.partials:  # members are alike until their prefill ends: one partial page fewer
                    self._cache.allocator.release([work.partials.pop()])
                self._finish(r, {"type": "abort", "message": "Aborted by request"})
            if not work.requests:
                self._cache.allocator.release(work.pages)
                self._prefilling.remove(work)

    def _sample(self, running: list[Request], slots: torch.Tensor, uniforms: torch.Tensor,
                temperature: torch.Tensor, temps: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per running row and its logprob under the temperature-scaled distribution, on the
        device. Rows without top-k/top-p/min-p draw from the whole vocabulary: on CUDA by the Triton
        exponential race (engines/models/sampling_triton.py, one pass over the logits, noise keyed by the row's
        uniform), elsewhere by inverse CDF over the vocabulary in its own order (no sort); greedy rows take the
        argmax; filtered rows go through `sample_rows`. Which path a row takes depends on its own parameters
        only, so its tokens never depend on its batch-mates."""
        logits = self._logits[slots]
        race = triton_kernel("sampling_triton", "race_sample") if logits.device.type == "cuda" else None
        if race is not None:  # the uniform's 53 bits become the row's Philox seed
            tokens, logp_tokens = race(logits, temperature, (uniforms * 2.0**53).long())
        else:
            tokens, logp_tokens = self._inverse_cdf(logits, uniforms, temperature, temps)
        filtered = [i for i, r in enumerate(running) if r.filtered]
        if filtered:
            rows = to_device(filtered, torch.long, logits.device)
            ps = [running[i].params for i in filtered]
            top_p = to_device([p.top_p for p in ps], torch.float32, logits.device)
            top_k = to_device([p.top_k for p in ps], torch.long, logits.device)
            min_p = to_device([p.min_p for p in ps], torch.float32, logits.device)
            t = temperature[rows].float()
            tokens[rows] = sample_rows(logits[rows], t, top_p, top_k, min_p, uniforms[rows])
            logp = torch.log_softmax(scaled_logits(logits[rows], t), dim=-1)
            logp_tokens[rows] = logp.gather(-1, tokens[rows, None])[:, 0]
        if self.lm.exact:  # rollout.true_on_policy: the trainer's log-softmax (head_math), bit for bit
            logp_tokens = head_logprobs(logits, tokens[:, None], temperature, False, exact=True)[0][:, 0]
        return tokens, logp_tokens

    @staticmethod
    def _inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor, temps: list[float]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path: log-softmax, a float64 cumulative sum, one search per row; greedy rows the argmax."""
        vocab = logits.shape[-1]
        if all(t in (0.0, 1.0) for t in temps):  # T=1 (and greedy, reported at T=1) scales nothing
            logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        else:
            logp = torch.log_softmax(scaled_logits(logits, temperature.float()), dim=-1)
        cdf = logp.exp().cumsum(-1, dtype=torch.float64)
        tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=vocab - 1)
        if any(t == 0 for t in temps):
            tokens = torch.where(temperature > 0, tokens, logits.argmax(-1))
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]

    def _emit(self, running: list[Request], tokens: list[int], logps: list[float]) -> tuple[list[Request], list[int]]:
        """Append each row's token, call its callback, finish the rows that are done; returns the requests
        still running and their row indices."""
        still, keep = [], []
        self.generated_tokens += len(tokens)  # only this thread writes it
        for i, (r, tok, lp) in enumerate(zip(running, tokens, logps, strict=True)):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            if len(r.output_ids) == 1:
                self.trace.instant("first_token", tid=slot_lane(r.slot), args={"rid": r.rid})
            reason = self._finish_reason(r, tok)
            if r.on_token is not None:
                r.on_token(r)
            if reason is None:
                still.append(r)
                keep.append(i)
            else:
                self._release(r)
                self._finish(r, reason)
        return still, keep

    def _ensure_cache(self) -> None:
        if self._cache is None:
            self._cache = self.lm.new_cache(self.max_running, self.max_len, self.num_pages, self.kv.page_size)
            self._logits = torch.empty(self.max_running, self.lm.vocab_size, dtype=self.lm.dtype,
                                       device=self.lm.device)
            if self.record_routing:
                self.lm.record_routing(self.max_running, self.max_len)
            # MoE experts off the grouped kernel: no CUDA graphs
            graphs = self._overlap and self.cuda_graphs and self.lm.graph_safe
            self._runner = DecodeRunner(self.lm, self._cache, self._logits, graphs=graphs,
                                        compile=self.compile and graphs)
            self._free = list(range(self.max_running))

    def _admit(self) -> None:
        """Move waiting requests, in order, into free rows while the pool has their pages and still one page
        for every admitted request (so the next decode step needs no preemption). Consecutive requests with
        the same tokens (a GRPO group) become one prefill whose full pages they share."""
        if self._waiting:
            self._ensure_cache()
        alloc, size = self._cache.allocator if self._cache else None, self.kv.page_size
        with self._cond:
            while self._waiting and self._free:
                r = self._waiting[0]
                error = self._reject(r)
                if error is not None or r.params.max_new_tokens == 0:
                    self._waiting.popleft()
                    if error is not None:
                        r.future.set_exception(error)
                        self.finished["error"] += 1
                    else:
                        self._finish(r, {"type": "length", "length": 0})
                    continue
                tokens, images = r.tokens, r.image_key
                group = [r]
                for other in itertools.islice(self._waiting, 1, len(self._free) if self.kv.share_prompts else 1):
                    if (other.tokens != tokens or other.image_key != images or self._reject(other) is not None
                            or other.params.max_new_tokens == 0):
                        break
                    group.append(other)
                full, per = len(tokens) // size, int(len(tokens) % size > 0)
                busy = len(self._admitted())
                # each member: its partial page (if any) and a page held back for its next tokens
                fits = min(len(group), (alloc.num_free - full - busy) // (per + 1))
                if fits < 1 and not busy and alloc.num_free >= full + per:
                    fits = 1  # alone, it needs no room held back: preemption makes its pages
                if fits < 1:
                    break  # in order: the head of the queue waits for pages
                group = group[:fits]
                for _ in group:
                    self._waiting.popleft()
                pages = alloc.alloc(full + per * len(group))
                shared, partials = pages[:full], pages[full:]
                self._admissions += 1
                for m in group:
                    m.slot, m.admitted = heapq.heappop(self._free), self._admissions
                    if m.limit == 0:  # first admission (a preempted request keeps its settings)
                        self._prepare(m)
                        m.start_us = now_us()
                        self.prompt_tokens += len(m.prompt)
                self._prefilling.append(_Prefill(group, tokens, shared + partials[:1], partials[1:],
                                                 self._admissions))

    def _prefill(self) -> None:
        """Prefill up to kv.prefill_chunk_tokens tokens of the admitted requests, oldest first: whole prompts
        together in padded batches, the part of a longer one that fits on its own (its next chunk next
        step). A request whose prefill ends joins the running ones with its first token's logits."""
        budget, planned, whole, done = self.kv.prefill_chunk_tokens, [], [], []
        for work in self._prefilling:
            if budget <= 0:
                break
            n = min(len(work.tokens) - work.done, budget)
            budget -= n
            planned.append((work, n))
        if self.vision is not None:  # the step's new pictures through the vision tower in one call
            self.vision.warm([w.images for w, _ in planned if w.images is not None])
        for work, n in planned:
            if work.done == 0 and n == len(work.tokens):
                whole.append(work)
                continue
            logits = self.lm.prefill(self._cache, [work.tokens[work.done:work.done + n]], [work.done], [work.pages],
                                     [[r.slot for r in work.requests]], [self._images(work)])
            work.done += n
            if work.done == len(work.tokens):
                done.append((work, logits[0]))
        for chunk in _prefill_chunks(whole, self.max_prefill_tokens):
            logits = self.lm.prefill(self._cache, [w.tokens for w in chunk], [0] * len(chunk), [w.pages for w in chunk],
                                     [[r.slot for r in w.requests] for w in chunk], [self._images(w) for w in chunk])
            for w, row in zip(chunk, logits, strict=True):
                w.done = len(w.tokens)
                done.append((w, row))
        if not done:
            return
        version = self.weight_version()
        with self._cond:
            for work, _ in done:
                self._prefilling.remove(work)
                self._start(work, version)
        dest = to_device([r.slot for w, _ in done for r in w.requests], torch.long, self.lm.device)
        rows = to_device([i for i, (w, _) in enumerate(done) for _ in w.requests], torch.long, self.lm.device)
        logits = torch.stack([row for _, row in done])
        self._logits[dest] = logits[rows].to(self._logits.dtype)  # exact: they were computed in that dtype

    def _images(self, work: _Prefill) -> SequenceImages | None:
        """The prefill's image embeddings and M-RoPE positions (the vision encoder runs for images not cached)."""
        return None if work.images is None else self.vision.sequence(work.images)

    def _start(self, work: _Prefill, version: int) -> None:
        """The group's prefill is cached: every member takes the full pages (shared) and its own copy of the
        partial last page, its row of the page table, and joins the running requests."""
        cache, full = self._cache, len(work.tokens) // self.kv.page_size
        work.requests[0].pages = work.pages
        for r, own in itertools.zip_longest(work.requests[1:], work.partials):
            cache.allocator.share(work.pages[:full])
            r.pages = work.pages[:full]
            if own is not None:
                cache.copy_page(work.pages[full], own)
                r.pages = r.pages + [own]
        for r in work.requests:
            if not r.output_ids:  # a preempted request keeps the version of its first tokens
                r.weight_version = version
            r.decode_version = version  # its next logits come from this prefill (a re-prefill after preemption too)
            cache.set_row(r.slot, r.pages)
        self._running.extend(work.requests)

    def _reserve_pages(self) -> None:
        """Give every running request the page its next token goes to, oldest first; when none is free,
        preempt the newest admitted request (which may be the one asking) until one is."""
        if not self._running:
            return
        alloc, size = self._cache.allocator, self.kv.page_size
        for r in sorted(self._running, key=lambda r: r.admitted):
            if r.slot < 0 or (len(r.prompt) + len(r.output_ids)) // size < len(r.pages):
                continue  # preempted in this pass, or its page is there
            page = alloc.alloc(1)
            while page is None:
                victim = max(self._running + self._prefilling, key=lambda x: x.admitted)
                self._preempt(victim)
                if victim is r:
                    break
                page = alloc.alloc(1)
            if page is not None:
                self._cache.set_row(r.slot, page, start=len(r.pages))
                r.pages.append(page[0])

    def _preempt(self, victim: Request | _Prefill) -> None:
        """Give back a request's (or an unfinished prefill's) pages and rows; its requests wait at the front of
        the queue, keeping their tokens, logprobs and random streams."""
        with self._cond:
            if isinstance(victim, _Prefill):
                self._prefilling.remove(victim)
                self._cache.allocator.release(victim.pages + victim.partials)
                requests = victim.requests
                for r in requests:
                    self._free_row(r.slot)
            else:
                self._running.remove(victim)
                self._release(victim)
                requests = [victim]
            for r in reversed(requests):
                r.preemptions += 1
                self.preemptions += 1
                self.trace.instant("preempt", tid=QUEUE_TID, args={"rid": r.rid, "tokens": len(r.tokens)})
                r.slot, r.admitted = -1, -1
                self._waiting.appendleft(r)

    def _prepare(self, r: Request) -> None:
        """What the per-token checks need, computed once."""
        p, eos = r.params, self.tokenizer.eos_token_id
        r.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos or eos is None else {eos})
        r.limit = min(p.max_new_tokens, self.max_len - len(r.prompt))  # the context ends at max_len
        vocab = self.lm.vocab_size
        r.filtered = p.temperature > 0 and (0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0)

    def _reject(self, r: Request) -> Exception | None:
        if not self.weights_ready():
            return RuntimeError("generate: the weights were released (release_memory_occupation), or a cuda_ipc "
                                "update began and has not finished; update them first")
        if not r.prompt:
            return ValueError("input_ids: the prompt is empty")
        if r.images is not None and self.vision is None:
            return ValueError("image_data: the model is not a vision-language model (Qwen2-VL, Qwen2.5-VL)")
        if len(r.prompt) >= self.max_len:
            return ValueError(f"input_ids: the prompt has {len(r.prompt)} tokens, the context holds {self.max_len}")
        return None

    def _finish_reason(self, r: Request, tok: int) -> dict | None:
        if tok in r.stop_ids:
            return {"type": "stop", "matched": tok}
        if r.params.stop:
            with self.tokenizer_lock:
                r.text += self.tokenizer.decode([tok], skip_special_tokens=True)
            for s in r.params.stop:
                if r.text.endswith(s):
                    return {"type": "stop", "matched": s}
        if len(r.output_ids) >= r.limit:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _free_row(self, row: int) -> None:
        heapq.heappush(self._free, row)
        self._cache.clear_row(row)

    def _release(self, r: Request) -> None:
        """A running request leaves: its row and its holds on its pages go back (and the experts recorded in the
        row, to the request: every token it holds has been fed to the model by now)."""
        if self.lm.routing is not None:
            kept = 0 if r.routed is None else len(r.routed)
            fresh = self.lm.routing[r.slot, kept:len(r.tokens)].to("cpu", copy=True).numpy()  # the row is reused
            r.routed = fresh if r.routed is None else np.concatenate([r.routed, fresh])
        self._free_row(r.slot)
        self._cache.allocator.release(r.pages)
        r.pages = []

    def _finish(self, r: Request, reason: dict) -> None:
        end = now_us()
        with self._cond:  # aborts finish requests from other threads
            self.finished[reason["type"]] += 1
        args = {"rid": r.rid, "finish": reason["type"], "prompt_tokens": len(r.prompt),
                "completion_tokens": len(r.output_ids), "weight_version": r.weight_version,
                "preemptions": r.preemptions}
        if reason["type"] == "abort":
            self.trace.instant("abort", tid=slot_lane(r.slot) if r.slot >= 0 else QUEUE_TID, args=args,
                               ts_us=end)
        if r.start_us:
            self.trace.complete("request", r.start_us, end, tid=slot_lane(r.slot) if r.slot >= 0 else QUEUE_TID,
                                args=args)
        routed = None if r.routed is None else r.routed[:len(r.tokens) - 1]  # the last token was never fed
        r.future.set_result(Generation(list(r.prompt), r.output_ids, r.output_logprobs, reason,
                                       r.weight_version, r.rid,
                                       {"queued_us": r.queued_us, "start_us": r.start_us, "end_us": end},
                                       r.last_weight_version if r.output_ids else r.weight_version, routed))


def _prefill_chunks(works: list[_Prefill], budget: int) -> list[list[_Prefill]]:
    """Consecutive prefills whose padded batch (count x longest) stays within `budget` tokens."""
    chunks: list[list[_Prefill]] = []
    width = 0
    for w in works:
        n = len(w.tokens)
        if chunks and (len(chunks[-1]) + 1) * max(width, n) <= budget:
            chunks[-1].append(w)
            width = max(width, n)
        else:
            chunks.append([w])
            width = n
    return chunks
