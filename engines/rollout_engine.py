"""Continuous batching: one background loop that decodes every running request one token per step.

A request that arrives while others run joins at the next step (its prompt is prefilled into a free KV
cache slot, then it decodes alongside the rest); a finished or aborted request leaves and frees its slot
at once. Callers get a `concurrent.futures.Future` per request (the HTTP server awaits it through
asyncio). Each request samples with its own generator, so its tokens do not depend on its batch-mates.
Weight updates take `engine.lock`, which the loop holds during a step, so weights never change inside one.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from engines.algorithms import token_logprobs
from engines.llm import DecoderLM, KVCache
from engines.sampling import SamplingParams, row_params, sample_rows, scaled_logits
from engines.trace import TraceRecorder, now_us

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
    weight_version: int
    rid: str = ""
    meta: dict = field(default_factory=dict)


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
    abort_requested: bool = False
    logits: torch.Tensor | None = None  # next-token logits while running
    queued_us: float = 0.0
    start_us: float = 0.0

    @property
    def position(self) -> int:
        """Cache position of the newest token."""
        return len(self.prompt) + len(self.output_ids) - 1


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
        self._free: list[int] = []
        self._cache: KVCache | None = None
        self._stop = False
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
            self._cache = None
            return True

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
                while not (self._stop or self._waiting or self._running):
                    self._cond.wait()
                if self._stop:
                    return
            try:
                with self.lock:
                    self._step()
            except Exception as exc:  # a failed step fails its requests, never the loop
                logging.getLogger(__name__).exception("rollout engine step failed")
                with self._cond:
                    for r in self._running:
                        self._free.append(r.slot)
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
        running = self._running
        logits = torch.stack([r.logits for r in running])
        params = [r.params for r in running]
        uniforms = torch.tensor([float(torch.rand((), generator=r.generator)) if p.temperature > 0 else 0.0
                                 for r, p in zip(running, params, strict=True)], device=logits.device)
        rows = row_params(params, logits.device)
        tokens = sample_rows(logits, **rows, uniforms=uniforms)
        logps = token_logprobs(scaled_logits(logits, rows["temperature"])[:, None], tokens[:, None])[:, 0]
        still = []
        for r, tok, lp in zip(running, tokens.tolist(), logps.tolist(), strict=True):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            if len(r.output_ids) == 1:
                self.trace.instant("first_token", tid=slot_lane(r.slot), args={"rid": r.rid})
            reason = self._finish_reason(r, tok)
            if r.on_token is not None:
                r.on_token(r)
            if reason is None:
                still.append(r)
            else:
                self._release(r)
                self._finish(r, reason)
        with self._cond:
            self._running = still
        if still:
            out = self.lm.decode(self._cache, torch.tensor([r.slot for r in still], device=self.lm.device),
                                 torch.tensor([r.output_ids[-1] for r in still], device=self.lm.device),
                                 torch.tensor([r.position for r in still], device=self.lm.device))
            for r, row in zip(still, out, strict=True):
                r.logits = row

    def _admit(self) -> None:
        """Move waiting requests into free slots; requests with the same prompt share one prefill."""
        if self._cache is None and self._waiting:
            self._cache = self.lm.new_cache(self.max_running, self.max_len)
            self._free = list(range(self.max_running - 1, -1, -1))
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
                    r.slot = self._free.pop()
                    admitted.append(r)
            self._running.extend(admitted)  # visible to abort() from now on; their logits come next
        version, start = self.weight_version(), now_us()
        groups: dict[tuple[int, ...], list[Request]] = {}
        for r in admitted:
            groups.setdefault(tuple(r.prompt), []).append(r)
        for chunk in _prefill_chunks(list(groups), self.max_prefill_tokens):
            slots = [[r.slot for r in groups[p]] for p in chunk]
            logits = self.lm.prefill(self._cache, slots, [list(p) for p in chunk])
            for p, row in zip(chunk, logits, strict=True):
                for r in groups[p]:
                    r.logits, r.weight_version, r.start_us = row, version, start

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
        p = r.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok == self.tokenizer.eos_token_id):
            return {"type": "stop", "matched": tok}
        if p.stop:
            with self.tokenizer_lock:
                r.text += self.tokenizer.decode([tok], skip_special_tokens=True)
            for s in p.stop:
                if r.text.endswith(s):
                    return {"type": "stop", "matched": s}
        if len(r.output_ids) >= p.max_new_tokens or r.position + 1 >= self.max_len:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _release(self, r: Request) -> None:
        self._free.append(r.slot)
        r.logits = None

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
                                       {"queued_us": r.queued_us, "start_us": r.start_us, "end_us": end}))


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
