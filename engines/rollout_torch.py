"""The embedded rollout engine: batched generation with a KV cache in plain PyTorch.

It runs anywhere (CPU or GPU) and is what the embedded rollout server puts behind SGLang's HTTP routes.
It returns token ids and per-token logprobs (of the temperature-scaled distribution the tokens were
drawn from), so the trainer can use them as behaviour-policy logprobs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from engines.algorithms import token_logprobs
from engines.config import StorageConfig
from engines.model import load_model, load_tokenizer
from engines.sampling import SamplingParams, sample_tokens, scaled_logits
from engines.trace import TraceRecorder, now_us
from engines.weight_sync import get_bucket
from engines.weight_transport import NcclChannel, copy_plan, flatten_, open_ipc_handles


@dataclass
class Generation:
    """One finished request, in SGLang's terms (finish_reason is {"type": "stop"|"length", ...})."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict
    weight_version: int
    meta: dict = field(default_factory=dict)


WEIGHTS_TID = 0  # trace lane of weight updates; batch row b is lane b + 1 ("slot b")


class TorchRolloutBackend:
    def __init__(
        self, model_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, threads: int | None = None,
        batch_size: int = 512, trace: bool = False, rank: int = 0,
    ):
        if threads:
            torch.set_num_threads(threads)
        self.device, self.batch_size = device, batch_size
        self.model = load_model(model_path, dtype=dtype, device=device).eval()
        self.tokenizer = load_tokenizer(model_path)
        self.params = dict(self.model.named_parameters())
        self.flat = device == "cuda"  # weights in one buffer, HF-name order: GPU syncs fill slices of it
        if self.flat:
            flatten_(self.params)
        self.weight_version = 0
        self.last_update_s = 0.0  # seconds the last weight update took inside this worker
        self._released = False  # colocated: the weights' memory was given back (release_memory_occupation)
        # per-request timeline (engines/trace.py): off unless the run traces; the driver drains it
        self.trace = TraceRecorder(f"rollout-{rank}", enabled=trace)
        self.trace.name_thread(WEIGHTS_TID, "weight updates")
        self._next_request_id = 0

    def pid(self) -> int:
        """This worker's process id (fault-injection drills kill it)."""
        return os.getpid()

    def drain_trace(self) -> list[dict]:
        """The trace events recorded since the last call (the driver calls it once per traced step)."""
        return self.trace.drain()

    # ---- weights -------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Copy HF-named tensors into the model; the version goes with every sample generated after."""
        t0 = now_us()
        self.resume_memory_occupation()
        for name, tensor in named_tensors:
            if name not in self.params:
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            self.params[name].copy_(tensor.to(self.params[name].dtype))
        if version is not None:
            return self._weights_updated(version, t0)
        return self.weight_version

    def update_weights_from_store(self, storage: StorageConfig, run: str, version: int, index: int) -> int:
        """Load bucket `index` of weight version `version` from the run store (the `store` transport)."""
        return self.update_weights(get_bucket(storage, run, version, index), version)

    def weight_bytes(self) -> int:
        """Bytes of the weights a sync delivers to this worker (in its own dtype)."""
        return sum(p.numel() * p.element_size() for p in self.params.values())

    # GPU transports (engines.weight_transport) and colocation
    def attach_ipc(self, handles: list[tuple[str, tuple]]) -> None:
        """cuda_ipc: map the colocated train worker's parameters; every later sync copies from them."""
        self._ipc_sources = open_ipc_handles(handles, torch.device(self.device, torch.cuda.current_device()))
        self._ipc_copy = None

    def update_weights_from_ipc(self, version: int) -> int:
        t0 = now_us()
        self.resume_memory_occupation()
        if self._ipc_copy is None:  # planned again after the weights were re-allocated
            self._ipc_copy = copy_plan(self.params, self._ipc_sources)
        self._ipc_copy()
        torch.cuda.synchronize()  # the trainer may step again as soon as this returns
        return self._weights_updated(version, t0)

    def nccl_connect(self, host: str, port: int, rank: int, world_size: int) -> None:
        self._nccl = NcclChannel(host, port, rank, world_size, torch.device(self.device, torch.cuda.current_device()))

    def update_weights_from_nccl(self, buckets: list[list[str]], version: int) -> int:
        t0 = now_us()
        self.resume_memory_occupation()
        self._nccl.receive(self.params, buckets)
        return self._weights_updated(version, t0)

    def release_memory_occupation(self) -> None:
        """Colocated: give the weights' GPU memory to the trainer (the KV cache lives only inside a
        generate call). The weights are gone until the next sync refills them, as SGLang's route does."""
        if self._released:
            return
        self._shapes = {n: p.shape for n, p in self.params.items()}
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._released = True
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def resume_memory_occupation(self) -> None:
        """Allocate the weights again (contents undefined until the sync that follows writes them). Every
        weight update does this first, so a colocated sync costs no extra call."""
        if not self._released:
            return
        self._ipc_copy = None
        if self.flat:
            flatten_(self.params, shapes=self._shapes)
        else:
            for n, p in self.params.items():
                p.data = torch.empty(self._shapes[n], dtype=p.dtype, device=p.device)
        self._released = False

    def last_update_seconds(self) -> float:
        """Time of the last GPU weight update inside this worker: the transfer without the driver's calls."""
        return self.last_update_s

    def link_bandwidth(self, kind: str, nbytes: int) -> float:
        """GB/s of the NCCL weight-sync group (the trainer's rank 0 measures at the same time)."""
        if kind != "nccl":
            raise ValueError(f"link_bandwidth: the rollout side measures 'nccl' only, not {kind!r}")
        return self._nccl.measure_bandwidth(nbytes)

    @torch.no_grad()
    def weights_digest(self) -> float:
        return float(sum(p.double().sum() for p in self.params.values()))

    def _weights_updated(self, version: int, start_us: float) -> int:
        self.weight_version = version
        end_us = now_us()
        self.last_update_s = (end_us - start_us) / 1e6
        self.trace.complete("weight_update", start_us, end_us, tid=WEIGHTS_TID, args={"version": version})
        return version

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The weights generation uses now, HF-named (tests compare them across transports)."""
        return [(n, p.detach().cpu().clone()) for n, p in self.params.items()]

    # ---- generation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Generation]:
        if self._released:
            raise RuntimeError("generate: the weights were released (release_memory_occupation); resume and "
                               "update them first")
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
        queued_us = now_us()
        out: list[Generation] = []
        for i in range(0, len(prompts), self.batch_size):
            start_us = now_us()
            batch = self._generate_batch(prompts[i : i + self.batch_size], params, gen)
            if self.trace.enabled:
                self._trace_requests(batch, queued_us, start_us)
            out += batch
        return out

    def _trace_requests(self, batch: list[Generation], queued_us: float, start_us: float) -> None:
        """Each request of a finished batch: queued, its span from start to finish, its first token.
        Batch row b is lane "slot b" (the rows are this engine's slots)."""
        for slot, g in enumerate(batch):
            rid, tid = self._next_request_id, slot + 1
            self._next_request_id += 1
            self.trace.name_thread(tid, f"slot {slot}")
            args = {"rid": rid, "prompt_tokens": len(g.prompt_ids), "output_tokens": len(g.output_ids),
                    "finish": g.finish_reason["type"], "weight_version": g.weight_version}
            self.trace.instant("queued", tid=tid, ts_us=queued_us, args={"rid": rid})
            self.trace.complete("request", start_us, g.meta.get("finish_us", start_us), tid=tid, args=args)
            if "first_token_us" in g.meta:
                self.trace.instant("first_token", tid=tid, ts_us=g.meta["first_token_us"], args={"rid": rid})

    def generate_packed(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> dict:
        """`generate`, returned as flat arrays (see pack_generations): what the RL loop moves over Ray."""
        return pack_generations(self.generate(prompts, params, seed))

    def _generate_batch(self, prompts: list[list[int]], p: SamplingParams, gen) -> list[Generation]:
        bsz, width = len(prompts), max(len(x) for x in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((bsz, width), pad, dtype=torch.long)
        attn = torch.zeros((bsz, width), dtype=torch.long)
        for b, ids in enumerate(prompts):  # left padding keeps every row's next token in the last column
            input_ids[b, width - len(ids) :] = torch.tensor(ids)
            attn[b, width - len(ids) :] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else {self.tokenizer.eos_token_id})
        stop_ids_t = torch.tensor(sorted(stop_ids), device=self.device)

        cache = DynamicCache()
        logits = self.model(input_ids, attention_mask=attn, position_ids=pos, past_key_values=cache).logits[:, -1]
        tokens, logps = [], []
        done = torch.zeros(bsz, dtype=torch.bool, device=self.device)
        stop_at = [0] * bsz  # 1 + index of the token that stopped a row; 0 while it runs
        next_pos = pos[:, -1] + 1
        texts = [""] * bsz if p.stop else None
        token_us: list[float] = []  # when each decode step's tokens were sampled (tracing only)
        for step in range(p.max_new_tokens):
            nxt = sample_tokens(logits, p, gen)
            lp = token_logprobs(scaled_logits(logits, p.temperature)[:, None], nxt[:, None])[:, 0]
            nxt = nxt.masked_fill(done, pad)
            tokens.append(nxt)
            logps.append(lp)
            if self.trace.enabled:
                token_us.append(now_us())
            hit = torch.isin(nxt, stop_ids_t) & ~done
            if texts is not None:
                hit |= self._stop_strings(nxt, done, texts, p.stop)
            for b in hit.nonzero().flatten().tolist():
                stop_at[b] = step + 1
            done |= hit
            if bool(done.all()):
                break
            attn = torch.cat([attn, torch.ones((bsz, 1), dtype=attn.dtype, device=self.device)], dim=1)
            logits = self.model(
                nxt[:, None], attention_mask=attn, position_ids=next_pos[:, None], past_key_values=cache
            ).logits[:, -1]
            next_pos = next_pos + 1
        return self._collect(prompts, tokens, logps, stop_at, token_us)

    def _stop_strings(self, nxt: torch.Tensor, done: torch.Tensor, texts: list[str], stops: list[str]) -> torch.Tensor:
        hit = torch.zeros_like(done)
        for b in (~done).nonzero().flatten().tolist():
            texts[b] += self.tokenizer.decode([int(nxt[b])], skip_special_tokens=True)
            hit[b] = any(texts[b].endswith(s) for s in stops)
        return hit

    def _collect(self, prompts, tokens, logps, stop_at: list[int], token_us: list[float]) -> list[Generation]:
        toks = torch.stack(tokens, 1).cpu() if tokens else torch.zeros((len(prompts), 0), dtype=torch.long)
        lps = torch.stack(logps, 1).float().cpu() if logps else torch.zeros((len(prompts), 0))
        out = []
        for b, prompt in enumerate(prompts):
            n = stop_at[b] or toks.shape[1]
            if stop_at[b]:
                finish = {"type": "stop", "matched": int(toks[b, n - 1])}
            else:
                finish = {"type": "length", "length": n}
            meta = {"first_token_us": token_us[0], "finish_us": token_us[max(n, 1) - 1]} if token_us else {}
            out.append(Generation(list(prompt), toks[b, :n].tolist(), lps[b, :n].tolist(), finish, self.weight_version,
                                  meta))
        return out


def pack_generations(gens: list[Generation]) -> dict[str, np.ndarray]:
    """Flat numpy arrays for a batch of generations: one zero-copy Ray object instead of N Python objects."""
    lengths = np.array([len(g.output_ids) for g in gens], dtype=np.int64)
    return {
        "output_ids": np.fromiter((t for g in gens for t in g.output_ids), dtype=np.int64, count=int(lengths.sum())),
        "output_logprobs": np.fromiter((x for g in gens for x in g.output_logprobs), dtype=np.float32,
                                       count=int(lengths.sum())),
        "lengths": lengths,
        "stopped": np.array([g.finish_reason["type"] == "stop" for g in gens], dtype=bool),
        "weight_version": np.array([g.weight_version for g in gens], dtype=np.int64),
    }


def concat_packed(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def split_packed(packed: dict[str, np.ndarray], key: str) -> list[np.ndarray]:
    """Per-sample views of a flat field ('output_ids' or 'output_logprobs')."""
    return np.split(packed[key], np.cumsum(packed["lengths"])[:-1])
