"""Continuous batching: one background loop that decodes every running request one token per step.

A request that arrives while others run joins at the next step (its prompt is prefilled into a free KV
cache slot, then it decodes alongside the rest); a finished or aborted request leaves and frees its slot
at once. Callers get a `concurrent.futures.Future` per request (the HTTP server awaits it through
asyncio). Each request samples with its own generator, so its tokens do not depend on its batch-mates.
Weight updates take `engine.lock`, which the loop holds during a step, so weights never change inside one.
`pause()` / `resume()` hold the loop between steps for longer (an update of several parts, SGLang's
pause_generation in place): running requests keep their cache and continue with the weights they find after.

On a GPU a step is: sample every running row at once (on the GPU, one host-to-device copy of the step's
inputs), start the next decode for all of them (a CUDA graph, `engines/models/decoder.py` DecodeRunner), and only then
wait for the sampled tokens, so the host's bookkeeping (stop checks, callbacks) overlaps the decode. A row
that finished in that step was decoded once more for nothing; its slot is free from the next step on.
"""

from __future__ import annotations

import heapq
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from rlflow.engines.core.sampling import SamplingParams, sample_rows, scaled_logits
from rlflow.engines.core.trace import TraceRecorder, now_us
from rlflow.engines.models.decoder import DecoderLM, DecodeRunner, KVCache, to_device

QUEUE_TID = 0  # trace lane of queued requests and weight updates; KV-cache slot s is lane s + 1


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
    _uniforms: list[float] = field(default_factory=list)

    @property
    def position(self) -> int:
        """Cache position of the newest token."""
        return len(self.prompt) + len(self.output_ids) - 1

    def uniform(self) -> float:
        """The request's next random number, drawn from its own generator 64 at a time (one draw per sampled
        token, so the sequence depends on the seed alone)."""
        if not self._uniforms:
            self._uniforms = torch.rand(64, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self._uniforms.pop()


class ContinuousBatchEngine:
    def __init__(self, lm: DecoderLM, tokenizer, max_running: int, max_len: int, trace: TraceRecorder,
                 weight_version: Callable[[], int], weights_ready: Callable[[], bool],
                 max_prefill_tokens: int = 16384):
        self.lm, self.tokenizer, self.trace = lm, tokenizer, trace
        self.max_prefill_tokens = max_prefill_tokens  # padded tokens per prefill forward
        self.max_running, self.max_len = max_running, min(max_len, lm.max_positions)
        self.weight_version, self.weights_ready = weight_version, weights_ready
        self.lock = threading.RLock()  # held for a whole step; weight updates take it between steps
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers must not be used by two threads at once
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._free: list[int] = []  # a heap: the lowest free slot first, so busy slots stay packed at the bottom
        self._cache: KVCache | None = None
        self._logits: torch.Tensor | None = None  # [slots, V] next-token logits of each busy slot
        self._runner: DecodeRunner | None = None
        self._overlap = lm.device.type == "cuda"  # decode runs while the host reads the sampled tokens
        self._stop = False
        self._paused = False
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self._thread.start()

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
        requests return at once with no tokens; running ones at the next step with what they generated."""
        def hit(r: Request) -> bool:
            return abort_all or r.rid == rid or (rid is not None and r.rid.startswith(f"{rid}_"))

        with self._cond:
            queued = [r for r in self._waiting if hit(r)]
            for r in queued:
                self._waiting.remove(r)
                self._finish(r, {"type": "abort", "message": "Aborted before it started"})
            running = [r for r in self._running if hit(r)]
            for r in running:
                r.abort_requested = True
            self._cond.notify()
        return len(queued) + len(running)

    def num_requests(self) -> int:
        with self._cond:
            return len(self._waiting) + len(self._running)

    def drop_cache(self) -> bool:
        """Free the KV cache (flush, or release memory); refused while requests run."""
        with self.lock:
            if self._running:
                return False
            if self._cache is not None and self._overlap:
                torch.cuda.synchronize()  # the last decode may still be writing the cache
            self._cache = self._logits = self._runner = None
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
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._paused or not (self._waiting or self._running)):
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
                    for r in self._running:
                        heapq.heappush(self._free, r.slot)
                        if not r.future.done():
                            r.future.set_exception(exc)
                    self._running.clear()

    @torch.no_grad()
    def _step(self) -> None:
        with self._cond:  # abort() reads the running list from other threads: change it under the condition
            for r in [r for r in self._running if r.abort_requested]:
                self._running.remove(r)
                self._release(r)
                self._finish(r, {"type": "abort", "message": "Aborted by request"})
        self._admit()
        if not self._running:
            return
        running, dev = self._running, self.lm.device
        slots = [r.slot for r in running]
        positions = [len(r.prompt) + len(r.output_ids) for r in running]  # where each new token goes
        temps = [r.params.temperature for r in running]
        uniforms = [r.uniform() if t > 0 else 0.0 for r, t in zip(running, temps, strict=True)]
        ints = to_device([slots, positions], torch.long, dev)
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
            self._runner.run(ints[0], tokens, ints[1], max(slots) + 1, max(positions) + 1)
            sampled.synchronize()  # the tokens are here; the decode goes on
            tokens, logps = tokens_host, logps_host
        still, keep = self._emit(running, tokens.tolist(), logps.tolist())
        with self._cond:
            self._running = still
        if still and not self._overlap:
            self._runner.run(ints[0, keep], tokens[keep], ints[1, keep], max(r.slot for r in still) + 1,
                             max(positions[i] for i in keep) + 1)

    def _sample(self, running: list[Request], slots: torch.Tensor, uniforms: torch.Tensor,
                temperature: torch.Tensor, temps: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per running row and its logprob under the temperature-scaled distribution, on the
        device. Rows without top-k/top-p/min-p draw by inverse CDF over the vocabulary in its own order (no
        sort); greedy rows take the argmax; filtered rows go through `sample_rows`. Which path a row takes
        depends on its own parameters only, so its tokens never depend on its batch-mates."""
        logits = self._logits[slots]
        vocab = logits.shape[-1]
        if all(t in (0.0, 1.0) for t in temps):  # T=1 (and greedy, reported at T=1) scales nothing
            logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        else:
            logp = torch.log_softmax(scaled_logits(logits, temperature.float()), dim=-1)
        cdf = logp.exp().cumsum(-1, dtype=torch.float64)
        tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=vocab - 1)
        if any(t == 0 for t in temps):
            tokens = torch.where(temperature > 0, tokens, logits.argmax(-1))
        filtered = [i for i, r in enumerate(running) if r.filtered]
        if filtered:
            rows = to_device(filtered, torch.long, logits.device)
            ps = [running[i].params for i in filtered]
            top_p = to_device([p.top_p for p in ps], torch.float32, logits.device)
            top_k = to_device([p.top_k for p in ps], torch.long, logits.device)
            min_p = to_device([p.min_p for p in ps], torch.float32, logits.device)
            tokens[rows] = sample_rows(logits[rows], temperature[rows].float(), top_p, top_k, min_p, uniforms[rows])
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]

    def _emit(self, running: list[Request], tokens: list[int], logps: list[float]) -> tuple[list[Request], list[int]]:
        """Append each row's token, call its callback, finish the rows that are done; returns the requests
        still running and their row indices."""
        still, keep = [], []
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

    def _admit(self) -> None:
        """Move waiting requests into free slots; requests with the same prompt share one prefill."""
        if self._cache is None and self._waiting:
            self._cache = self.lm.new_cache(self.max_running, self.max_len)
            self._logits = torch.empty(self.max_running, self.lm.vocab_size, dtype=self.lm.dtype,
                                       device=self.lm.device)
            self._runner = DecodeRunner(self.lm, self._cache, self._logits, graphs=self._overlap)
            self._free = list(range(self.max_running))
        admitted: list[Request] = []
        with self._cond:
            while self._waiting and self._free:
                r = self._waiting.popleft()
                error = self._reject(r)
                if error is not None:
                    r.future.set_exception(error)
                elif r.params.max_new_tokens == 0:
                    self._finish(r, {"type": "length", "length": 0})
                else:
                    r.slot = heapq.heappop(self._free)
                    self._prepare(r)
                    admitted.append(r)
            self._running.extend(admitted)  # visible to abort() from now on; their logits come next
        version, start = self.weight_version(), now_us()
        groups: dict[tuple[int, ...], list[Request]] = {}
        for r in admitted:
            groups.setdefault(tuple(r.prompt), []).append(r)
        for chunk in _prefill_chunks(list(groups), self.max_prefill_tokens):
            slots = [[r.slot for r in groups[p]] for p in chunk]
            logits = self.lm.prefill(self._cache, slots, [list(p) for p in chunk])
            rows = to_device([i for i, group in enumerate(slots) for _ in group], torch.long, logits.device)
            dest = to_device([s for group in slots for s in group], torch.long, logits.device)
            self._logits[dest] = logits[rows].to(self._logits.dtype)  # exact: they were computed in that dtype
            for p in chunk:
                for r in groups[p]:
                    r.weight_version, r.start_us = version, start

    def _prepare(self, r: Request) -> None:
        """What the per-token checks need, computed once."""
        p, eos = r.params, self.tokenizer.eos_token_id
        r.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos or eos is None else {eos})
        r.limit = min(p.max_new_tokens, self.max_len - len(r.prompt))  # the context ends at max_len
        vocab = self.lm.vocab_size
        r.filtered = p.temperature > 0 and (0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0)

    def _reject(self, r: Request) -> Exception | None:
        if not self.weights_ready():
            return RuntimeError("generate: the weights were released (release_memory_occupation); resume and "
                                "update them first")
        if not r.prompt:
            return ValueError("input_ids: the prompt is empty")
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

    def _release(self, r: Request) -> None:
        heapq.heappush(self._free, r.slot)

    def _finish(self, r: Request, reason: dict) -> None:
        end = now_us()
        args = {"rid": r.rid, "finish": reason["type"], "prompt_tokens": len(r.prompt),
                "completion_tokens": len(r.output_ids), "weight_version": r.weight_version}
        if reason["type"] == "abort":
            self.trace.instant("abort", tid=slot_lane(r.slot) if r.slot >= 0 else QUEUE_TID, args=args,
                               ts_us=end)
        if r.start_us:
            self.trace.complete("request", r.start_us, end, tid=slot_lane(r.slot), args=args)
        r.future.set_result(Generation(list(r.prompt), r.output_ids, r.output_logprobs, reason,
                                       r.weight_version, r.rid,
                                       {"queued_us": r.queued_us, "start_us": r.start_us, "end_us": end},
                                       r.last_weight_version if r.output_ids else r.weight_version))


def _prefill_chunks(prompts: list[tuple[int, ...]], budget: int) -> list[list[tuple[int, ...]]]:
    """Consecutive groups of prompts whose padded batch (count x longest) stays within `budget` tokens."""
    chunks: list[list[tuple[int, ...]]] = []
    width = 0
    for p in prompts:
        if chunks and (len(chunks[-1]) + 1) * max(width, len(p)) <= budget:
            chunks[-1].append(p)
            width = max(width, len(p))
        else:
            chunks.append([p])
            width = len(p)
    return chunks
