"""The embedded rollout backend: a continuous-batching engine in plain PyTorch behind SGLang's routes.

It runs anywhere (CPU or GPU). `generate` (what the RL loop calls through Ray) and the HTTP server
(engines/rollout/server.py) feed the same engine (engines/rollout/engine.py), so there is one generation
path. It returns token ids and per-token logprobs (of the temperature-scaled distribution the tokens were
drawn from), so the trainer can use them as behaviour-policy logprobs.

LoRA (`lora`, SGLang's adapter routes): the engine serves one adapter at a time, merged into its weights
(engines/rollout/lora.py says how and why); base weight updates are refused while one is merged.

FP8 (`fp8`, rollout.precision fp8): the dense projections live in e4m3 outside the flat buffer
(engines/models/fp8.py); updates by name quantize them as they arrive, and so does cuda_ipc from one train rank.
The transports that write bf16 straight into the flat buffer (nccl, a sharded trainer's cuda_ipc) are refused.

Vision-language models (Qwen2-VL, Qwen2.5-VL): requests may carry images (`image_data` per prompt: encoded bytes, data
URIs, base64 or local paths), checked against the prompt's pad tokens when the request is made; the vision encoder
(engines/models/vision_encoder.py) runs once per distinct image, and its cache is cleared by every weight update.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from safetensors.torch import load_file

from rlflow.engines.core.config import KVCacheConfig, StorageConfig
from rlflow.engines.core.protocols import RolloutBackend
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.core.trace import TraceRecorder
from rlflow.engines.models.decoder import DecoderLM
from rlflow.engines.models.flat_weights import flat_span, flatten_, fusable_order
from rlflow.engines.models.hf import load_model, load_tokenizer
from rlflow.engines.models.moe import checkpoint_named
from rlflow.engines.models.vision_encoder import CACHED_IMAGES, PromptImages, VisionEncoder
from rlflow.engines.models.vision_language import VISION_PREFIX, VisionProcessor, is_vision_language
from rlflow.engines.rollout.engine import QUEUE_TID, ContinuousBatchEngine, Generation, Request, request_generator
from rlflow.engines.rollout.http_api import auth_headers
from rlflow.engines.rollout.lora import LoraLimits, MergedAdapter, host_copy, read_adapter
from rlflow.engines.rollout.server import RolloutServer
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.cuda_ipc import SharedWeights, copy_plan, open_ipc_handles, share_flat
from rlflow.engines.sync.delta_format import DeltaFollower
from rlflow.engines.sync.distributed import GROUP_NAME, init_request, update_request
from rlflow.engines.sync.endpoints import (
    AdapterReceiver,
    DeltaReceiver,
    DiskReceiver,
    DistributedReceiver,
    GpuLinkProbe,
    IpcReceiver,
    NcclReceiver,
    StoreReceiver,
)
from rlflow.engines.sync.gpu import plain_segments, sync_device
from rlflow.engines.sync.nccl import NcclChannel
from rlflow.engines.sync.store import get_bucket

__all__ = ["Generation", "TorchRolloutBackend", "pack_generations", "concat_packed", "split_packed"]

# per prompt, its images (encoded bytes, data URIs, base64 or local paths) or None; None for a text-only call
PromptsImages = Sequence[Sequence[str | bytes] | None] | None


class TorchRolloutBackend(RolloutBackend, StoreReceiver, DiskReceiver, IpcReceiver, NcclReceiver,
                          DistributedReceiver, GpuLinkProbe, AdapterReceiver, DeltaReceiver):
    """The embedded engine as a rollout worker: continuous batching behind SGLang's HTTP API."""

    def __init__(
        self, model_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, threads: int | None = None,
        batch_size: int = 512, context_len: int | None = None, trace: bool = False, rank: int = 0,
        weight_dirs: Sequence[str] = (), kv_cache: KVCacheConfig | None = None, compile: bool = False,
        lora: Any = None, record_routing: bool = False, cuda_graphs: bool = True, fp8: bool = False,
        true_on_policy: bool = False, frozen_vision: bool = False,
    ):
        """`weight_dirs`: folders its server's /update_weights_from_disk may read besides `model_path` (the run's
        weight-sync and checkpoint folders, engines/sync/disk.py:weight_dirs). `context_len`: longest prompt +
        response (None: the model's max_position_embeddings; the KV page pool, `kv_cache`, may cap it). `compile`:
        torch.compile the decode step on CUDA (rollout.compile). `lora`: the run's LoRA settings (`rank`,
        `target_modules`; SGLang's --enable-lora --max-lora-rank --lora-target-modules): the engine then loads
        adapters no larger than that, and keeps its weights in host memory while they are released (only adapters
        move in a LoRA run's syncs, so nothing else would bring the base back). `record_routing`: record an MoE
        model's expert choice of every token, for /generate's return_routed_experts (routing replay, R3).
        `cuda_graphs`: off, decode steps run eagerly (SGLang's --disable-cuda-graph). `fp8`: the dense
        projections in e4m3 (rollout.precision fp8; CUDA, bf16 `dtype`). `true_on_policy`: every op batch-invariant
        and the trainer's (DecoderLM.true_on_policy; rollout.true_on_policy), no compile. `frozen_vision`: a
        vision-language model's tower is frozen in the trainer (train.freeze_vision), so no sync sends it: it is
        no sync target, stays resident when the weights are released, and is not in a shared IPC buffer."""
        if fp8 and (device != "cuda" or dtype != torch.bfloat16):
            raise ValueError(f"rollout.precision fp8: needs rollout.device cuda and bf16 compute (got {device}, "
                             f"{dtype}); e4m3 GEMMs run on Hopper-class GPUs")
        if threads:
            torch.set_num_threads(threads)
        self.model_path, self.device, self.batch_size = model_path, device, batch_size
        self.weight_dirs = list(weight_dirs)
        self.lora = LoraLimits.of(lora)
        self._merged = MergedAdapter()  # the adapter merged into the weights and the base it was merged into
        self._host_weights: dict[str, torch.Tensor] | None = None  # LoRA runs: weights kept while released
        self._delta = DeltaFollower()  # the delta transport's host mirror of the last version applied
        self.model = load_model(model_path, dtype=dtype, device=device).eval()
        self.tokenizer = load_tokenizer(model_path)
        lm = DecoderLM(self.model)
        if true_on_policy:
            lm.true_on_policy()
        self.fp8 = lm.quantize_fp8() if fp8 else None  # before the flat buffer, which then holds the rest
        quantized = self.fp8.names if self.fp8 is not None else set()
        params = dict(self.model.named_parameters())
        self.frozen_vision = frozen_vision
        kept = {n for n in params if frozen_vision and n.startswith(VISION_PREFIX)}  # what no sync will send
        self.params = {n: params[n] for n in fusable_order(list(params)) if n not in quantized and n not in kept}
        self._shapes = {n: p.shape for n, p in self.params.items()}  # kept: released weights are empty tensors
        self._targets: tuple[tuple[int, ...], dict[str, torch.Tensor]] | None = None  # weight_targets' cache
        # cuda_ipc with a sharded trainer: which allocation of the weights it is writing (share_weights; None: no
        # write started and unfinished), and on the CPU the weights' shared-memory file (path, buffer)
        self._awaiting_write: int | None = None
        self._allocations, self._write_started = 0, 0.0
        self._shared_file: tuple[str, torch.Tensor] | None = None
        # on GPU the weights are one buffer in that order: syncs fill slices of it, q/k/v and gate/up run as one GEMM
        self.flat = device == "cuda"
        if self.flat:  # in a plain segment: a sharded colocated trainer maps it at every sync (cuda_ipc)
            with plain_segments():
                flatten_(self.params)
        self.weight_version = 0
        self.last_update_s = 0.0  # seconds the last weight update took inside this worker
        # weight updates (and LoRA adapter merges) landed, and their seconds in all: /metrics' sync summary
        self.weight_updates, self.weight_update_seconds = 0, 0.0
        self._released = False  # colocated: the weights' memory was given back (release_memory_occupation)
        # per-request timeline (engines/core/trace.py): off unless the run traces; the driver drains it
        self.trace = TraceRecorder(f"rollout-{rank}", enabled=trace)
        self.trace.name_thread(QUEUE_TID, "queue, weight updates, preemptions")  # then a lane per page-table row
        # a VL model's picture embeddings by digest: a step's worth at least (the rows it runs), so a prefill step's
        # one tower call never drops what its prompts are about to read
        self.vision = (VisionEncoder(self.model, VisionProcessor(model_path, tokenizer=self.tokenizer),
                                     cache_images=max(CACHED_IMAGES, batch_size))
                       if is_vision_language(self.model.config) else None)
        self.engine = ContinuousBatchEngine(
            lm, self.tokenizer, max_running=batch_size, max_len=context_len, trace=self.trace,
            weight_version=lambda: self.weight_version,
            weights_ready=lambda: not self._released and self._awaiting_write is None, kv=kv_cache, compile=compile,
            record_routing=record_routing, cuda_graphs=cuda_graphs, vision=self.vision,
        )
        self.server = None  # rlflow.engines.rollout.server.RolloutServer once start_server() ran
        self._own_client = None  # httpx.Client for the routes this worker drives on its own server
        self._token: str | None = None  # its server's control token

    def pid(self) -> int:
        """This worker's process id (fault-injection drills kill it)."""
        return os.getpid()

    def drain_trace(self) -> list[dict]:
        """Per-request trace events (queued, first token, request span, abort, weight update) since the last
        drain, as Chrome-trace dicts; the driver merges them into the step's timeline."""
        return self.trace.drain()

    # ---- weights -------------------------------------------------------------------------------------
    @contextmanager
    def _between_steps(self):
        """Hold the engine between decode steps: weights never change inside a step."""
        with self.engine.lock:
            yield

    def pause_generation(self) -> None:
        """Hold generation between decode steps (SGLang's /pause_generation, in place) while a weight update of
        several parts lands: requests in flight continue with the new weights after `continue_generation`."""
        self.engine.pause()

    def continue_generation(self) -> None:
        self.engine.resume()

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Copy HF-named tensors into the model; the version goes with every sample generated after."""
        with self._between_steps():
            self._refuse_under_adapter("update_weights")
            t0 = time.perf_counter()
            self.resume_memory_occupation()
            targets = self.weight_targets()
            for name, tensor in named_tensors:
                if self.fp8 is not None and name in self.fp8.names:
                    self.fp8.write(name, tensor)  # quantized on receipt
                elif name not in targets:
                    raise KeyError(f"update_weights: unknown parameter {name!r}")
                else:
                    targets[name].copy_(tensor.to(targets[name].dtype))
            return self._weights_updated(self.weight_version if version is None else version, t0)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Every name a weight update may use, to the tensor it writes: the parameters, and an MoE model's
        experts under their checkpoint names (views of transformers' stacked tensors, engines/models/moe.py).
        Built again only when the weights move (a release and resume, or the flat buffer)."""
        at = self.engine.lm.weight_pointers()
        if self._targets is None or self._targets[0] != at:
            self._targets = at, self.params | checkpoint_named(self.params, self.model.config.model_type)
        return self._targets[1]

    def weight_names(self) -> set[str]:
        """Every name a weight update may use (`weight_targets`, and with fp8 the quantized projections)."""
        names = set(self.weight_targets())
        return names | self.fp8.names if self.fp8 is not None else names

    def update_weights_from_store(self, storage: StorageConfig, run: str, version: int, index: int) -> int:
        """Load bucket `index` of weight version `version` from the run store (the `store` transport)."""
        return self.update_weights(get_bucket(storage, run, version, index), version)

    def update_weights_from_delta(self, storage: StorageConfig, run: str, version: int) -> dict:
        """Rebuild `version` on this worker's host mirror from the run store and load it whole (the `delta`
        transport; generation goes on while the store is read)."""
        result = self._delta.follow(RunStore(storage, run), version)
        if result.applied:
            self.update_weights(self._delta.tensors(), version)
        return result.as_dict()

    def update_weights_from_disk(self, path: str, version: int) -> int:
        """Load every *.safetensors file of the local folder `path` (the `disk` transport; SGLang's
        /update_weights_from_disk does the same for an SGLang worker)."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"update_weights_from_disk: no *.safetensors files in {path}")
        return self.update_weights((kv for f in files for kv in load_file(f).items()), version)

    def weight_bytes(self) -> int:
        """Bytes of the weights a sync delivers to this worker (in its own dtype: fp8 projections as stored)."""
        held = sum(p.numel() * p.element_size() for p in self.params.values())
        return held + (self.fp8.nbytes() if self.fp8 is not None else 0)

    # GPU transports (rlflow.engines.sync.gpu) and colocation
    def attach_ipc(self, handles: list[tuple[str, tuple]]) -> None:
        """cuda_ipc: map the colocated train worker's parameters; every later sync copies from them."""
        self._ipc_sources = open_ipc_handles(handles, sync_device(self.device))
        self._ipc_copy = None

    def update_weights_from_ipc(self, version: int) -> int:
        with self._between_steps():
            self._refuse_under_adapter("update_weights_from_ipc")
            t0 = time.perf_counter()
            self.resume_memory_occupation()
            if self._ipc_copy is None:  # planned again after the weights were re-allocated
                self._ipc_copy = self._ipc_plan()
            self._ipc_copy()
            torch.cuda.synchronize()  # the trainer may step again as soon as this returns
            return self._weights_updated(version, t0)

    def _ipc_plan(self):
        """The copy from the mapped trainer weights; with fp8 the projections are quantized from them instead."""
        if self.fp8 is None:
            return copy_plan(self.params, self._ipc_sources)
        quantized = [(n, t) for n, t in self._ipc_sources if n in self.fp8.names]
        copy = copy_plan(self.params, [(n, t) for n, t in self._ipc_sources if n not in self.fp8.names])

        def run() -> None:
            copy()
            for name, t in quantized:
                self.fp8.write(name, t)

        return run

    def _refuse_fp8(self, what: str) -> None:
        if self.fp8 is not None:
            raise RuntimeError(f"{what}: writes bf16 into the weights' memory, and rollout.precision fp8 quantizes "
                               "weights on receipt (use a transport that sends them by name)")

    def share_weights(self) -> SharedWeights:
        """cuda_ipc with a sharded colocated trainer: the weights (allocated again if released: contents undefined
        until written) as a handle its GPU's train rank writes them through. Generation is refused until
        `weights_written`; refused itself while requests run. On the CPU (tests) the weights move once into a
        shared-memory file."""
        self._refuse_fp8("share_weights")
        with self._between_steps():
            self._refuse_under_adapter("share_weights")
            if not self.engine.idle():  # they would decode from weights being overwritten
                raise RuntimeError("share_weights: requests are running (abort or finish them first)")
            self._write_started = time.perf_counter()
            self.resume_memory_occupation()
            self._awaiting_write = self._allocations  # the weights written must still be these
            flat = flat_span(list(self.params.values()))
            if self.device == "cuda":
                if flat is None:
                    raise RuntimeError("share_weights: the weights are not one flat buffer")
                return share_flat(flat, self.weight_targets())
            if self._shared_file is None or flat is None or flat.data_ptr() != self._shared_file[1].data_ptr():
                self._remove_shared_file()
                path = f"/dev/shm/rlflow-weights-{os.getpid()}-{time.monotonic_ns()}"
                numel = sum(p.numel() for p in self.params.values())
                buffer = torch.from_file(path, shared=True, size=numel, dtype=next(iter(self.params.values())).dtype)
                flatten_(self.params, into=buffer)
                self._shared_file = path, buffer
            return share_flat(self._shared_file[1], self.weight_targets(), self._shared_file[0])

    def _remove_shared_file(self) -> None:
        """The CPU weights' file, if its trainer never mapped it (mapping removes it)."""
        if self._shared_file is not None and os.path.exists(self._shared_file[0]):
            os.unlink(self._shared_file[0])

    def weights_written(self, version: int) -> int:
        with self._between_steps():
            if self._awaiting_write is None:
                raise RuntimeError("weights_written: no weights were shared for writing (share_weights)")
            if self._awaiting_write != self._allocations:
                raise RuntimeError("weights_written: the weights were released after share_weights; what the trainer "
                                   "wrote is gone (share them again)")
            self._awaiting_write = None
            return self._weights_updated(version, self._write_started)

    def nccl_connect(self, host: str, port: int, rank: int, world_size: int) -> None:
        self._nccl = NcclChannel(host, port, rank, world_size, sync_device(self.device))

    def update_weights_from_nccl(self, buckets: list[list[str]], version: int) -> int:
        self._refuse_fp8("update_weights_from_nccl")
        with self._between_steps():
            self._refuse_under_adapter("update_weights_from_nccl")
            t0 = time.perf_counter()
            self.resume_memory_occupation()
            self._nccl.receive(self.weight_targets(), buckets)
            return self._weights_updated(version, t0)

    def release_memory_occupation(self) -> None:
        """Colocated: give the weights' and the KV cache's GPU memory to the trainer. The weights are gone
        until the next sync refills them, as SGLang's route of that name does; refused while requests run."""
        with self._between_steps():
            if not self.engine.drop_cache():
                raise RuntimeError("release_memory_occupation: requests are running (abort or finish them first)")
            if self._released:
                return
            if self.lora is not None:  # the targeted weights' base is in self._merged already
                self._host_weights = {n: host_copy(p) for n, p in self.params.items() if n not in self._merged.base}
            for p in self.params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if self.fp8 is not None:
                self.fp8.release()
            self.engine.lm.unfuse()  # views of the old weights there and in the targets would keep their memory
            self._targets = None
            self._released = True
            self._allocations += 1
            if self.device == "cuda":
                torch.cuda.ipc_collect()  # weights a sharded trainer wrote through CUDA IPC (it let them go)
                torch.cuda.empty_cache()

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Allocate the weights again: contents undefined until the sync that follows writes them, except in a
        LoRA run, where the weights kept in host memory and the merged adapter are written back. Every
        weight update does this first, so a colocated sync costs no extra call. `tags` without 'weights' (the
        KV cache, SGLang's CUDA graphs): nothing to do, the engine allocates its cache when it generates."""
        if tags is not None and "weights" not in tags:
            return
        with self._between_steps():
            if not self._released:
                return
            self._ipc_copy = None
            if self.flat:
                with plain_segments():
                    flatten_(self.params, shapes=self._shapes)
            else:
                for n, p in self.params.items():
                    p.data = torch.empty(self._shapes[n], dtype=p.dtype, device=p.device)
            if self.fp8 is not None:
                self.fp8.allocate()
            self._released = False
            if self._host_weights is not None:
                with torch.no_grad():
                    for n, t in self._host_weights.items():
                        self.params[n].copy_(t)
                self._host_weights = None
                if self._merged.adapter is not None:
                    self._merged.merge(self.params, self._merged.adapter)
                else:
                    self._merged.restore(self.params)

    # ---- LoRA adapters (SGLang's /load_lora_adapter, /unload_lora_adapter, /update_weight_version) ------------
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Merge the PEFT adapter in the local folder `lora_path` into the weights and serve it as `lora_name`,
        replacing the adapter merged before, under this name or another (merged from the base, not on top of
        it: the adapter transport loads each version under one name). Requests in flight
        continue with it from the next decode step, as after a weight update; the engine keeps no prefix
        cache across requests, so nothing computed with the old weights is reused. ValueError for a bad
        adapter (naming the file and key), RuntimeError when the engine was not started for LoRA."""
        if self.lora is None:
            raise RuntimeError("load_lora_adapter: this engine was started without LoRA (TorchRolloutBackend's "
                               "lora=; the launch module's --enable-lora --max-lora-rank --lora-target-modules)")
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name: a non-empty string, got {lora_name!r}")
        adapter = read_adapter(lora_name, lora_path, self.model, self._shapes, self.lora)
        with self._between_steps():
            t0 = time.perf_counter()
            self.resume_memory_occupation()
            self._merged.merge(self.params, adapter)
            self._timed_update(t0)
            self.trace.instant("lora_load", tid=QUEUE_TID, args={"lora_name": lora_name})

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Write the base weights back (bitwise) and serve the base model again."""
        served = self._merged.adapter
        if served is None or served.name != lora_name:
            raise ValueError(f"lora_name: {lora_name!r} is not loaded (loaded: {list(self.loaded_adapters())})")
        with self._between_steps():
            self.resume_memory_occupation()
            self._merged.restore(self.params)
            self.trace.instant("lora_unload", tid=QUEUE_TID, args={"lora_name": lora_name})

    def update_weight_version(self, version: int) -> None:
        """The version stamped on what the engine generates from its next step on (meta_info.weight_version)."""
        with self._between_steps():
            self.weight_version = version
            self.trace.instant("weight_version", tid=QUEUE_TID, args={"version": version})

    def loaded_adapters(self) -> dict[str, str]:
        """{name: folder} of the adapter served ({} for the base model): SGLang's `loaded_adapters`."""
        served = self._merged.adapter
        return {} if served is None else {served.name: served.path}

    def served_adapter(self) -> str | None:
        """The name of the adapter merged into the weights, or None (the base model)."""
        return None if self._merged.adapter is None else self._merged.adapter.name

    def base_update_refusal(self, what: str) -> str | None:
        """Why a base weight update is refused now (an adapter is merged), or None: the next adapter is merged
        from the base kept at the first load, so a base update under an adapter would be silently lost."""
        served = self.served_adapter()
        if served is None:
            return None
        return (f"{what}: LoRA adapter {served!r} is merged into the weights; unload it first "
                "(/unload_lora_adapter), then update the base")

    def _refuse_under_adapter(self, what: str) -> None:
        if (refusal := self.base_update_refusal(what)) is not None:
            raise RuntimeError(refusal)

    def last_update_seconds(self) -> float:
        """Time of the last weight update inside this worker: the transfer without the driver's calls."""
        return self.last_update_s

    def link_bandwidth(self, kind: str, nbytes: int) -> float:
        """GB/s of the NCCL weight-sync group (the trainer's rank 0 measures at the same time)."""
        if kind != "nccl":
            raise ValueError(f"link_bandwidth: the rollout side measures 'nccl' only, not {kind!r}")
        return self._nccl.measure_bandwidth(nbytes)

    @torch.no_grad()
    def weights_digest(self) -> float:
        held = sum(p.double().sum() for p in self.params.values())
        return float(held + (self.fp8.digest() if self.fp8 is not None else 0.0))

    def _weights_updated(self, version: int, start_s: float) -> int:
        self.weight_version = version
        self._timed_update(start_s)
        self.trace.instant("weight_update", tid=QUEUE_TID, args={"version": version})
        return version

    def _timed_update(self, start_s: float) -> None:
        """An update (a transport's bucket, a route's call, an adapter merge) ended: its seconds for
        last_update_seconds and /metrics."""
        self.last_update_s = time.perf_counter() - start_s
        if self.vision is not None and not self.frozen_vision:  # a trained tower changes the cached embeddings
            self.vision.clear()
        self.weight_updates += 1
        self.weight_update_seconds += self.last_update_s

    def named_tensors(self, names: list[str] | None = None) -> list[tuple[str, torch.Tensor]]:
        """The weights generation uses now (all, or the named ones), HF-named, copied to the CPU: tests compare
        them across transports, and the weight-sync benchmark a few of them with the trainer's."""
        targets = self.weight_targets()
        known = self.weight_names()
        unknown = [n for n in names or () if n not in known]
        if unknown:
            raise KeyError(f"named_tensors: unknown parameter(s) {unknown[:3]}")
        return [(n, self.fp8.read(n, self.model.dtype).cpu() if n not in targets else targets[n].detach().cpu().clone())
                for n in (names or [*self.params, *sorted(self.fp8.names if self.fp8 is not None else ())])]

    # ---- generation ----------------------------------------------------------------------------------
    def requests(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 rid: str | None = None, first_index: int = 0, image_data: PromptsImages = None
                 ) -> list[Request]:
        """`params.n` requests per prompt, prompt-major. Request i samples from generator (seed, first_index + i):
        its tokens do not depend on what else runs in the batch, and a slice of a larger call given its offset as
        `first_index` samples what that call would (the evaluate flow's shards). No seed: fresh randomness.
        `image_data[i]`: prompt i's images (vision-language models; ValueError when they do not match its tokens)."""
        if self._released:
            raise RuntimeError("generate: the weights were released (release_memory_occupation); resume and "
                               "update them first")
        seed = random.getrandbits(63) if seed is None else seed
        one = params.model_copy(update={"n": 1})
        per_prompt = self._prompt_images(prompts, image_data)
        out = []
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                index = i * params.n + j
                kwargs = {} if rid is None else {"rid": rid if len(prompts) * params.n == 1 else f"{rid}_{index}"}
                ids = prompt if per_prompt[i] is None else per_prompt[i].prompt_ids  # pads expanded
                out.append(Request(list(ids), one, request_generator(seed, first_index + index),
                                   images=per_prompt[i], **kwargs))
        return out

    def _prompt_images(self, prompts: list[list[int]], images: PromptsImages
                       ) -> list[PromptImages | None]:
        """Each prompt's images checked against its tokens (VisionEncoder.prepare), None where it has none. A
        prompt with image pad tokens and no images is refused: its pads would run as text, unlike in training."""
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"image_data: {len(images)} items for {len(prompts)} prompts")
        if self.vision is not None:
            pad = self.vision.processor.image_token_id
            bare = [i for i, p in enumerate(prompts) if (images is None or not images[i]) and pad in p]
            if bare:
                raise ValueError(f"image_data: prompt {bare[0]} has image pad tokens ({pad}) and no images (a "
                                 "rollout function must pass a prompt's images with every request for it)")
        if images is None or not any(images):
            return [None] * len(prompts)
        if self.vision is None:
            raise ValueError(f"image_data: the model at {self.model_path} is not a vision-language model "
                             "(Qwen2-VL, Qwen2.5-VL)")
        where = "image_data" if len(prompts) == 1 else "image_data[{}]"
        return [self.vision.prepare(p, im, where.format(i)) if im else None
                for i, (p, im) in enumerate(zip(prompts, images, strict=True))]

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 first_index: int = 0, image_data: PromptsImages = None) -> list[Generation]:
        """Generate for all prompts on the continuous-batching engine (admitted in order, `batch_size` at a
        time); blocks until every request finished. `first_index`, `image_data`: as in `requests`."""
        futures = self.engine.submit(self.requests(prompts, params, seed, first_index=first_index,
                                                  image_data=image_data))
        return [f.result() for f in futures]

    def generate_packed(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                        first_index: int = 0, image_data: PromptsImages = None) -> dict:
        """`generate`, returned as flat arrays (see pack_generations): what the RL loop moves over Ray."""
        return pack_generations(self.generate(prompts, params, seed, first_index, image_data))

    # ---- the HTTP server -----------------------------------------------------------------------------
    def start_server(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> str:
        """Serve SGLang's routes for this engine on `host` (port 0: one the OS picks); the URL, built from the
        address bound. With `token`, control routes need it. Later calls return the running server's URL."""
        if self.server is None:
            self.server, self._token = RolloutServer(self, host, port, token, self.weight_dirs), token
        return self.server.url

    def server_url(self) -> str | None:
        return None if self.server is None else self.server.url

    # the `distributed` transport: SGLang's pair of routes on this engine's own server, as an SGLang worker
    # drives SGLang's (the route receives the trainer's broadcast and loads it between decode steps)
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = GROUP_NAME, backend: str = "gloo") -> None:
        self._post_own("/init_weights_update_group",
                       init_request(master_address, master_port, rank_offset, world_size, group_name, backend))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        version: int, group_name: str = GROUP_NAME) -> int:
        self._post_own("/update_weights_from_distributed", update_request(names, dtypes, shapes, version, group_name))
        return version

    def destroy_weights_update_group(self, group_name: str = GROUP_NAME) -> None:
        self._post_own("/destroy_weights_update_group", {"group_name": group_name})

    def weight_update_ranks(self) -> int:
        return 1  # the embedded engine is one process

    def weight_dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    def end_weight_update(self) -> None:
        """Nothing waits for the end of an update here: each bucket writes the parameters in place, and the engine
        keeps no prefix cache that the old weights computed."""

    def _post_own(self, route: str, body: dict) -> None:
        """POST to this worker's own server, over one kept-alive client: a new httpx client costs ~25 ms (its
        TLS context), as much as a whole small weight update."""
        url = self.start_server()
        if self._own_client is None:
            self._own_client = httpx.Client(timeout=httpx.Timeout(None, connect=10), headers=auth_headers(self._token))
        r = self._own_client.post(url + route, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"rollout worker: {route} answered {r.status_code}: {r.text[:500]}")

    def close(self) -> None:
        if self._own_client is not None:
            self._own_client.close()
            self._own_client = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.engine.shutdown()
        self._remove_shared_file()


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
