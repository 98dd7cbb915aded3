"""The Megatron-core train backend: TP x PP x DP ranks behind the interface of TorchTrainBackend.

One instance per rank of the train worker group. Weights come from and go to Hugging Face names (megatron/weights.py);
losses come from core/algorithms.py. Every micro-batch's loss is scaled by its share of the mini-batch's
global token (or sequence) count (algorithms.micro_batch_scales; token_sum adds up unscaled) and megatron sums
gradients over data-parallel ranks, so any layout takes the optimizer step one worker takes on the whole mini-batch.
Weight export and checkpoints are collective: every rank of the group calls them (rlflow.engines.session.rl does).

bf16 means bf16 weights and activations (megatron's Float16Module) with fp32 master weights and gradients in
the optimizer; fp32 means fp32 throughout. CPU runs (tests, debugging) go through rlflow.engines.train.megatron.cpu.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import megatron.core
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from transformers import AutoConfig

from rlflow.engines.core import algorithms
from rlflow.engines.core.batch import ROUTED_EXPERTS, TEACHER_LOGPROBS, TrainBatch, batch_size, select
from rlflow.engines.core.config import AlgorithmConfig, DistillConfig, MegatronConfig, StorageConfig, TrainConfig
from rlflow.engines.core.protocols import TrainBackend
from rlflow.engines.models.hf import DTYPES
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.base import free_rendezvous_address
from rlflow.engines.sync.delta import DeltaSender
from rlflow.engines.sync.delta_format import DeltaPublisher, torch_dtype
from rlflow.engines.sync.distributed import GROUP_NAME, DistributedSender, DistributedWeightSender
from rlflow.engines.sync.store import StoreSender, put_bucket
from rlflow.engines.train.megatron.checkpoint import set_tracker_rng_state, tracker_rng_state
from rlflow.engines.train.megatron.cpu import device_context
from rlflow.engines.train.megatron.export import WeightExporter
from rlflow.engines.train.megatron.fused_kernels import fuse_adam
from rlflow.engines.train.megatron.hf_config import spec_from_hf
from rlflow.engines.train.megatron.logprobs import token_logprobs
from rlflow.engines.train.megatron.microbatch import Micro, filler, gather_rows, plan_micro_batches
from rlflow.engines.train.megatron.model_build import (
    build_model,
    compile_decoder_layers,
    init_parallel,
    load_hf_weights,
    stage_params,
    stage_rules,
    transformer_config,
    use_transformer_engine,
)
from rlflow.engines.train.megatron.optimizer_shards import load_optimizer, save_optimizer
from rlflow.engines.train.megatron.routing import MegatronRouting
from rlflow.engines.train.megatron.shards import load_shards, save_shards
from rlflow.engines.train.megatron.weights import check_moe_tensor_parallel
from rlflow.engines.train.offload import HostParking, memory_moved
from rlflow.engines.train.rng import restore_rng, rng_state
from rlflow.engines.train.torch_backend import lr_lambda, with_train_logprobs

SFT_METRICS = ("entropy", "loss")  # what algorithms.sft_loss reports when given the entropy


def _on_device(method):
    """Run a public method inside the device context (the CPU shim on CPU)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with device_context(self.device):
            return method(self, *args, **kwargs)

    return run


class MegatronTrainBackend(TrainBackend, StoreSender, DistributedSender, DeltaSender):
    def __init__(
        self,
        model_path: str,
        train: TrainConfig,
        algorithm: AlgorithmConfig,
        megatron: MegatronConfig | None = None,
        *,
        temperature: float = 1.0,
        norm_len: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        dist_url: str | None = None,
        seed: int = 0,
        collective_timeout_s: float = 1800,
        distill: DistillConfig | None = None,
    ):
        torch.set_num_threads(train.threads)
        # rl_loss's arguments: the algorithm's and, when distilling, the teacher term's (the torch backend's too)
        self.loss_kwargs = algorithm.loss_kwargs() | (distill.loss_kwargs() if distill is not None else {})
        self._collective_timeout_s = collective_timeout_s
        self.cfg, self.algo, self.mcfg = train, algorithm, megatron or MegatronConfig()
        self.temperature, self.norm_len = temperature, norm_len
        self.rank, self.world_size, self.device = rank, world_size, train.device
        self.model_path = model_path
        self._sft = False  # inside sft_step: the loss is algorithms.sft_loss
        self._diff: torch.Tensor | None = None  # while measuring: algorithms.logprob_diff of the losses so far
        self._update_group = DistributedWeightSender(rank)  # this rank's end of the `distributed` transport
        self._delta = DeltaPublisher()  # rank 0's copy of the last version the delta transport published
        with device_context(self.device):
            self._build(dist_url, seed)

    def _build(self, dist_url: str | None, seed: int) -> None:
        """Process groups, model (from the HF weights), DDP wrapper, optimizer, and the reference model."""
        rank, world_size, train, algorithm = self.rank, self.world_size, self.cfg, self.algo
        init_parallel(rank, world_size, dist_url, self.mcfg, self.device, seed, self._collective_timeout_s)
        torch.manual_seed(seed + rank)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.spec = spec_from_hf(self.hf_config)
        self.dtype = DTYPES[train.precision]
        self.use_te = use_transformer_engine(self.mcfg, self.device)
        if train.compile and self.use_te:
            raise ValueError("train.compile compiles the local layer spec's decoder layers; Transformer Engine's "
                             "are fused kernels already (megatron.transformer_engine: false to compile instead)")
        replay = algorithm.routing_replay != "off"
        if replay and not self.spec.num_experts:
            raise ValueError(f"algorithm.routing_replay {algorithm.routing_replay}: the model at {self.model_path} "
                             "has no MoE layers; routing replay applies to mixtures of experts")
        self.tf_config = transformer_config(self.spec, self.mcfg, self.dtype, self.device, self.use_te,
                                            compiled=train.compile, routing_replay=replay)
        check_moe_tensor_parallel(self.spec, self.mcfg.tensor_parallel, self.use_te, self.tf_config.sequence_parallel)
        self.pp = self.mcfg.pipeline_parallel
        self.tp = self.mcfg.tensor_parallel
        self.core = self._load_core()
        # the policy's routers: what they replay (ROUTED_EXPERTS) or record (r2); the reference model routes live
        self.routing = MegatronRouting(self.core, self.spec.moe_top_k) if replay else None
        self._recording = False
        ddp_config = DistributedDataParallelConfig(**({
            "grad_reduce_in_fp32": True, "overlap_grad_reduce": False,
            "use_distributed_optimizer": self.mcfg.use_distributed_optimizer} | self.mcfg.ddp))
        self.model = DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=self._wrap(self.core))
        self.exporter = WeightExporter(self.spec, stage_params(self.core), fused_norms=self.use_te)
        self.tf_config.no_sync_func = self.model.no_sync
        # the losses are already normalised globally: finalize must not divide by a token count
        self.tf_config.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: finalize_model_grads(
            chunks, None, **kw)
        b1, b2 = train.betas
        self.optimizer = get_megatron_optimizer(OptimizerConfig(**({
            "optimizer": "adam", "lr": train.lr, "weight_decay": train.weight_decay, "adam_beta1": b1,
            "adam_beta2": b2, "adam_eps": 1e-8, "clip_grad": train.grad_clip, "bf16": self.dtype == torch.bfloat16,
            "params_dtype": self.dtype, "use_distributed_optimizer": self.mcfg.use_distributed_optimizer,
        } | self.mcfg.optimizer)), [self.model])
        if self.mcfg.torch_fused_kernels:
            fuse_adam(self.optimizer)
        self.schedule = lr_lambda(train)
        self.updates = 0  # optimizer steps taken: the LR schedule's clock
        # colocated: what offload() parked in host memory while the rollout engine has the GPU
        self._parked_weights, self._parked_optimizer, self._grads_freed = HostParking(), HostParking(), False
        self.ref_model = None
        if algorithm.kl_coef > 0:  # frozen copy of the starting policy, for the KL penalty
            self.ref_model = self._wrap(self._load_core()).eval()
            self.ref_model.requires_grad_(False)
        # the metric names rl_loss reports for this algorithm (every rank must reduce the same vector)
        self.metric_keys = sorted(self._rl_loss(*[torch.zeros(1, 1)] * 4, ref=torch.zeros(1, 1),
                                                entropy=torch.zeros(1, 1),
                                                rollout=torch.zeros(1, 1) if algorithm.corrects_rollout else None,
                                                teacher=torch.zeros(1, 1))[1])

    def _load_core(self) -> torch.nn.Module:
        core = build_model(self.spec, self.tf_config, self.use_te, self.mcfg.attention)
        load_hf_weights(core, self.spec, self.model_path, fused_norms=self.use_te)
        if self.cfg.compile:
            compile_decoder_layers(core)
        return core

    def _wrap(self, core: torch.nn.Module) -> torch.nn.Module:
        return Float16Module(self.tf_config, core) if self.dtype == torch.bfloat16 else core

    # ---- layout --------------------------------------------------------------------------------------
    def data_parallel_rank(self) -> int:
        """Which shard of the data this rank trains on (ranks of one TP x PP group share it)."""
        return parallel_state.get_data_parallel_rank()

    def _dp_size(self) -> int:
        return parallel_state.get_data_parallel_world_size()

    def _dp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._dp_size() > 1:
            dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return t

    def _to_last_stage_value(self, t: torch.Tensor) -> torch.Tensor:
        """Every pipeline stage gets the last stage's value of t (earlier stages pass zeros)."""
        if self.pp > 1:
            dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
        return t

    # ---- forward -------------------------------------------------------------------------------------
    def _dev(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self.device == "cuda" else "cpu"

    def _run(self, model: torch.nn.Module, micro: Micro) -> torch.Tensor:
        """Logits [B, L, V/tp] on the last stage, hidden states on earlier ones. Packed: one stream [1, T] in
        megatron's THD layout (positions restart per sample, attention stays within each); padded: right-padded
        rows under a causal mask."""
        pad = -len(micro.packed.input_ids) % self._multiple() if micro.packed is not None else 0
        if self.routing is not None and model is self.model:
            self.routing.before_forward(micro, pad, record=self._recording)
        if micro.packed is not None:
            p = micro.packed
            ids, pos, cu, cu_host = p.input_ids, p.position_ids, p.cu_seqlens, micro.cu_seqlens_host
            # sequence parallelism splits the stream: a dummy sample fills it (`pad` tokens)
            if pad:
                ids, pos = F.pad(ids, (0, pad)), F.pad(pos, (0, pad))
                cu, cu_host = torch.cat([cu, cu[-1:] + pad]), torch.cat([cu_host, cu_host[-1:] + pad])
            longest = max(p.max_len, pad)
            # megatron's THD rotary reads the "padded" boundaries when given and splits q and k per sample with
            # .tolist(): on the host they cost no device sync (2 per layer otherwise, which left the GPU idle);
            # the attention reads cu_seqlens_q, on the device
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                     max_seqlen_kv=longest, cu_seqlens_q_padded=cu_host, cu_seqlens_kv_padded=cu_host)
            return model(ids[None], pos[None], None, packed_seq_params=params, **self._output_kwargs())
        ids = micro.batch["input_ids"].to(self._dev())
        width = ids.shape[1]
        pos = torch.arange(width, device=ids.device).unsqueeze(0).expand_as(ids)
        # True = masked out; given explicitly (megatron's default causal mask is built on "cuda")
        mask = torch.ones(width, width, dtype=torch.bool, device=ids.device).triu(1).view(1, 1, width, width)
        return model(ids, pos, mask, **self._output_kwargs())

    def _output_kwargs(self) -> dict:
        """bf16: the logits stay in bf16 (Float16Module casts its outputs to fp32 unless told not to: a [tokens,
        vocab] fp32 copy, 10 GB at 16,384 tokens of Qwen2's vocabulary, and its gradient). Each chunk's log-softmax
        still runs in fp32 (engines/models/head_math.py, logprobs._fp32)."""
        return {"fp32_output": False} if self.dtype == torch.bfloat16 else {}

    def _token_logprobs(self, logits: torch.Tensor, micro: Micro, temperature: float, entropy: str
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """token_logprobs of the micro-batch's rows, [rows, width] right-padded whatever layout ran."""
        if micro.packed is None:
            return token_logprobs(logits, micro.batch["input_ids"], temperature, entropy,
                                  self.cfg.logprob_chunk_tokens, self.cfg.fused_head)
        p = micro.packed
        n = len(p.input_ids)  # the stream's own tokens (a sequence-parallel pad follows them)
        logp, ent = token_logprobs(logits[:, :n], p.input_ids[None], temperature, entropy,
                                   self.cfg.logprob_chunk_tokens, self.cfg.fused_head)
        first = torch.zeros(n, dtype=torch.bool, device=logp.device)
        first[p.cu_seqlens[:-1].long()] = True  # a sample's first token has no logprob (it read the previous one)

        def rows(x: torch.Tensor) -> torch.Tensor:
            return p.unpack(torch.where(first, torch.zeros_like(x[0]), x[0]))

        return rows(logp), rows(ent) if ent is not None else None

    def _multiple(self) -> int:
        return self.tp if self.tf_config.sequence_parallel else 1

    def _micro(self, batch: TrainBatch) -> list[Micro]:
        """The batch's micro-batches; with expert parallelism as many on every data-parallel rank as the most any
        has (filler ones on the others): each micro-batch's MoE layers exchange tokens across those ranks, and a
        rank that ran out of micro-batches would leave its peers waiting in that exchange for ever."""
        micro = plan_micro_batches(batch, self.cfg.micro_batch_size, self.mcfg.micro_batch_tokens,
                                   self.mcfg.packing, self._multiple())
        if self.mcfg.expert_parallel > 1:
            most = torch.tensor([len(micro)], device=self._dev())
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
            micro += [filler(micro[0] if micro else None, batch, self.mcfg.packing, self._multiple())
                      for _ in range(int(most) - len(micro))]
        return micro

    def _on_dev(self, micro: list[Micro]) -> list[Micro]:
        """All micro-batches to the device at once: a copy per micro-batch would wait for the GPU each time."""
        return [m.to(self._dev()) for m in micro]

    @_on_device
    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs [N, L] (aligned with input_ids) of `batch` under the policy or the reference model.
        Collective over the ranks of a TP x PP group, which must pass the same batch."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("forward_logprobs(reference=True) needs algorithm.kl_coef > 0")
        self._resident("forward_logprobs")
        model.eval()
        micro, width = self._on_dev(self._micro(batch)), batch["input_ids"].shape[1]
        if self.pp == 1:
            parts = [(m.rows, self._token_logprobs(self._run(model, m), m, self.temperature, "none")[0])
                     for m in micro]
        else:
            parts = self._pipeline(model, micro, forward_only=True)
        parts = [part for part in parts if part[0]]  # filler micro-batches hold no rows
        out = gather_rows(parts, batch_size(batch), width, self._dev())  # zeros off the last pipeline stage
        return self._to_last_stage_value(out).cpu()

    @_on_device
    @torch.no_grad()
    def record_routing(self, batch: TrainBatch) -> torch.Tensor:
        """The policy's own expert choice for every token of the batch, as a ROUTED_EXPERTS column [N, L,
        layers x k] (routing replay r2: recorded before the update, replayed in its training forwards)."""
        if self.routing is None:
            raise ValueError("record_routing: needs algorithm.routing_replay r2 or r3 on an MoE model")
        self._resident("record_routing")
        self.model.eval()
        n, width = batch["input_ids"].shape
        out = torch.zeros(n, width, self.routing.width, dtype=torch.int16)
        self._recording = True
        try:
            for m in self._on_dev(self._micro({k: v for k, v in batch.items() if k != ROUTED_EXPERTS})):
                self._run(self.model, m)
                if m.rows:
                    rows = self.routing.recorded(m).cpu()
                    w = min(rows.shape[1], width)
                    out[torch.tensor(m.rows)[:, None], torch.arange(w)] = rows[:, :w]
        finally:
            self._recording = False
        return out

    def _pipeline(self, model: torch.nn.Module, micro: list[Micro], forward_only: bool) -> list:
        """megatron's pipeline schedule over `micro` (stages exchange shapes: variable_seq_lengths); returns what
        the loss function reported, per micro-batch, on the last stage ([] elsewhere)."""

        def step(data_iterator, chunk):
            m = next(data_iterator)
            return self._run(chunk, m), functools.partial(self._pipeline_loss, m)

        packed = micro[0].packed is not None
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(micro), model=[model], num_microbatches=len(micro),
            seq_length=max(len(m.packed.input_ids) if packed else m.batch["input_ids"].shape[1] for m in micro),
            micro_batch_size=1 if packed else max(batch_size(m.batch) for m in micro),
            forward_only=forward_only, collect_non_loss_data=forward_only,
        )

    def _pipeline_loss(self, micro: Micro, output: torch.Tensor, non_loss_data: bool = False):
        if non_loss_data:  # forward only: the logprobs themselves, with the rows they belong to
            return micro.rows, self._token_logprobs(output, micro, self.temperature, "none")[0]
        loss, vec = self._loss(micro, output)
        return loss, micro.batch["loss_mask"].sum().int().to(output.device), {"metrics": vec}

    # ---- training ------------------------------------------------------------------------------------
    def _rl_loss(self, logprobs, old_logprobs, advantages, mask, *, ref, entropy, rollout=None, is_weights=None,
                 teacher=None):
        """The shared objective with exactly the torch backend's arguments (AlgorithmConfig.loss_kwargs,
        DistillConfig.loss_kwargs)."""
        return algorithms.rl_loss(
            logprobs, old_logprobs, advantages, mask, norm_len=self.norm_len, ref_logprobs=ref,
            rollout_logprobs=rollout, is_weights=is_weights, entropy=entropy, teacher_logprobs=teacher,
            **self.loss_kwargs,
        )

    def _keys(self) -> list[str]:
        """The metric names the current loss reports, in the order every rank reduces them."""
        return list(SFT_METRICS) if self._sft else self.metric_keys

    def _loss(self, micro: Micro, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this micro-batch's loss x its loss scale, its metrics weighted as algorithms.scale_metrics weighs them,
        as one float64 vector)."""
        dev = logits.device
        if not micro.rows:  # a filler micro-batch: no loss, but a backward through the experts' exchange
            return logits.sum() * 0.0, torch.zeros(len(self._keys()), dtype=torch.float64, device=dev)
        mb = {k: v.to(dev) for k, v in micro.batch.items()}
        if self._sft:  # the model's own distribution (temperature 1); entropy is only logged
            logprobs, entropy = self._token_logprobs(logits, micro, 1.0, "metric")
            loss, metrics = algorithms.sft_loss(logprobs, mb["loss_mask"], "token_mean", entropy=entropy)
        else:
            logprobs, entropy = self._token_logprobs(logits, micro, self.temperature,
                                                     "loss" if self.algo.entropy_coef else "metric")
            loss, metrics = self._rl_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb["loss_mask"],
                                          ref=mb.get("ref_logprobs"), entropy=entropy,
                                          rollout=mb.get("rollout_logprobs"), is_weights=mb.get("is_weights"),
                                          teacher=mb.get(TEACHER_LOGPROBS))
            if self._diff is not None:  # train_step's first optimizer step: the weights that sampled the batch
                part = algorithms.logprob_diff(logprobs, mb.get("rollout_logprobs", mb["old_logprobs"]),
                                               mb["loss_mask"])
                self._diff = algorithms.merge_logprob_diff(self._diff, part)
        scaled = algorithms.scale_metrics(metrics, mb["loss_scale"], mb["share"])
        vec = torch.stack([scaled[k] for k in self._keys()])
        return loss * mb["loss_scale"].float(), vec

    @_on_device
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL iteration on this rank's data-parallel shard: epochs x mini_batches optimizer steps.
        Returns global metrics (the same on every rank).

        Without `rollout_logprobs` in the batch (no rollout correction: the session never ran the train engine's
        own forward of the step), rollout_logprob_diff_max / _mean are measured on the first optimizer step's
        forward, the only one under the weights that sampled the batch (no extra forward; with mini_batches > 1
        the first mini-batch's tokens only), as TorchTrainBackend.train_step does."""
        measure = "rollout_logprobs" not in batch
        self._resident("train_step", optimizer=True)
        t0 = time.perf_counter()
        if self.ref_model is not None and self.algo.kl_in == "loss" and "ref_logprobs" not in batch:
            batch = {**batch, "ref_logprobs": self.forward_logprobs(batch, reference=True)}
        if self.algo.routing_replay == "r2" and ROUTED_EXPERTS not in batch:
            batch = {**batch, ROUTED_EXPERTS: self.record_routing(batch)}  # the pre-update policy's choice
        if self.algo.corrects_rollout and "rollout_logprobs" not in batch:
            batch = with_train_logprobs(batch, self.forward_logprobs(batch))
        self.model.train()
        per_mb = batch_size(batch) // self.cfg.mini_batches
        sums: dict[str, float] = {}
        updates = self.cfg.epochs * self.cfg.mini_batches
        measured: dict[str, float] = {}
        for epoch in range(self.cfg.epochs):
            for m in range(self.cfg.mini_batches):
                first = measure and epoch == 0 and m == 0
                self._diff = torch.zeros(3, dtype=torch.float64, device=self._dev()) if first else None
                try:
                    stats = self._optimizer_step(select(batch, slice(m * per_mb, (m + 1) * per_mb)))
                    if first:
                        measured = algorithms.logprob_diff_metrics(self._reduce_diff(self._diff))
                finally:
                    self._diff = None
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v / updates
        return sums | measured | {"worker_s": time.perf_counter() - t0}  # wall time, not a global metric

    def _reduce_diff(self, stats: torch.Tensor) -> torch.Tensor:
        """algorithms.logprob_diff's vector over the data-parallel ranks (max of the maxima, sums of the rest),
        then the last pipeline stage's (earlier stages computed no loss and hold zeros)."""
        peak, rest = stats[:1].to(self._dev()), stats[1:].to(self._dev())
        if self._dp_size() > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        return self._to_last_stage_value(torch.cat([peak, self._dp_all_reduce(rest)])).cpu()

    @_on_device
    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """One supervised optimizer step on this rank's data-parallel shard: algorithms.sft_loss (NLL of the
        loss-masked response tokens, token mean), the same as TorchTrainBackend.sft_step."""
        self._resident("sft_step", optimizer=True)
        t0 = time.perf_counter()
        self.model.train()
        self._sft = True
        try:
            stats = self._optimizer_step(batch)
        finally:
            self._sft = False
        return stats | {"worker_s": time.perf_counter() - t0}

    def _optimizer_step(self, mb: TrainBatch) -> dict[str, float]:
        mode, dev = "token_mean" if self._sft else self.algo.loss_agg, self._dev()
        total = self._dp_all_reduce(algorithms.aggregation_weight(mb["loss_mask"], mode).double().to(dev))
        micro = self._micro(mb)
        for part in micro:
            part.batch["loss_scale"], part.batch["share"] = algorithms.micro_batch_scales(
                part.batch["loss_mask"], total.cpu(), mode)
        micro = self._on_dev(micro)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.pp == 1:
            vec = torch.zeros(len(self._keys()), dtype=torch.float64, device=dev)
            for i, part in enumerate(micro):
                sync = contextlib.nullcontext() if i == len(micro) - 1 else self.model.no_sync()
                with sync:
                    loss, v = self._loss(part, self._run(self.model, part))
                    loss.backward()
                vec += v
            finalize_model_grads([self.model])
        else:
            reported = self._pipeline(self.model, micro, forward_only=False)
            vec = torch.zeros(len(self._keys()), dtype=torch.float64, device=dev)
            for r in reported:
                vec += r["metrics"]
        lr = self.cfg.lr * self.schedule(self.updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        _ok, grad_norm, _zeros = self.optimizer.step()
        self.updates += 1
        vec = self._to_last_stage_value(self._dp_all_reduce(vec))
        out = dict(zip(self._keys(), vec.tolist(), strict=True))
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["lr"] = lr
        return out

    # ---- weights and checkpoints ---------------------------------------------------------------------
    @_on_device
    def named_tensors(self, names: list[str] | None = None, dtype: torch.dtype | None = None,
                      device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
        """HF-named full weights (all, or the named ones; in `dtype` if given) on `device` at rank 0, [] on other
        ranks. Collective."""
        self._resident("named_tensors")
        return self.exporter.gather(names or self.exporter.names(), dtype, device)

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

    # the `distributed` transport: its code is engines/sync/distributed.py's, as for the torch backend
    def rendezvous_address(self) -> tuple[str, int]:
        return free_rendezvous_address()

    def join_weights_update_group(self, master_address: str, master_port: int, world_size: int,
                                  group_name: str = GROUP_NAME, backend: str = "gloo") -> None:
        self._update_group.join(master_address, master_port, world_size, group_name, backend)

    def leave_weights_update_group(self) -> None:
        self._update_group.leave()

    def broadcast_weights_update(self, names: list[str], dtype: str) -> int:
        return self._update_group.broadcast(self.named_tensors, names, dtype)

    def weight_layout(self) -> list[tuple[str, int]]:
        """(HF name, bytes) of every exported weight, in order: lets the sync plan buckets without moving tensors."""
        return self.exporter.layout()

    def weight_shapes(self) -> dict[str, list[int]]:
        return {n: list(s) for n, s in self.exporter.shapes.items()}

    def _layout_meta(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "tensor_parallel": self.tp, "pipeline_parallel": self.pp,
                "expert_parallel": self.mcfg.expert_parallel,
                "distributed_optimizer": self.mcfg.use_distributed_optimizer, "precision": self.cfg.precision,
                "megatron_core": megatron.core.__version__}

    def wait_saved(self, raise_error: bool = True) -> None:
        """Nothing to wait for: this backend's saves return when written."""

    def save_state(self) -> str:
        return "none"

    @_on_device
    def save(self, path: str | Path, storage: StorageConfig | None = None, background: bool = False) -> None:
        """The HF model (written by the ranks that own its tensors, never gathered on one rank), this rank's model
        shards, the optimizer state in HF space (engines/train/megatron/optimizer_shards.py), and schedule/RNG
        state: safetensors + JSON, loadable on any layout. Collective. Always synchronous: `background`
        (checkpoint.async_save) is refused by the recipe's validation for this backend.

        With `storage`, `path` is a folder of that run store (s3:// too): every rank writes its own files into a
        local scratch folder and uploads them itself (nothing is gathered; the driver commits the checkpoint
        after every rank returned); without it, a local folder."""
        if background:
            raise ValueError("checkpoint.async_save: the megatron backend saves synchronously")
        self._resident("save", optimizer=True)
        if storage is None:
            self._write_checkpoint(Path(path))
            return
        store = RunStore.at(storage, str(path))
        with tempfile.TemporaryDirectory(prefix=f"rlflow-megatron-rank{self.rank}-") as tmp:
            self._write_checkpoint(Path(tmp))  # this rank's files only: each rank has its own scratch folder
            for f in sorted(Path(tmp).rglob("*")):
                if f.is_file():
                    store.upload_file(f, *f.relative_to(tmp).parts)
        dist.barrier()

    def _write_checkpoint(self, path: Path) -> None:
        (path / "model").mkdir(parents=True, exist_ok=True)
        self.exporter.save_hf(path / "model")
        if self.rank == 0:
            self.hf_config.save_pretrained(path / "model")
        save_shards(self.core, path / "model_shards", self.rank)  # this rank's own slices: loads on any layout
        # the optimizer's fp32 main weights and moments in HF space: load on any layout too
        step = save_optimizer(self.optimizer, self.exporter, path / "optimizer", self.rank)
        state = {"layout": self._layout_meta(), "updates": self.updates, "adam_step": step,
                 "rng": rng_state() | ({"megatron_cuda": tracker_rng_state()} if self.device == "cuda" else {})}
        (path / f"trainer_rank{self.rank}.json").write_text(json.dumps(state))
        dist.barrier()  # the checkpoint is complete only when every rank has written its part

    @_on_device
    def load(self, path: str | Path, storage: StorageConfig | None = None, weights_only: bool = False) -> None:
        """Resume from save() (with `storage`: straight from that run store's folder `path`, each rank reading
        only its own files and the byte ranges of the model shards it needs), on any TP/PP/DP/EP layout: the
        weights from the per-rank model shards, the optimizer state from its HF-space tensors, the LR clock.
        The RNG state is per rank: restored on the saving layout only. `weights_only`: the weights alone (fresh
        optimizer, LR clock at 0)."""
        self._resident("load", optimizer=True)
        local = Path(path).resolve()
        store = RunStore.at(storage, str(path)) if storage is not None else RunStore(str(local.parent), local.name)
        first = json.loads(store.read_bytes("trainer_rank0.json"))
        if store.exists("model_shards"):
            load_shards(self.core, store, "model_shards")
        elif storage is None:  # written before model shards existed: the gathered HF model, fine on any layout
            load_hf_weights(self.core, self.spec, local / "model", fused_norms=self.use_te)
        else:
            raise FileNotFoundError(f"checkpoint {store.uri()}: no model_shards/ (the model's weights)")
        if weights_only:
            self.optimizer.reload_model_params()  # fp32 master copies (bf16, distributed optimizer) from weights
            return
        if "adam_step" not in first:
            raise ValueError(f"checkpoint {store.uri()}: its optimizer state is in the per-position format of "
                             "earlier versions, which only the saving layout could read; load(weights_only=True) "
                             "resumes its weights with a fresh optimizer")
        params = stage_params(self.core)
        load_optimizer(self.optimizer, stage_rules(self.spec, params, self.use_te), params, self.spec, store,
                       "optimizer", first["adam_step"], first["layout"]["world_size"])
        self.updates = first["updates"]
        if first["layout"] == self._layout_meta():
            own = f"trainer_rank{self.rank}.json"
            state = json.loads(store.read_bytes(own))
            restore_rng(state, store.uri(own))
            if self.device == "cuda":
                set_tracker_rng_state(state["rng"].get("megatron_cuda", {}))

    # ---- colocated offload --------------------------------------------------------------------------
    @_on_device
    @torch.no_grad()
    def offload(self, keep_weights: bool = False) -> dict[str, float]:
        """Park the optimizer's state (fp32 master weights and Adam moments) and, unless `keep_weights`, the
        model's parameter buffers (the reference model's too) in host memory (engines/train/offload.py), and
        free the gradient buffers (megatron zeroes them at the next step: nothing to keep). Idempotent."""
        t0 = time.perf_counter()
        weights = self._weight_tensors()
        if not self._grads_freed:
            self.optimizer.zero_grad()  # the master weights' gradients (views into, or copies of, the buffers)
            self.model.offload_grad_buffers(synchronize=True, empty_cache=False)  # storages resized to 0
            self._grads_freed = True
        moved = 0
        if not self._parked_optimizer.parked:
            # fp32 without a distributed optimizer steps the model's own parameters: those go with the weights
            own = {t.untyped_storage().data_ptr() for t in weights}
            state = [t for t in _optimizer_tensors(self.optimizer) if t.untyped_storage().data_ptr() not in own]
            moved += self._parked_optimizer.park(state, self.device)
        if not keep_weights and not self._parked_weights.parked:
            moved += self._parked_weights.park(weights, self.device)
        return memory_moved(self.device, moved, t0)

    @_on_device
    def onload(self) -> dict[str, float]:
        """Bring back what offload parked, byte for byte, into the same buffers; the gradient buffers anew."""
        t0 = time.perf_counter()
        moved = self._parked_weights.unpark() + self._parked_optimizer.unpark()
        if self._grads_freed:
            self.model.restore_grad_buffers(synchronize=True)  # zeroed
            self._grads_freed = False
        return memory_moved(self.device, moved, t0)

    def _weight_tensors(self) -> list[torch.Tensor]:
        models = [self.model] + ([self.ref_model] if self.ref_model is not None else [])
        return [p for m in models for p in m.parameters()]

    def _resident(self, what: str, optimizer: bool = False) -> None:
        """Refuse to run `what` on parked state (its memory is freed: it would read garbage or crash)."""
        if self._parked_weights.parked or (optimizer and (self._parked_optimizer.parked or self._grads_freed)):
            raise RuntimeError(f"train worker {self.rank}: {what} while its state is offloaded to host memory "
                               "(train.offload_during_rollout); the session calls onload() first")

    def pid(self) -> int:
        """This worker's process id (fault-injection drills kill it)."""
        return os.getpid()

    def num_parameters(self) -> int:
        """Parameters of the whole model (all stages, all TP shards)."""
        return sum(torch.Size(s).numel() for s in self.exporter.shapes.values())


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors a megatron optimizer (chained or not) steps and keeps: its inner torch optimizer's parameters
    (the fp32 master weights, or the model's own in fp32) and their state."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:  # a rank that holds no parameters of this chain
            continue
        out += [p for group in inner.param_groups for p in group["params"]]
        out += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out
