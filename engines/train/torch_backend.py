"""The native PyTorch train engine: FSDP2 ranks over torch.distributed (gloo on CPU, nccl on GPU).

One instance per worker. The model is sharded with FSDP2 (engines/train/fsdp.py: bf16 compute over fp32 master
weights, optional CPU offload, sharded checkpoints); each rank trains on its own shard of the batch. The losses
come from rlflow.engines.core.algorithms; this file only batches and steps. Micro-batches are filled up to a
token budget (engines/train/microbatch.py) and run packed, without padding, through engines/models/packed.py;
the losses still see the padded [rows, width] layout, so every loss_agg mode is computed exactly as on the
unpacked batch. Every loss is normalised by the *global* token/sequence count of its mini-batch (token_sum: not
normalised, its sums add up) and FSDP2 sums the gradients, so W ranks take the same optimizer steps as one rank on
the whole batch.

A worker has one of three roles. "policy" (the default) trains the causal LM with rl_loss. "critic" trains a
value model (rlflow.engines.models.hf.load_value_model: the same body with a scalar head) with value_loss on the same
packed batches; micro-batching, normalisation, sharding, the optimizer and checkpoints are the same code for
both. "teacher" (on-policy distillation) is a frozen causal LM in its own precision that only scores batches
(forward_logprobs): the same packed logprob pass, no optimizer step.

A vision-language model (Qwen2-VL, Qwen2.5-VL; docs/multimodal.md) trains on the same packed micro-batches: each
one's images are read from the run store by the digests in its `image_ids` column (engines/train/vision.py) and
go through the vision tower inside the packed forward (engines/models/packed.py). With train.freeze_vision the
tower is frozen: no gradients, no optimizer state, and weight syncs leave it out.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rlflow.engines.core import algorithms
from rlflow.engines.core.batch import (
    IMAGE_IDS,
    ROUTED_EXPERTS,
    TEACHER_LOGPROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    TrainBatch,
    batch_size,
    select,
)
from rlflow.engines.core.config import AlgorithmConfig, DistillConfig, StorageConfig, TrainConfig
from rlflow.engines.core.protocols import CriticBackend, TeacherBackend, TrainBackend
from rlflow.engines.models.hf import DTYPES, load_model, load_value_model
from rlflow.engines.models.moe import checkpoint_named
from rlflow.engines.models.packed import PackedLM, PackedRows
from rlflow.engines.models.routing import per_layer, recording, routing_shape, set_replay
from rlflow.engines.models.transfer import tensor_to_device
from rlflow.engines.models.vision_language import VISION_PREFIX, is_vision_language
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.adapter import AdapterSender
from rlflow.engines.sync.base import free_rendezvous_address
from rlflow.engines.sync.cuda_ipc import IpcSender, SharedWeights, SharedWeightsWriter, export_ipc_handles
from rlflow.engines.sync.delta import DeltaSender
from rlflow.engines.sync.delta_format import DeltaPublisher, torch_dtype
from rlflow.engines.sync.distributed import GROUP_NAME, DistributedSender, DistributedWeightSender
from rlflow.engines.sync.gpu import GpuLinkProbe, all_gather_bandwidth, device_copy_bandwidth, sync_device
from rlflow.engines.sync.nccl import NcclChannel, NcclSender
from rlflow.engines.sync.store import StoreSender, put_bucket
from rlflow.engines.train import fsdp, lora
from rlflow.engines.train.context_parallel import check_context_parallel, check_lengths, context_mesh
from rlflow.engines.train.expert_parallel import check_expert_parallel, shard_experts
from rlflow.engines.train.kernels import apply_kernels
from rlflow.engines.train.microbatch import ROW_COLUMNS, packed_micro_batches
from rlflow.engines.train.offload import HostParking, memory_moved
from rlflow.engines.train.rng import restore_rng, rng_state
from rlflow.engines.train.vision import ImageInputs

# a micro-batch's tensors the forward packs on the host (a vision-language batch's image digests are read there)
PACKED_ON_HOST = ("input_ids", "attention_mask", IMAGE_IDS)


def lr_lambda(cfg: TrainConfig):
    """Multiplier of the base LR at optimizer step s: linear warmup, then constant/cosine/linear decay."""
    total = max(cfg.steps * cfg.epochs * cfg.mini_batches, 1)
    warm = cfg.warmup_steps * cfg.epochs * cfg.mini_batches

    def f(s: int) -> float:
        if warm and s < warm:
            return (s + 1) / warm
        if cfg.lr_schedule == "constant":
            return 1.0
        frac = min(max((s - warm) / max(total - warm, 1), 0.0), 1.0)
        decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_schedule == "cosine" else 1 - frac
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return f


class TorchTrainBackend(TrainBackend, CriticBackend, TeacherBackend, StoreSender, DistributedSender, NcclSender,
                        IpcSender, AdapterSender, DeltaSender, GpuLinkProbe):
    """One FSDP2 rank of the policy (or, as role "critic", of the value model). Its bases are protocols only: what
    the session and each weight transport may call on it. The transports' code comes by composition (the weight
    sync section)."""

    def __init__(
        self,
        model_path: str,
        train: TrainConfig,
        algorithm: AlgorithmConfig,
        *,
        temperature: float = 1.0,
        norm_len: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        dist_url: str | None = None,
        seed: int = 0,
        role: Literal["policy", "critic", "teacher"] = "policy",
        value_clip: float | None = None,
        collective_timeout_s: float = 1800,
        distill: DistillConfig | None = None,
        true_on_policy: bool = False,
        storage: StorageConfig | None = None,
        run: str | None = None,
    ):
        """`role` "critic": a value model from `model_path` trained with value_loss (clipped at `value_clip`);
        "teacher": a frozen LM in train.precision that only runs forward_logprobs. `distill`: the run's
        on-policy distillation (its terms join rl_loss). `collective_timeout_s`: how long a collective waits
        for the other ranks before it raises. `true_on_policy` (rollout.true_on_policy; a policy): the forward runs
        engines/models/invariant.py's ops, as the embedded rollout engine in that mode, so its log-probs of the
        sampled tokens are the engine's bit for bit. `storage` and `run`: the run store a vision-language
        model's images are read from (by the digests in a batch's image_ids)."""
        torch.set_num_threads(train.threads)
        self.cfg, self.algo, self.role, self.value_clip = train, algorithm, role, value_clip
        self.true_on_policy = true_on_policy and role == "policy"
        # the critic regresses every response token's value with the same weight, whatever the policy's aggregation
        self.loss_agg = algorithm.loss_agg if role == "policy" else "token_mean"
        self.loss_kwargs = algorithm.loss_kwargs() | (distill.loss_kwargs() if distill is not None else {})
        self.temperature, self.norm_len = temperature, norm_len
        self.rank, self.world_size = rank, world_size
        self._writing: fsdp.BackgroundSave | None = None  # a checkpoint its thread is writing (async_save)
        self._save_group: dist.ProcessGroup | None = None  # that thread's gloo group, made at the first such save
        self._collective_timeout_s = collective_timeout_s
        fsdp.init_process_group(train.device, rank, world_size, dist_url, collective_timeout_s)
        torch.manual_seed(seed + rank)
        self.device = train.device
        load = load_value_model if role == "critic" else load_model
        # fp32 master weights, loaded on the host: fully_shard moves each layer to the GPU as it shards it (and
        # keeps offloaded shards on the host), so no rank ever holds the whole model on its GPU. A teacher is
        # never trained: its weights are loaded in the compute dtype, frozen, like the reference model's
        # train.lora: the base is frozen in the compute dtype as well, and only the adapters train (fp32 masters)
        frozen = role == "teacher"
        self.lora = train.lora if role == "policy" else None
        self.model_path = model_path
        base_dtype = DTYPES[train.precision] if frozen or self.lora else torch.float32
        self.model = load(model_path, dtype=base_dtype, device="cpu")
        self.vision_language = is_vision_language(self.model.config)
        self.freeze_vision = self.vision_language and train.freeze_vision
        if self.freeze_vision:  # before the optimizer and FSDP2 see the parameters
            self.model.model.visual.requires_grad_(False)
        self._images = ImageInputs(model_path, RunStore(storage, run) if storage is not None and run else None) \
            if self.vision_language else None
        self.routing_shape = routing_shape(self.model)  # (MoE layers, k): what a routing record replays
        if algorithm.routing_replay != "off" and role == "policy" and self.routing_shape is None:
            raise ValueError(f"algorithm.routing_replay {algorithm.routing_replay}: the model at {model_path} has no "
                             "MoE layers; routing replay applies to mixtures of experts")
        apply_kernels(self.model, train.kernels)
        # train.expert_parallel: the policy's experts split over every rank (engines/train/expert_parallel.py)
        ep = train.expert_parallel if role == "policy" else 1
        check_expert_parallel(self.model, ep, world_size, model_path)
        mesh = init_device_mesh(train.device, (world_size,)) if ep > 1 else None
        expert_shards = shard_experts(self.model, mesh) if ep > 1 else None
        # train.context_parallel: each micro-batch's stream split over a CP group (engines/train/context_parallel.py)
        self.cp = train.context_parallel if role == "policy" else 1
        check_context_parallel(self.model, self.cp, world_size, model_path, {
            "train.expert_parallel": ep > 1, "train.lora": self.lora is not None,
            "algorithm.routing_replay": algorithm.routing_replay != "off",
            f"a vision-language model ({model_path})": self.vision_language})
        cp_mesh = context_mesh(train.device, world_size, self.cp) if self.cp > 1 else None
        self._cp_group = cp_mesh["cp"].get_group() if cp_mesh is not None else None
        self._dp_group = cp_mesh["dp"].get_group() if cp_mesh is not None else None  # None: every rank
        if frozen:
            self.model.eval().requires_grad_(False)
        if self.lora is not None:  # every rank draws the same A: FSDP2 keeps each rank's slice of its own copy
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                lora.add_adapters(self.model, self.lora)
        # FSDP2 casts fp32 masters to the compute dtype; a frozen model is in it already, and with LoRA each part
        # keeps its own (FSDP2 cannot reduce the fp32 adapters' gradients beside a bf16 base in one unit): the
        # base is in train.precision and autocast runs the adapters in it (lora.adapter_compute)
        compute = DTYPES[train.precision] if train.precision != "fp32" and not frozen and not self.lora else None
        self._compute = (partial(lora.adapter_compute, train.device, DTYPES[train.precision]) if self.lora
                         else nullcontext)
        self.lm = fsdp.shard(
            PackedLM(self.model, train.logprob_chunk_tokens, "off" if frozen else train.activation_checkpointing,
                     train.compile, train.fused_head, self.true_on_policy, train.attention_kernel), compute,
            train.cpu_offload, train.reshard_after_forward, mesh, expert_shards)
        self.ref_model = self.ref_lm = None
        # the KL penalty's reference: a frozen copy of the starting policy (with LoRA, the base: adapters off)
        self.has_reference = algorithm.kl_coef > 0 and role == "policy"
        if self.has_reference and self.lora is None:
            self.ref_model = load_model(model_path, dtype=DTYPES[train.precision], device="cpu").eval()
            self.ref_model.requires_grad_(False)
            apply_kernels(self.ref_model, train.kernels)
            self.ref_lm = fsdp.shard(PackedLM(self.ref_model, train.logprob_chunk_tokens, fused_head=train.fused_head),
                                     None, train.cpu_offload)
        # fused on the GPU: one kernel per step and no temporaries the size of the model (foreach's are)
        fused = self.device == "cuda" and not train.cpu_offload
        # the optimizer holds what trains: all, or LoRA's adapters, and never a frozen vision tower (a frozen role's
        # model never steps)
        trainable = list(self.model.parameters()) if frozen else [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=train.lr, betas=train.betas,
                                           weight_decay=train.weight_decay, fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(train))
        # colocated: what offload() parked in host memory while the rollout engine has the GPU
        self._parked_weights, self._parked_optimizer = HostParking(), HostParking()
        # named_tensors: sent name -> module parameter, and the last stacked MoE parameter it gathered
        self._source: dict[str, str] | None = None
        self._shapes: dict[str, torch.Tensor] | None = None  # _sent_shapes'
        self._stacked: tuple[tuple[str, str, bool], str, torch.Tensor | None] | None = None
        # this worker's end of the transports that keep state: a weight-update group (distributed), a channel and
        # the rollout dtype (nccl), the mapped weights of this GPU's rollout worker (cuda_ipc over several ranks)
        self._update_group = DistributedWeightSender(rank)
        self._nccl: NcclChannel | None = None
        self._nccl_dtype: torch.dtype | None = None
        self._shared_weights = SharedWeightsWriter()
        self._delta = DeltaPublisher()  # rank 0's copy of the last version the delta transport published

    # ---- forward -------------------------------------------------------------------------------------
    def _forward(self, lm: PackedLM, mb: TrainBatch, with_entropy: bool, temperature: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token logprobs [rows, width] (aligned with input_ids: column t is log p(x_t | x_<t), column 0
        is 0) and, if asked, entropy; for a critic, its values in the logprobs' place."""
        packed = self._pack(mb)
        if self._cp_group is not None:
            packed = packed.split_over(self._cp_group)
        self._route(lm, mb, packed)
        out, entropy = self._run(lm, packed, self.temperature if temperature is None else temperature, with_entropy)
        return packed.unpack(out), None if entropy is None else packed.unpack(entropy)

    def _pack(self, mb: TrainBatch) -> PackedRows:
        """The micro-batch as one packed stream on the device; a vision-language model's with its images (read by
        the digests of IMAGE_IDS, engines/train/vision.py) and M-RoPE positions."""
        packed = PackedRows.from_padded(mb["input_ids"], mb["attention_mask"])
        if self._images is not None and IMAGE_IDS in mb:
            packed = self._images.attach(packed, mb[IMAGE_IDS])
        elif IMAGE_IDS in mb and mb[IMAGE_IDS].any():
            raise ValueError(f"{IMAGE_IDS}: the batch has images, but the model at {self.model_path} is not a "
                             "vision-language model")
        return packed.to(self.device)

    def _route(self, lm: PackedLM, mb: TrainBatch, packed: PackedRows) -> None:
        """The micro-batch's recorded expert routing (ROUTED_EXPERTS, routing replay) replayed in the next forward
        of `lm`, or live routing where it has none. It stays set through the backward: activation checkpointing
        recomputes the forward there."""
        if self.routing_shape is None:
            if ROUTED_EXPERTS in mb:
                raise ValueError("routing replay: the batch carries expert routing, but this model has no MoE layers")
            return
        record = mb.get(ROUTED_EXPERTS)
        if record is None:
            set_replay(lm.model, None)
            return
        ids = record[packed.rows.to(record.device), packed.cols.to(record.device)]
        set_replay(lm.model, per_layer(tensor_to_device(ids, self.device), *self.routing_shape))

    @torch.no_grad()
    def record_routing(self, batch: TrainBatch) -> torch.Tensor:
        """The policy's own expert choice for every token of the batch, as a ROUTED_EXPERTS column [N, L,
        layers x k] (routing replay r2: recorded before the update, replayed in its training forwards)."""
        if self.routing_shape is None:
            raise ValueError("record_routing: this model has no MoE layers")
        self._resident("record_routing")
        self.lm.eval()
        width = self.routing_shape[0] * self.routing_shape[1]

        def record(micro: TrainBatch) -> torch.Tensor:
            packed = self._pack(micro)
            set_replay(self.lm.model, None)
            with recording(self.lm.model) as recorded:
                self._run(self.lm, packed, self.temperature)
            return packed.unpack(recorded[0].view(-1, width))

        return self._per_token({k: v for k, v in batch.items() if k != ROUTED_EXPERTS}, record, (width,),
                               dtype=torch.int16)

    def _run(self, lm: PackedLM, *args, **kwargs):
        """Every forward of a PackedLM goes through here: with LoRA, under the adapters' compute context
        (lora.adapter_compute), which a call site of its own could forget."""
        with self._compute():
            return lm(*args, **kwargs)

    def _forward_with_topk(self, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The policy's logprobs and entropy [rows, width] as _forward gives them, and its logprobs [rows, width,
        k] of the teacher's top-k ids at each position (TEACHER_TOPK_IDS), all with their gradient."""
        packed = self._pack(mb)
        self._route(self.lm, mb, packed)
        ids = mb[TEACHER_TOPK_IDS][packed.rows, packed.cols].to(self.device)
        out, entropy, topk = self._run(self.lm, packed, self.temperature, True, other_ids=ids)
        return packed.unpack(out), packed.unpack(entropy), packed.unpack(topk)

    def micro_batches(self, batch: TrainBatch) -> list[tuple[list[int], TrainBatch]]:
        """The batch's rows in micro-batches of at most train.micro_batch_tokens tokens (summed: they run
        packed) and train.micro_batch_size samples: (row indices, the rows cut to their longest one's width)."""
        if self.cp == 1:
            return packed_micro_batches(batch, self.cfg.micro_batch_tokens, self.cfg.micro_batch_size)
        # context parallel: a CP group runs each micro-batch, every rank 1/CP of its tokens
        check_lengths(batch["attention_mask"].sum(-1).tolist(), self.cp, self.cfg.micro_batch_tokens)
        return packed_micro_batches(batch, self.cp * self.cfg.micro_batch_tokens, self.cfg.micro_batch_size)

    def _agreed_micro_batches(self, batch: TrainBatch) -> list[tuple[list[int], TrainBatch]]:
        """This rank's micro-batches, padded to the most any rank has with empty ones ([] rows: one short row
        whose result is dropped): every forward and backward gathers parameters collectively, so all ranks
        must run the same number."""
        micros = self.micro_batches(batch)
        count = torch.tensor(len(micros))
        if self.world_size > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if len(micros) == int(count):
            return micros
        return micros + [([], _padding_row(batch))] * (int(count) - len(micros))

    def _per_token(self, batch: TrainBatch, run, extra: tuple[int, ...] = (), dtype=torch.float32) -> torch.Tensor:
        """`run(micro)` [rows, w, *extra] over every micro-batch, back into the batch's [N, width, *extra] layout
        on CPU."""
        out = torch.zeros(tuple(batch["input_ids"].shape) + extra, dtype=dtype)
        for idx, micro in self._agreed_micro_batches(batch):
            result = run(micro)
            if idx:
                out[torch.tensor(idx)[:, None], torch.arange(micro["input_ids"].shape[1])] = result.to(dtype).cpu()
        return out

    @torch.no_grad()
    def forward_topk(self, batch: TrainBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest tokens at each position under this model (a distillation teacher's top-k): (ids
        [N, L, k], logprobs [N, L, k]) aligned with input_ids (position t: the distribution of token t)."""
        self._resident("forward_topk")
        self.lm.eval()

        def top(micro: TrainBatch) -> torch.Tensor:  # ids and logprobs side by side (ids < 2^24: exact in fp32)
            packed = self._pack(micro)
            ids, logprobs = self._run(self.lm, packed, self.temperature, top_k=k)
            return packed.unpack(torch.cat([ids.float(), logprobs], dim=-1))

        both = self._per_token(batch, top, (2 * k,))
        return both[..., :k].long(), both[..., k:]

    @torch.no_grad()
    def forward_values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's per-token values [N, L] (aligned with input_ids: column t is the value of the state
        before token t, column 0 is 0)."""
        if self.role != "critic":
            raise ValueError("forward_values: this worker is a policy; values come from a role='critic' worker")
        self._resident("forward_values")
        self.model.eval()
        return self._per_token(batch, lambda micro: self._forward(self.lm, micro, False)[0])

    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs [N, L] (aligned with input_ids) under the policy or the reference model."""
        if reference and not self.has_reference:
            raise ValueError("forward_logprobs(reference=True) needs algorithm.kl_coef > 0")
        lm = self.ref_lm if reference and self.lora is None else self.lm
        self._resident("forward_logprobs")
        lm.eval()
        with lora.adapters_off(self.model) if reference and self.lora is not None else nullcontext():
            return self._per_token(batch, lambda micro: self._forward(lm, micro, False)[0])

    # ---- training ------------------------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Summed over the data-parallel ranks (with context parallelism a CP group holds one copy)."""
        if self.world_size // self.cp > 1:
            dist.all_reduce(t, group=self._dp_group)
        return t

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL iteration on this worker's shard: epochs x mini_batches optimizer steps. Returns global metrics.

        A critic's batch holds input_ids, attention_mask, loss_mask, returns and old_values (the values the
        advantages were computed with).
        A policy batch without `rollout_logprobs` (no rollout correction: the session never ran the train engine's
        own forward of the step) gets rollout_logprob_diff_max / _mean measured here, on the first optimizer step's
        forward, the only one under the weights that sampled the batch: no extra forward is made, so with
        mini_batches > 1 it covers the first mini-batch's tokens only. With correction the advantages stage
        measures it over the whole batch."""
        if self.role == "teacher":
            raise ValueError("train_step: this worker is a distillation teacher; it only scores (forward_logprobs)")
        measure = self.role == "policy" and "rollout_logprobs" not in batch
        self._resident("train_step", optimizer=True)
        if self.has_reference and self.algo.kl_in == "loss" and "ref_logprobs" not in batch:
            batch = {**batch, "ref_logprobs": self.forward_logprobs(batch, reference=True)}
        if self.role == "policy" and self.algo.routing_replay == "r2" and ROUTED_EXPERTS not in batch:
            batch = {**batch, ROUTED_EXPERTS: self.record_routing(batch)}  # the pre-update policy's choice
        if self.role == "policy" and self.algo.corrects_rollout and "rollout_logprobs" not in batch:
            batch = with_train_logprobs(batch, self.forward_logprobs(batch))
        t0 = time.perf_counter()
        self.model.train()
        n = batch_size(batch)
        per_mb = n // self.cfg.mini_batches
        sums: dict[str, torch.Tensor] = {}
        updates = self.cfg.epochs * self.cfg.mini_batches
        diff = None
        for epoch in range(self.cfg.epochs):
            for m in range(self.cfg.mini_batches):
                first = measure and epoch == 0 and m == 0
                stats = self._optimizer_step(select(batch, slice(m * per_mb, (m + 1) * per_mb)), measure=first)
                if first:
                    diff = self._reduce_diff(stats.pop(DIFF_STATS))
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v / updates
        measured = algorithms.logprob_diff_metrics(diff) if diff is not None else {}
        if diff is not None and self.true_on_policy:  # how many tokens engines/core/on_policy.py's check covers
            measured["rollout_logprob_diff_tokens"] = float(diff[2])
        # the stage's wall time minus this is what moving the batch and calling the worker cost
        return {k: float(v) for k, v in sums.items()} | measured | {"worker_s": time.perf_counter() - t0}

    def _reduce_diff(self, stats: torch.Tensor) -> torch.Tensor:
        """algorithms.logprob_diff's vector over every rank: max of the maxima, sums of the rest."""
        if self.world_size // self.cp == 1:
            return stats
        peak, rest = stats[:1].clone(), stats[1:].clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self._dp_group)
        dist.all_reduce(rest, group=self._dp_group)
        return torch.cat([peak, rest])

    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """One supervised optimizer step on this worker's shard: NLL of the loss-masked (response) tokens.

        The logprobs are the model's own (temperature 1), not the rollout's temperature-scaled ones."""
        self._resident("sft_step", optimizer=True)
        t0 = time.perf_counter()
        self.model.train()
        stats = self._optimizer_step(batch, sft=True)
        return {k: float(v) for k, v in stats.items()} | {"worker_s": time.perf_counter() - t0}

    def _optimizer_step(self, mb: TrainBatch, sft: bool = False, measure: bool = False) -> dict[str, torch.Tensor]:
        """One optimizer step on a mini-batch; `measure`: also this rank's algorithms.logprob_diff of its forward
        against the rollout's logprobs, under DIFF_STATS."""
        mode = "token_mean" if sft else self.loss_agg
        diff = torch.zeros(3, dtype=torch.float64, device=self.device)  # read once, with the metrics
        total_weight = self._all_reduce(algorithms.aggregation_weight(mb["loss_mask"], mode).double().clone())
        self.optimizer.zero_grad()
        metric_sums: dict[str, torch.Tensor] = {}  # on the device: read once, after the last micro-batch
        for idx, micro in self._agreed_micro_batches(mb):
            # the token ids and mask stay on the host: they are packed there (PackedRows.from_padded reads the
            # lengths, which on the device would wait for the GPU), then moved
            micro = {k: v if k in PACKED_ON_HOST else tensor_to_device(v, self.device) for k, v in micro.items()}
            loss, metrics, logprobs = self._loss(micro, sft)
            loss_scale, share = algorithms.micro_batch_scales(micro["loss_mask"], total_weight, mode)
            if not idx:  # a padding micro-batch: it joins the collectives, adds nothing
                loss_scale, share = loss_scale * 0, share * 0
            elif measure:
                rollout = micro.get("rollout_logprobs", micro["old_logprobs"])
                diff = algorithms.merge_logprob_diff(diff, algorithms.logprob_diff(logprobs, rollout,
                                                                                   micro["loss_mask"]))
            (loss * loss_scale.float()).backward()  # FSDP2 reduce-scatters (sums) the gradients over ranks
            for k, v in algorithms.scale_metrics(metrics, loss_scale, share).items():
                metric_sums[k] = metric_sums.get(k, 0.0) + v
        grad_norm = fsdp.grad_norm(list(self.model.parameters()), self.cfg.grad_clip)
        self.optimizer.step()
        self._forget_gathered()
        keys = sorted(metric_sums)
        reduced = (self._all_reduce(torch.stack([metric_sums[k].to(self.device) for k in keys]).cpu()) if keys
                   else torch.zeros(0))
        out = dict(zip(keys, reduced, strict=True))
        out["grad_norm"] = grad_norm.detach().double().cpu()
        out["lr"] = torch.tensor(self.scheduler.get_last_lr()[0], dtype=torch.float64)
        self.scheduler.step()  # the schedule counts optimizer steps
        if measure:
            out[DIFF_STATS] = diff.cpu()
        return out

    def _loss(self, micro: TrainBatch, sft: bool = False
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """The role's objective on one micro-batch (aggregated over it with self.loss_agg), its metrics and the
        policy's logprobs it was computed from (None for a critic); sft: the NLL of the response tokens under the
        model's own (temperature 1) distribution."""
        if sft:
            logprobs, entropy = self._forward(self.lm, micro, True, 1.0)
            return *algorithms.sft_loss(logprobs, micro["loss_mask"], "token_mean", entropy=entropy.detach()), None
        if self.role == "critic":
            loss, metrics = algorithms.value_loss(
                self._forward(self.lm, micro, False)[0], micro["old_values"], micro["returns"], micro["loss_mask"],
                clip_range=self.value_clip, loss_agg=self.loss_agg,
            )
            return loss, metrics | {"value_loss": loss.detach()}, None
        topk = None
        if TEACHER_TOPK_IDS in micro:  # distill.loss forward_kl / jsd: the student's logprobs of the teacher's top k
            logprobs, entropy, topk = self._forward_with_topk(micro)
        else:
            logprobs, entropy = self._forward(self.lm, micro, True)  # entropy is logged even when not in the loss
        return *algorithms.rl_loss(
            logprobs, micro["old_logprobs"], micro["advantages"], micro["loss_mask"], norm_len=self.norm_len,
            ref_logprobs=micro.get("ref_logprobs"), rollout_logprobs=micro.get("rollout_logprobs"),
            is_weights=micro.get("is_weights"), teacher_logprobs=micro.get(TEACHER_LOGPROBS),
            student_topk_logprobs=topk, teacher_topk_logprobs=micro.get(TEACHER_TOPK_LOGPROBS),
            entropy=entropy if self.algo.entropy_coef else entropy.detach(), **self.loss_kwargs,
        ), logprobs

    # ---- weights: what a sync sends -----------------------------------------------------------------
    def named_tensors(self, names: list[str] | None = None, dtype: torch.dtype | None = None,
                      device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
        """HF-named full weights (all, or the named ones; in `dtype` if given) on `device` at rank 0, [] on other
        ranks: what weight sync sends to rollout engines. Collective (each weight is gathered from its shards in
        turn)."""
        self._resident("named_tensors")
        params = dict(self.model.named_parameters())
        source = self._sent_source()
        names = names or list(source)
        unknown = [n for n in names if n not in source]
        if unknown:
            raise KeyError(f"named_tensors: not a weight of this model: {unknown[:5]}")
        return self._gather_sent(params, names, dtype, device)

    def _gather_sent(self, params: dict[str, torch.nn.Parameter], names: list[str], dtype: torch.dtype | None,
                     device: torch.device | str, every_rank: bool = False) -> list[tuple[str, torch.Tensor]]:
        """Gather the module parameters the sent `names` come from (collective) and cut them into those names,
        at rank 0 (`every_rank`: at every rank, [] elsewhere). A stacked MoE parameter is cut into many sent
        tensors, which a sync asks for over several buckets: the last one gathered is kept for the next call
        (every rank decides alike: gathering is collective) until the weights change or move
        (`_forget_gathered`)."""
        source, pieces = self._sent_source(), self._pieces()
        modules = list(dict.fromkeys(source[n] for n in names))
        key = (str(dtype), str(device), every_rank)
        keep = every_rank or self.rank == 0
        kept = self._stacked if self._stacked is not None and self._stacked[0] == key else None
        todo = [m for m in modules if kept is None or m != kept[1]]
        gathered = dict(fsdp.gather(params, todo, keep=keep, dtype=dtype, device=device))
        if kept is not None and kept[1] in modules:
            gathered[kept[1]] = kept[2]
        stacked = [m for m in modules if pieces[m] > 1]
        if stacked:
            self._stacked = key, stacked[-1], gathered.get(stacked[-1])
        if not keep:
            return []
        sent = self._sent_names(gathered)
        # an expert's slice is copied out: a view would carry its whole stacked tensor wherever it is pickled
        return [(n, sent[n].clone() if pieces[source[n]] > 1 else sent[n]) for n in names]

    def _forget_gathered(self) -> None:
        """The weights change (a step, a load) or leave the GPU (offload): drop the kept stacked parameter."""
        self._stacked = None

    def _sent_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` by module name under the names a weight sync sends: the checkpoint's (stacked MoE experts
        as per-expert views, what SGLang and the Megatron backend use); other models' names unchanged."""
        return checkpoint_named(tensors, self.model.config.model_type)

    def _synced_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The module parameters a weight sync sends: all, but a frozen vision tower's (train.freeze_vision: the
        rollout engine loaded the same weights and they never change)."""
        return {n: p for n, p in self.model.named_parameters()
                if not (self.freeze_vision and n.startswith(VISION_PREFIX))}

    def _sent_source(self) -> dict[str, str]:
        """Sent name -> the module parameter it comes from (built once: the shapes do not change)."""
        if self._source is None:
            self._source = {sent: name for name, p in self._synced_parameters().items()
                            for sent in self._sent_names({name: torch.empty(p.shape, device="meta")})}
        return self._source

    def _pieces(self) -> Counter[str]:
        """How many sent tensors each module parameter is cut into (stacked MoE experts: several)."""
        return Counter(self._sent_source().values())

    def _whole_parameters(self, transport: str) -> dict[str, torch.Tensor]:
        """The parameters themselves, for the GPU transports that read them in place: one unsharded rank."""
        self._resident(f"weight sync ({transport})")
        if self.world_size > 1 or self.cfg.cpu_offload:
            raise ValueError(f"weight_sync.transport {transport}: reads whole parameters on the GPU; with "
                             "train.num_workers > 1 or train.cpu_offload they are sharded or on the host "
                             "(use 'distributed')")
        return {n: fsdp.local(p) for n, p in self._synced_parameters().items()}

    def weight_layout(self) -> list[tuple[str, int]]:
        """(name, bytes) of every weight a sync sends, in order: lets the sync plan buckets without moving
        tensors."""
        return [(n, t.numel() * t.element_size()) for n, t in self._sent_shapes().items()]

    def weight_shapes(self) -> dict[str, list[int]]:
        return {n: list(t.shape) for n, t in self._sent_shapes().items()}

    def _sent_shapes(self) -> dict[str, torch.Tensor]:
        """Every sent weight as a meta tensor (its full shape and dtype, no memory); built once, as every sync
        checks against it."""
        if self._shapes is None:
            self._shapes = self._sent_names({n: torch.empty(p.shape, dtype=p.dtype, device="meta")
                                             for n, p in self._synced_parameters().items()})
        return self._shapes

    def _gather_into(self, targets: dict[str, torch.Tensor]) -> None:
        """Every sent weight into its tensor of `targets` (by sent name), cast to its dtype. Collective: every rank
        gathers in the same (the model's) order; MoE experts are gathered whole, then cut."""
        params, source = self._synced_parameters(), self._sent_source()
        sent_of: dict[str, list[str]] = {}
        for sent, module in source.items():
            sent_of.setdefault(module, []).append(sent)
        stacked = [m for m, sent in sent_of.items() if sent != [m]]
        fsdp.gather_into([(params[m], targets[m]) for m, sent in sent_of.items() if sent == [m]])
        for module in stacked:
            out = targets[sent_of[module][0]]
            gathered = dict(fsdp.gather(params, [module], keep=True, dtype=out.dtype, device=out.device))
            for n, t in self._sent_names(gathered).items():
                targets[n].copy_(t)

    # ---- weight sync: this worker's end of each transport ---------------------------------------------
    # Ray calls a worker's methods by name, so each transport's are here; each passes this backend's weights to its
    # transport's code in engines/sync/ (store.py, distributed.py, nccl.py, cuda_ipc.py), which does the work.
    def put_weights_to_store(
        self, storage: StorageConfig, run: str, version: int, index: int, names: list[str]
    ) -> None:
        """Gather these weights (collective) and write them from rank 0 as bucket `index` of `version`."""
        tensors = self.named_tensors(names)
        if self.rank == 0:
            put_bucket(storage, run, version, index, tensors)

    def put_weights_delta(self, storage: StorageConfig, run: str, version: int, index: int, names: list[str],
                          dtype: str, base: int | None, level: int) -> dict:
        """delta: gather these weights in `dtype` (collective); rank 0 writes their change since `base`."""
        tensors = self.named_tensors(names, dtype=torch_dtype(dtype))
        return self._delta.put(RunStore(storage, run), version, index, tensors, base, level) if self.rank == 0 else {}

    def delta_held(self, buckets: int) -> tuple[str, int] | None:
        return self._delta.held_version(buckets)

    def put_delta_snapshot(self, storage: StorageConfig, run: str, version: int, level: int) -> list[dict]:
        return self._delta.put_snapshot(RunStore(storage, run), version, level)

    def rendezvous_address(self) -> tuple[str, int]:
        """Where the group this worker serves as rank 0 meets (nccl, distributed)."""
        return free_rendezvous_address()

    def join_weights_update_group(self, master_address: str, master_port: int, world_size: int,
                                  group_name: str = GROUP_NAME, backend: str = "gloo") -> None:
        """distributed: rank 0 joins the weight-update group (serving its rendezvous); other ranks have none."""
        self._update_group.join(master_address, master_port, world_size, group_name, backend)

    def leave_weights_update_group(self) -> None:
        self._update_group.leave()

    def broadcast_weights_update(self, names: list[str], dtype: str) -> int:
        """distributed: every rank gathers these weights as `dtype`, rank 0 broadcasts them; its bytes sent."""
        return self._update_group.broadcast(self.named_tensors, names, dtype)

    def nccl_connect(self, host: str, port: int, world_size: int, rollout_precision: str) -> None:
        """nccl: join the weight-sync channel as its rank 0, sending in the rollout workers' precision."""
        self._nccl = NcclChannel(host, port, 0, world_size, sync_device(self.device))
        self._nccl_dtype = DTYPES[rollout_precision]

    def nccl_send(self, buckets: list[list[str]]) -> int:
        """Broadcast every bucket (rank 0 of the weight-sync group); returns bytes sent."""
        return self._nccl.send(self._sent_names(self._whole_parameters("nccl")), buckets, self._nccl_dtype)

    def cuda_ipc_handles(self) -> list[tuple[str, tuple]]:
        """Handles of this worker's parameters for its colocated rollout worker (shared once, copied each sync)."""
        return export_ipc_handles(list(self._whole_parameters("cuda_ipc").items()))

    def write_weights_ipc(self, handle: SharedWeights) -> int:
        """A sharded trainer's side of cuda_ipc: every rank gathers every weight straight into its colocated
        rollout worker's weights, mapped through `handle`; returns the bytes written, once they are there.
        Collective."""
        self._resident("weight sync (cuda_ipc)")
        return self._shared_weights.write(handle, sync_device(self.device), self._sent_shapes(), self._gather_into)

    def link_bandwidth(self, kind: str, nbytes: int) -> float:
        """GB/s of the link a GPU transport uses ('copy': bf16 -> bf16 on this GPU; 'cast_copy': fp32 -> bf16
        on this GPU; 'nccl': the weight-sync group; 'all_gather': an all-gather over the train ranks, output bytes
        per second per rank, what cuda_ipc over several ranks does for each weight; collective)."""
        if kind == "nccl":
            return self._nccl.measure_bandwidth(nbytes)
        if kind == "all_gather":
            return all_gather_bandwidth(sync_device(self.device), nbytes)
        source = {"copy": torch.bfloat16, "cast_copy": torch.float32}[kind]
        return device_copy_bandwidth(sync_device(self.device), nbytes, source_dtype=source)

    @torch.no_grad()
    def weights_digest(self, dtype: str) -> float:
        """Sum of every weight cast to `dtype`: benchmarks check a GPU sync delivered the same weights.
        Collective."""
        self._resident("weights_digest")
        params = dict(self.model.named_parameters())
        return float(sum(t.to(DTYPES[dtype]).double().sum() for _, t in fsdp.gather(params, list(params), True)))

    # ---- checkpoints ---------------------------------------------------------------------------------
    def save(self, path: str | Path, storage: StorageConfig | None = None, background: bool = False) -> None:
        """Sharded model and optimizer state (engines/train/fsdp.py: safetensors, the model also consolidated
        into an HF checkpoint in `model/`), schedule and RNG state as JSON (no pickle). Collective.

        With `storage`, `path` is a folder of that run store (a checkpoint's URI, s3:// too) and every rank
        writes its shards there itself, through fsspec; without it, a local folder. `background`
        (checkpoint.async_save; not for LoRA): return once the state is copied to host memory, and write it from
        a thread that leaves a `written_rank<r>.json` marker in `path` when done (fsdp.BackgroundSave)."""
        self.wait_saved(raise_error=False)  # one write at a time; a failed one was reported by its marker
        self._resident("save", optimizer=True)
        state = json.dumps({"scheduler": self.scheduler.state_dict() | {"lr_lambdas": None}, "rng": rng_state()})
        own = f"trainer_rank{self.rank}.json"
        adapters_only = self.lora is not None
        if background and adapters_only:
            raise ValueError("save(background=True): a LoRA run's checkpoints are saved synchronously")
        store = RunStore.at(storage, str(path)) if storage is not None else None
        if store is not None:
            store.write_bytes(state.encode(), own)
        else:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            (path / own).write_text(state)
        if background:
            if self._save_group is None:
                self._save_group = fsdp.background_save_group(self._collective_timeout_s)
            self._writing = fsdp.save_checkpoint_in_background(self.model, self.optimizer, store or path,
                                                               self._save_group)
            return
        if store is not None:
            fsdp.save_checkpoint_to_store(self.model, self.optimizer, store, adapters_only)
        else:
            fsdp.save_checkpoint(self.model, self.optimizer, path, adapters_only)
        if adapters_only:
            self._export_lora(path, storage)

    def wait_saved(self, raise_error: bool = True) -> None:
        """Wait for this rank's background checkpoint write, if one runs; raise if it failed (`raise_error`)."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.thread.join()
            if raise_error:
                writing.wait()

    def save_state(self) -> str:
        """This rank's background checkpoint write: 'none' (no write since the last wait), 'writing', 'written',
        or 'failed: <error>'; what the driver asks while it waits for a marker (a dead writer leaves none)."""
        return "none" if self._writing is None else self._writing.state()

    def _export_lora(self, path: str | Path, storage: StorageConfig | None) -> None:
        """A LoRA checkpoint's exports beside its sharded state: `adapter/` (PEFT's format, what SGLang, vLLM
        and peft load) and `model/` (the base with the adapter merged: an HF checkpoint like a full run's, for
        evaluation and serving). Collective (the adapter is gathered); rank 0 writes."""
        with tempfile.TemporaryDirectory(prefix="rlflow-lora-export-") as tmp:
            adapter = Path(path) / "adapter" if storage is None else Path(tmp) / "adapter"
            self.save_adapter(str(adapter))
            if self.rank != 0:
                return
            merged = Path(path) / "model" if storage is None else Path(tmp) / "model"
            shutil.rmtree(merged, ignore_errors=True)
            lora.merge_into_checkpoint(Path(self.model_path), adapter, merged)
            if storage is not None:
                store = RunStore.at(storage, str(path))
                for folder in (adapter, merged):
                    store.remove(folder.name)
                    for f in sorted(folder.iterdir()):
                        store.upload_file(f, folder.name, f.name)

    def save_adapter(self, path: str) -> int:
        """The LoRA adapter as a PEFT folder at the local `path`: the adapter weight sync's payload and a
        checkpoint's adapter/. Collective (each rank gathers its shards of the adapters); rank 0 writes and
        returns the bytes, the others 0."""
        if self.lora is None:
            raise ValueError("save_adapter: this worker trains every weight (train.lora is empty)")
        self._resident("save_adapter")
        params = dict(self.model.named_parameters())
        tensors = dict(fsdp.gather(params, [n for n in params if lora.is_adapter(n)], keep=self.rank == 0))
        if self.rank != 0:
            return 0
        return lora.write_adapter(Path(path), tensors, self.lora, self.model_path)

    def load(self, path: str | Path, storage: StorageConfig | None = None) -> None:
        """Resume from save(), written by any number of ranks (with `storage`: read straight from that run
        store's folder `path`). A rank the checkpoint had no rank of keeps its own RNG (the train step draws
        no random numbers) and takes rank 0's schedule (the same on every rank)."""
        self.wait_saved(raise_error=False)
        self._resident("load", optimizer=True)
        self._forget_gathered()
        own = f"trainer_rank{self.rank}.json"
        adapters_only = self.lora is not None
        if storage is not None:
            store = RunStore.at(storage, str(path))
            fsdp.load_checkpoint_from_store(self.model, self.optimizer, store, adapters_only)
            state = json.loads(store.read_bytes(own if store.exists(own) else "trainer_rank0.json"))
            self._restore_trainer_state(state, store.exists(own), store.uri(own))
            return
        path = Path(path)
        if (path / "optimizer.safetensors").is_file():
            raise ValueError(f"checkpoint {path}: written before the FSDP2 backend (optimizer.safetensors, one full "
                             "copy); this backend reads sharded optimizer/ state. Its model/ is a Hugging Face "
                             "checkpoint: start a new run from it with model.path")
        fsdp.load_checkpoint(self.model, self.optimizer, path, adapters_only)
        state = json.loads(((path / own) if (path / own).is_file() else path / "trainer_rank0.json").read_text())
        self._restore_trainer_state(state, (path / own).is_file(), path / own)

    def _restore_trainer_state(self, state: dict, own: bool, source: str | Path) -> None:
        """The schedule at the saved step and, from this rank's own file, its RNG."""
        sched = state["scheduler"]
        sched.pop("lr_lambdas", None)
        self.scheduler.load_state_dict(sched | {"lr_lambdas": [None]})
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # the schedule's rate at the saved step, not the rate at step 0
        if own:
            restore_rng(state, source)

    # ---- colocated offload --------------------------------------------------------------------------
    @torch.no_grad()
    def offload(self, keep_weights: bool = False) -> dict[str, float]:
        """Park the optimizer state and, unless `keep_weights`, the weights (the reference model's too) in host
        memory, drop the gradients, and give the GPU memory back (engines/train/offload.py). The gradients are
        the last step's: the next step zeroes them before it accumulates, so dropping them loses nothing. Only
        state on the run's device moves (train.cpu_offload keeps it on the host already). Idempotent."""
        t0 = time.perf_counter()
        self._forget_gathered()
        self.optimizer.zero_grad(set_to_none=True)
        lms = [lm for lm in (self.lm, self.ref_lm) if lm is not None]
        for lm in lms:
            fsdp.reshard(lm)  # the sharded parameters are the registered ones, no gathered copy is kept
        moved = 0
        if not self._parked_optimizer.parked:
            state = [fsdp.local(v) for st in self.optimizer.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor)]
            moved += self._parked_optimizer.park(state, self.device)
        if not keep_weights and not self._parked_weights.parked:
            moved += self._parked_weights.park([fsdp.local(p) for lm in lms for p in lm.parameters()], self.device)
        return memory_moved(self.device, moved, t0)

    def onload(self) -> dict[str, float]:
        """Bring back what offload parked, byte for byte, into the same tensors."""
        t0 = time.perf_counter()
        moved = self._parked_weights.unpark() + self._parked_optimizer.unpark()
        return memory_moved(self.device, moved, t0)

    def _resident(self, what: str, optimizer: bool = False) -> None:
        """Refuse to run `what` on parked state (its memory is freed: it would read garbage or crash)."""
        if self._parked_weights.parked or (optimizer and self._parked_optimizer.parked):
            raise RuntimeError(f"train worker {self.rank}: {what} while its state is offloaded to host memory "
                               "(train.offload_during_rollout); the session calls onload() first")

    def data_parallel_rank(self) -> int:
        """Which shard of the data this worker trains on: every worker is a data-parallel copy, but for the ranks
        of one context-parallel group, which share one (the mesh's "dp" coordinate)."""
        return self.rank // self.cp

    def pid(self) -> int:
        """This worker's process id (fault-injection drills kill it)."""
        return os.getpid()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


DIFF_STATS = "logprob_diff_stats"  # _optimizer_step's key for its algorithms.logprob_diff vector


def _padding_row(batch: TrainBatch) -> TrainBatch:
    """One row to run where a rank has no micro-batch left: the batch's shortest, or (an empty shard) a
    one-token row of zeros. Its loss is weighted 0 and its outputs dropped."""
    lengths = batch["attention_mask"].sum(-1)
    if len(lengths):
        i = int(lengths.argmin())
        return {k: v[i:i + 1, :max(int(lengths[i]), 1)] if v.dim() >= 2 and k not in ROW_COLUMNS else v[i:i + 1]
                for k, v in batch.items()}
    row = {k: torch.zeros((1, 1, *v.shape[2:]) if v.dim() >= 2 else (1,), dtype=v.dtype) for k, v in batch.items()}
    row["attention_mask"][0, 0] = 1
    return row


def with_train_logprobs(batch: TrainBatch, train_logprobs: torch.Tensor) -> TrainBatch:
    """The batch for decoupled PPO: the train engine's logprobs become PPO's old policy, the rollout's the IS one.

    Three policies take part in a step with importance-sampling correction (as slime and verl structure it):
    the rollout engine's policy sampled the tokens (`rollout_logprobs`, from pack_samples' old_logprobs); the
    train engine's logprobs of the same, not yet updated, weights are the proximal policy PPO's ratio and clip
    are taken against (`old_logprobs`, recomputed once per step, before the first update); and the policy being
    trained. Their difference is numerical (kernels, precision, batch shapes), and only the IS weight
    p_train_old / p_rollout sees it, truncated (TIS) or masked (IcePop), instead of leaking into PPO's clip.
    Without correction the rollout logprobs stay PPO's old policy and no extra forward pass is made.
    """
    return {**batch, "rollout_logprobs": batch["old_logprobs"], "old_logprobs": train_logprobs}

