"""RLConfig, the root of a post-training run's tree, and the checks that span its sections."""

from __future__ import annotations

import warnings

from pydantic import Field, model_validator

from rlflow.engines.core.config.algorithm import GROUP_ESTIMATORS, AlgorithmConfig
from rlflow.engines.core.config.base import Name, Section
from rlflow.engines.core.config.checkpoint import CheckpointConfig
from rlflow.engines.core.config.cluster import ClusterConfig
from rlflow.engines.core.config.data import DataConfig
from rlflow.engines.core.config.debug import DebugConfig
from rlflow.engines.core.config.distill import DistillConfig
from rlflow.engines.core.config.evaluation import EvalConfig
from rlflow.engines.core.config.health import HealthConfig
from rlflow.engines.core.config.megatron import MegatronConfig
from rlflow.engines.core.config.model import ModelConfig
from rlflow.engines.core.config.orchestration import OrchestrationConfig
from rlflow.engines.core.config.reward import RewardConfig
from rlflow.engines.core.config.rollout import RolloutConfig
from rlflow.engines.core.config.sandbox import SandboxConfig
from rlflow.engines.core.config.sft import SFTConfig
from rlflow.engines.core.config.storage import StorageConfig
from rlflow.engines.core.config.tracking import TrackingConfig
from rlflow.engines.core.config.train import CriticConfig, TrainConfig
from rlflow.engines.core.config.weight_sync import WeightSyncConfig
from rlflow.engines.core.images import VL_MODEL_TYPES, model_type_of
from rlflow.engines.core.sglang_args import weight_update_ranks


class RLConfig(Section):
    """A whole post-training run."""

    name: Name = Field("run", description="Run name: its folder in the run store.")
    seed: int = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)

    @model_validator(mode="after")
    def _consistent(self) -> RLConfig:
        mp = self.megatron.model_parallel
        if self.train.backend == "megatron" and self.train.num_workers % mp:
            raise ValueError(f"train.num_workers ({self.train.num_workers}) must be a multiple of "
                             f"megatron.tensor_parallel x megatron.pipeline_parallel ({mp})")
        ep = self.megatron.expert_parallel
        if self.train.backend == "megatron" and (self.train.num_workers // mp) % ep:
            raise ValueError(f"megatron.expert_parallel ({ep}) must divide the data-parallel size, train.num_workers "
                             f"/ (tensor_parallel x pipeline_parallel) = {self.train.num_workers // mp}")
        if self.algorithm.advantage in GROUP_ESTIMATORS and self.rollout.samples_per_prompt < 2:
            raise ValueError(f"rollout.samples_per_prompt: algorithm.advantage {self.algorithm.advantage} compares "
                             "the samples of one prompt, and 1 sample per prompt gives every sample advantage 0 "
                             "(no policy gradient): sample 2 or more per prompt, or use advantage reinforce_pp "
                             "(batch baseline) or gae (a critic)")
        if self.algorithm.advantage == "passk" and self.algorithm.passk_k > self.rollout.samples_per_prompt:
            raise ValueError(f"algorithm.passk_k ({self.algorithm.passk_k}) must be at most "
                             f"rollout.samples_per_prompt ({self.rollout.samples_per_prompt}): pass@k draws k of a "
                             "prompt's samples")
        if self.algorithm.advantage == "remax":
            if self.rollout.temperature == 0:
                raise ValueError("algorithm.advantage: remax compares sampled responses with the greedy one; with "
                                 "rollout.temperature 0 they are the same (every advantage 0): sample at > 0")
            if self.rollout.dynamic_sampling.enabled:
                raise ValueError("algorithm.advantage: remax adds a greedy sample to every group; dynamic sampling "
                                 "(rollout.dynamic_sampling) does not generate it: use one or the other")
        if self.checkpoint.async_save and self.train.backend != "torch":
            raise ValueError("checkpoint.async_save: the torch backend writes checkpoints in the background; "
                             f"train.backend {self.train.backend} saves synchronously (set async_save false)")
        if self.checkpoint.async_save and self.train.lora is not None:
            raise ValueError("checkpoint.async_save: a LoRA run's checkpoints (the adapters) are small and saved "
                             "synchronously; set async_save false or leave train.lora out")
        batch = self.step_samples
        if batch % (self.data_parallel_size * self.train.mini_batches) != 0:
            raise ValueError(
                f"train: the step's samples, {self._step_samples_text} = {batch}, must divide evenly "
                f"into {self.data_parallel_size} data-parallel workers x train.mini_batches "
                f"({self.train.mini_batches})"
            )
        self._check_critic(batch)
        self._check_distill(batch)
        if self.rollout.max_staleness >= 2 and not self.algorithm.corrects_rollout:
            warnings.warn(
                f"rollout.max_staleness {self.rollout.max_staleness} with algorithm.is_correction 'none': samples up "
                "to that many updates old are clipped against a policy as old as they are, which holds updates "
                "back (the CPU demo reaches 0.947 instead of 0.965 in 100 steps at k = 2); set "
                "algorithm.is_correction: tis (decoupled PPO, docs/algorithms.md)", UserWarning, stacklevel=2)
        if self.rollout.max_staleness and not self.checkpoint.save_rollouts:
            raise ValueError(
                "checkpoint.save_rollouts: must be true with rollout.max_staleness > 0 (a resumed run needs the "
                "batches the last checkpoint's weights did not generate)"
            )
        if self.algorithm.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({self.algorithm.overlong_buffer}) must not exceed "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens})"
            )
        self._check_routing_replay()
        self._check_vision_language()
        self._check_expert_parallel()
        self._check_context_parallel()
        self._check_fp8_rollout()
        self._check_true_on_policy()
        self._check_placement()
        self._check_debug()
        self._check_sft()
        ds = self.rollout.dynamic_sampling
        if ds.partial_rollout and ds.enabled and self.rollout.fn != "rlflow.engines.rollout.functions:single_turn":
            raise ValueError("rollout.dynamic_sampling.partial_rollout: continues cut-short generations of the "
                             f"default rollout.fn only (rlflow.engines.rollout.functions:single_turn), "
                             f"not {self.rollout.fn!r}")
        if self.model.hidden_size % self.model.num_heads or self.model.num_heads % self.model.num_kv_heads:
            raise ValueError("model: hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        return self

    def _check_vision_language(self) -> None:
        """A vision-language model trains on the torch backend only: rlflow's Megatron path maps decoder-only LMs
        onto its local spec, and a vision tower (and M-RoPE) has no mapping there. The features below are not
        built for one yet (docs/multimodal.md, Limits): each is refused by name rather than run wrongly."""
        if not self.is_vision_language:
            return
        model = self.model.path or "(built: model.arch qwen2_vl)"
        if self.train.backend == "megatron":
            raise ValueError(f"train.backend megatron: model.path {model} is a vision-language model, and rlflow's "
                             "Megatron backend maps only decoder-only language models onto its local spec (the vision "
                             "tower has no mapping); use train.backend torch (docs/multimodal.md)")
        unsupported = [name for name, on in (
            ("train.lora", self.train.lora is not None),
            ("train.context_parallel", self.train.context_parallel > 1),
            ("rollout.true_on_policy", self.rollout.true_on_policy),
            ("rollout.precision fp8", self.rollout.precision == "fp8"),
            ("a critic (algorithm.advantage gae)", self.algorithm.advantage == "gae"),
            ("distill", self.distill.enabled),
            ("rollout.env", self.rollout.env is not None),  # its turns are token ids: no images to send
        ) if on]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}: not supported with a vision-language model (model.path "
                             f"{model}) yet (docs/multimodal.md, Limits)")

    @property
    def is_vision_language(self) -> bool:
        """Whether the run's model is a vision-language one: model.path's config.json model_type, or a built
        qwen2_vl."""
        if not self.model.path:
            return self.model.arch in VL_MODEL_TYPES
        return model_type_of(self.model.path) in VL_MODEL_TYPES

    def _check_expert_parallel(self) -> None:
        ep = self.train.expert_parallel
        if ep == 1:
            return
        if self.train.backend != "torch":
            raise ValueError(f"train.expert_parallel {ep}: the torch backend's; the megatron backend splits experts "
                             "with megatron.expert_parallel")
        if ep != self.train.num_workers:
            raise ValueError(f"train.expert_parallel {ep}: must be 1 or train.num_workers ({self.train.num_workers}): "
                             "every train rank holds its share of the experts (groups smaller than the world are not "
                             "supported)")
        clash = [k for k, on in (("train.lora", self.train.lora is not None), ("train.cpu_offload",
                 self.train.cpu_offload)) if on]
        if clash:
            raise ValueError(f"train.expert_parallel {ep} with {', '.join(clash)}: not supported together (the "
                             "expert shards live outside FSDP2, which adapters and CPU offload go through)")

    def _check_context_parallel(self) -> None:
        cp = self.train.context_parallel
        if cp == 1:
            return
        if self.train.backend != "torch":
            raise ValueError(f"train.context_parallel {cp}: the torch backend's; megatron's context parallelism "
                             "(megatron.transformer.context_parallel_size) needs Transformer Engine (docs/megatron.md)")
        if self.train.num_workers % cp:
            raise ValueError(f"train.context_parallel {cp} must divide train.num_workers ({self.train.num_workers}): "
                             "the ranks form data-parallel groups of context-parallel ranks")
        top_k = self.distill.enabled and self.distill.uses_top_k
        clash = [k for k, on in (("train.lora", self.train.lora is not None),
                                 ("train.expert_parallel", self.train.expert_parallel > 1),
                                 ("algorithm.routing_replay", self.algorithm.routing_replay != "off"),
                                 (f"distill.loss {self.distill.loss}", top_k),
                                 ("rollout.true_on_policy", self.rollout.true_on_policy)) if on]
        if clash:
            raise ValueError(f"train.context_parallel {cp} with {', '.join(clash)}: not supported together "
                             "(docs/native_trainer.md, 'Context parallelism')")

    def _check_fp8_rollout(self) -> None:
        """rollout.precision fp8: where the embedded engine can hold e4m3 weights, and the mismatch it brings is
        corrected unless the recipe says otherwise."""
        if self.rollout.precision != "fp8":
            return
        if self.rollout.backend != "torch":
            raise ValueError("rollout.precision fp8: the embedded engine's (rollout.backend torch); an SGLang server "
                             "quantizes with its own flag: rollout.sglang.args {quantization: fp8}, with "
                             "rollout.precision bf16")
        if self.rollout_device != "cuda":
            raise ValueError("rollout.precision fp8: needs rollout.device cuda (e4m3 GEMMs run on Hopper-class GPUs' "
                             "tensor cores); on the CPU use fp32 or bf16")
        transport = self.weight_sync.transport
        if transport in ("nccl", "adapter") or (transport == "cuda_ipc" and self.train.num_workers > 1):
            raise ValueError(
                f"weight_sync.transport {transport} with rollout.precision fp8: that transport writes bf16 straight "
                "into the engine's weight memory, and fp8 weights are quantized on receipt instead; use ray, store, "
                "disk, distributed, or cuda_ipc with one train worker")
        if self.train.lora is not None:
            raise ValueError("rollout.precision fp8 with train.lora: adapters are merged into bf16 weights; not "
                             "supported together")
        algo = self.algorithm
        if not algo.corrects_rollout:
            if {"is_correction", "rejection"} & algo.model_fields_set:
                warnings.warn("rollout.precision fp8 with algorithm.is_correction none and rejection none: fp8 "
                              "rollout log-probs differ from the trainer's (docs/benchmarks.md) and nothing corrects "
                              "for it; algorithm.is_correction tis is the default with fp8", UserWarning, stacklevel=2)
            else:
                algo.is_correction = "tis"

    def _check_true_on_policy(self) -> None:
        """rollout.true_on_policy: both sides must be rlflow's own engines computing in one dtype on one kind of
        device, synchronously, with nothing that changes the trainer's ops (docs/rollout.md, "True on-policy")."""
        r, t = self.rollout, self.train
        if not r.true_on_policy:
            return
        if r.backend != "torch" or t.backend != "torch":
            raise ValueError(f"rollout.true_on_policy: needs rollout.backend torch and train.backend torch (got "
                             f"{r.backend}, {t.backend}): both sides must run engines/models/invariant.py's ops")
        if r.precision != t.precision:
            raise ValueError(f"rollout.true_on_policy: rollout.precision {r.precision} must equal train.precision "
                             f"{t.precision} (fp8 weights or another compute dtype give other log-probs)")
        if self.rollout_device != t.device:
            raise ValueError(f"rollout.true_on_policy: rollout.device {self.rollout_device} must equal train.device "
                             f"{t.device} (CPU and GPU kernels round differently)")
        clash = [name for name, on in (("rollout.max_staleness > 0", r.max_staleness > 0),
                                       ("rollout.dynamic_sampling.partial_rollout", r.dynamic_sampling.enabled and
                                        r.dynamic_sampling.partial_rollout),
                                       ("rollout.compile", r.compile), ("train.compile", t.compile),
                                       ("train.lora", t.lora is not None),
                                       ("train.kernels liger", t.kernels != "torch"),
                                       ("train.context_parallel > 1", t.context_parallel > 1),
                                       ("train.expert_parallel > 1", t.expert_parallel > 1),
                                       ("algorithm.routing_replay", self.algorithm.routing_replay != "off")) if on]
        if clash:
            raise ValueError(f"rollout.true_on_policy with {', '.join(clash)}: not supported together (samples from "
                             "older weights are not on-policy; compiled or replaced modules, a split attention and "
                             "experts split over ranks run other ops than engines/models/invariant.py's; routing "
                             "replay is moot: the engine's routing is the trainer's, bit for bit)")

    def _check_routing_replay(self) -> None:
        replay = self.algorithm.routing_replay
        if replay == "off":
            return
        if self.train.backend == "megatron" and (self.megatron.tensor_parallel > 1 or
                                                 self.megatron.pipeline_parallel > 1):
            raise ValueError(f"algorithm.routing_replay {replay} with train.backend megatron: needs "
                             "megatron.tensor_parallel 1 (sequence parallelism splits a micro-batch's tokens over "
                             "the TP ranks) and megatron.pipeline_parallel 1 (the schedule interleaves micro-batches, "
                             "whose records the routers hold one at a time); expert_parallel is fine")
        if replay == "r3" and self.rollout.backend != "torch":
            raise ValueError(
                "algorithm.routing_replay r3: the rollout engine must record each token's experts, and the "
                f"{self.rollout.backend} backend is not wired for it: SGLang 0.5.10.post1 records them "
                "(--enable-return-routed-experts), but the sglang-router in front of it drops the request's "
                "return_routed_experts (sgl-project/sglang#20696); use rollout.backend torch, or routing_replay r2")

    def _check_critic(self, batch: int) -> None:
        if self.algorithm.advantage == "gae" and self.critic.enabled is False:
            raise ValueError("critic.enabled: algorithm.advantage gae needs a critic (true, or leave it empty)")
        if not self.use_critic:
            return
        if self.train.backend != "torch":
            raise ValueError("critic: the critic runs on train.backend 'torch' only (megatron has no value head yet)")
        if batch % (self.critic.num_workers * self.train.mini_batches) != 0:
            raise ValueError(
                f"critic.num_workers: the step's samples, {self._step_samples_text} = {batch}, must divide "
                f"evenly into {self.critic.num_workers} critic workers x train.mini_batches ({self.train.mini_batches})"
            )
        if self.critic.freeze_policy_steps >= self.train.steps:
            raise ValueError(f"critic.freeze_policy_steps ({self.critic.freeze_policy_steps}) must be below "
                             f"train.steps ({self.train.steps}): the policy would never train")

    def _check_distill(self, batch: int) -> None:
        d = self.distill
        fields = type(d).model_fields
        changed = [k for k in fields if k != "teacher_path" and getattr(d, k) != fields[k].default]
        if not d.enabled:
            if changed:
                raise ValueError(f"distill.teacher_path: distill.{', distill.'.join(changed)} set without a teacher "
                                 "(set distill.teacher_path to the teacher's HF directory)")
            return
        for keys, applies in ((("estimator", "policy_gradient"), not d.uses_top_k), (("top_k",), d.uses_top_k),
                              (("beta",), d.loss == "jsd")):
            wrong = [k for k in keys if k in changed and not applies]
            if wrong:
                raise ValueError(f"distill.{', distill.'.join(wrong)}: does not apply to distill.loss {d.loss!r}")
        if d.uses_top_k and self.train.backend != "torch":
            raise ValueError(f"distill.loss: {d.loss} takes the student's logprobs of the teacher's top-k tokens "
                             "inside the torch backend's LM head; train.backend megatron offers reverse_kl only")
        if batch % d.num_workers:
            raise ValueError(f"distill.num_workers: the step's samples, {self._step_samples_text} = {batch}, must "
                             f"divide evenly into {d.num_workers} teacher workers")
        if d.mode == "alone" and self.use_critic:
            raise ValueError("distill.mode: alone drops the RL loss, so a critic (critic.enabled, advantage gae) "
                             "would train for nothing: use mode added, or no critic")

    @property
    def use_critic(self) -> bool:
        """Whether the run has a value model (critic.enabled, by default: advantage gae)."""
        return self.critic.enabled if self.critic.enabled is not None else self.algorithm.advantage == "gae"

    def _check_sft(self) -> None:
        if self.sft.batch_size % self.data_parallel_size:
            raise ValueError(f"sft.batch_size ({self.sft.batch_size}) must divide evenly into "
                             f"{self.data_parallel_size} data-parallel workers")
        a, b = self.data.generate, self.sft.generate
        if a is not None and b is not None and (a.task, a.num_digits, a.num_eval, a.seed) != (
                b.task, b.num_digits, b.num_eval, b.seed):
            raise ValueError("sft.generate: task, num_digits, num_eval and seed must equal data.generate's, or the "
                             "SFT pairs may contain the held-out prompts")
        if b is not None and not self.sft.train_path:
            raise ValueError("sft.generate: needs sft.train_path (the file to write)")

    def _check_placement(self) -> None:
        transport, on_gpu = self.weight_sync.transport, self.train.device == "cuda" and self.rollout_device == "cuda"
        if self.train.cpu_offload and (self.train.device != "cuda" or self.train.backend != "torch"):
            raise ValueError("train.cpu_offload: moves the torch backend's state from the GPU to the host; it needs "
                             "train.device 'cuda' and train.backend 'torch'")
        if self.train.kernels == "liger" and (self.train.device != "cuda" or self.train.backend != "torch"):
            raise ValueError("train.kernels: liger runs Triton kernels in the torch backend's model; it needs "
                             "train.device 'cuda' and train.backend 'torch'")
        if self.train.kernels == "liger" and self.train.compile:
            raise ValueError("train.kernels: liger's kernels are autograd functions torch.compile cannot trace (the "
                             "compile fails in the first forward); use train.compile (it fuses the same norms, rotary "
                             "and SwiGLU, and was faster: docs/benchmarks.md) or liger, not both")
        if transport in ("cuda_ipc", "nccl"):
            # nccl's channel is gloo when both sides are on the CPU (engines/sync/nccl.py); cuda_ipc maps GPU memory
            same_device = self.train.device == self.rollout_device
            if not (on_gpu or (transport == "nccl" and same_device)) or not self.cluster.use_ray:
                needs = "'cuda'" if transport == "cuda_ipc" else "alike ('cuda': NCCL; 'cpu': gloo)"
                raise ValueError(f"weight_sync.transport: {transport} needs train.device and rollout.device {needs} "
                                 "and cluster.use_ray: true (train and rollout in separate processes)")
            if self.train.backend != "torch":
                raise ValueError(f"weight_sync.transport: {transport} works with train.backend 'torch'; "
                                 "use 'ray' or 'store' with megatron")
            if self.train.cpu_offload:
                raise ValueError(f"weight_sync.transport: {transport} reads the trainer's weights on its GPU; with "
                                 "train.cpu_offload they live on the host: use 'distributed' (NCCL broadcast of "
                                 "gathered buckets) instead")
            if transport == "nccl" and self.train.num_workers > 1:
                raise ValueError("weight_sync.transport: nccl sends train rank 0's whole parameters; with "
                                 "train.num_workers > 1 (FSDP2 shards them) use 'distributed' (NCCL broadcast of "
                                 "gathered buckets) instead")
        if transport == "distributed":
            if self.rollout_device == "cuda" and self.train.device != "cuda":
                raise ValueError("weight_sync.transport: distributed with rollout.device 'cuda' broadcasts over "
                                 "NCCL, which needs train.device 'cuda' too")
            if self.rollout.backend == "torch" and not self.cluster.use_ray:
                raise ValueError("weight_sync.transport: distributed with the embedded engine needs cluster.use_ray: "
                                 "true (its server and train rank 0 join one process group from two processes)")
            if self.rollout.backend == "sglang":
                weight_update_ranks(self.rollout.sglang.args)  # refuses ranks that would collide (pipeline stages)
        if (transport == "adapter") != (self.train.lora is not None):
            raise ValueError("weight_sync.transport: adapter moves LoRA adapters alone; it goes with train.lora, "
                             "and train.lora needs it (the rollout engines keep the base and load each adapter)"
                             if transport == "adapter" else "train.lora: needs weight_sync.transport: adapter (only "
                             "the adapter moves; the rollout engines keep the base weights)")
        if self.train.lora is not None and self.train.backend != "torch":
            raise ValueError("train.lora: LoRA is built on the torch backend (peft); train.backend is "
                             f"{self.train.backend!r}")
        if transport == "cuda_ipc" and not self.cluster.colocate:
            raise ValueError("weight_sync.transport: cuda_ipc needs cluster.colocate: true (a shared GPU)")
        for name, section in (("train", self.train), ("rollout", self.rollout), ("critic", self.critic)):
            if section.num_workers % section.nodes:
                raise ValueError(f"{name}.nodes: {name}.num_workers ({section.num_workers}) must split evenly over "
                                 f"{section.nodes} nodes")
        if self.train.offload_during_rollout and not self.cluster.colocate:
            raise ValueError("train.offload_during_rollout: parks the trainer's state while a rollout engine uses "
                             "its GPU; it needs cluster.colocate: true (separate GPUs keep it where it is)")
        if self.cluster.colocate:
            if self.rollout.nodes != self.train.nodes:
                raise ValueError(f"cluster.colocate: rollout.nodes ({self.rollout.nodes}) must equal train.nodes "
                                 f"({self.train.nodes}): rollout worker i shares train worker i's GPU")
            if not on_gpu:
                raise ValueError("cluster.colocate: needs train.device and rollout.device 'cuda'")
            if self.rollout.num_workers != self.train.num_workers:
                raise ValueError(f"cluster.colocate: rollout.num_workers ({self.rollout.num_workers}) must equal "
                                 f"train.num_workers ({self.train.num_workers}): one pair per GPU")
            if self.rollout.max_staleness:
                raise ValueError(f"cluster.colocate: asynchronous training (rollout.max_staleness: "
                                 f"{self.rollout.max_staleness}) needs separate GPUs for rollout and training "
                                 "(colocate: false)")

    def _check_debug(self) -> None:
        d = self.debug
        if d.mode == "train_only" and not d.replay_run:
            raise ValueError("debug.replay_run: train_only needs a run whose stored rollout batches it trains on")
        if d.mode == "rollout_only" and d.replay_run:
            raise ValueError("debug.replay_run: rollout_only generates its batches; it cannot also replay them")
        if d.mode == "rollout_only" and self.rollout.max_staleness:
            raise ValueError("debug.mode: rollout_only trains nothing, so it runs synchronously "
                             "(rollout.max_staleness: 0)")
        if d.replay_run == self.name and (d.replay_store or self.storage.uri) == self.storage.uri:
            raise ValueError(f"debug.replay_run: {d.replay_run!r} is this run; name another run (or another store)")
        if d.mode and self.cluster.colocate:
            raise ValueError(f"debug.mode: {d.mode} starts one kind of worker; cluster.colocate pairs train and "
                             "rollout workers (set it to false)")

    @property
    def step_samples(self) -> int:
        """Samples in a step's batch: prompts x samples per prompt, plus one greedy baseline per prompt (remax)."""
        extra = 1 if self.algorithm.advantage == "remax" else 0
        return self.rollout.prompts_per_step * (self.rollout.samples_per_prompt + extra)

    @property
    def _step_samples_text(self) -> str:
        if self.algorithm.advantage == "remax":
            return "rollout.prompts_per_step * (rollout.samples_per_prompt + 1 greedy baseline)"
        return "rollout.prompts_per_step * rollout.samples_per_prompt"

    @property
    def rollout_device(self) -> str:
        return self.rollout.device or self.train.device

    @property
    def offloads_trainer(self) -> bool:
        """Whether the train workers park their state in host memory while their colocated rollout engine runs
        (train.offload_during_rollout; empty: whenever colocated)."""
        return self.cluster.colocate and self.train.offload_during_rollout is not False

    @property
    def data_parallel_size(self) -> int:
        if self.train.backend == "megatron":
            return self.train.num_workers // self.megatron.model_parallel
        return self.train.num_workers // self.train.context_parallel  # a CP group trains on one shard
