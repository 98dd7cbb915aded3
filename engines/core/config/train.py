"""train and critic: the train engines, their optimizer and memory settings, LoRA, and PPO's value model."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from rlflow.engines.core.config.base import Section, nodes_field

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """LoRA RL (docs/lora.md): the base model stays frozen in the train precision and only low-rank adapters
    train; weight sync moves the adapter alone (weight_sync.transport adapter), the reference model is the base
    with the adapters switched off, and checkpoints hold the adapter, its optimizer state, a PEFT export and the
    merged weights."""

    ADAPTER_NAME: ClassVar[str] = "policy"  # what rollout workers serve the adapter as (/generate's lora_path)

    rank: int = Field(16, gt=0, description="r: the adapters' rank.")
    alpha: float = Field(32.0, gt=0.0, description="lora_alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1,
        description="Linear layers that get an adapter, by module name (Llama/Qwen: q_proj k_proj v_proj o_proj "
        "gate_proj up_proj down_proj).",
    )

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        unknown = sorted(set(v) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"unknown module(s) {unknown}; the decoders rlflow runs have {list(LORA_TARGETS)}")
        return list(dict.fromkeys(v))

    def peft_config(self) -> dict:
        """The adapter_config.json fields PEFT (and SGLang's adapter loader) read."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "lora_dropout": self.dropout, "target_modules": self.target_modules, "bias": "none",
                "use_rslora": False, "fan_in_fan_out": False}


class TrainConfig(Section):
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="Train engine: the native PyTorch backend, or Megatron-core (see the megatron section)."
    )
    num_workers: int = Field(
        1, gt=0, description="Train workers (gloo on CPU, nccl on GPU): FSDP2 ranks for torch (parameters, "
        "gradients and optimizer state sharded over them); tensor x pipeline x data-parallel ranks for megatron."
    )
    nodes: int = nodes_field("train workers")
    steps: int = Field(100, gt=0, description="RL iterations.")
    lr: float = Field(3e-3, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0.0)
    mini_batches: int = Field(1, gt=0, description="Optimizer steps per pass over the batch (PPO mini-batches).")
    epochs: int = Field(1, gt=0, description="Passes over each rollout batch (PPO epochs).")
    micro_batch_size: int = Field(512, gt=0, description="Sequences per forward/backward on one worker (at most).")
    micro_batch_tokens: int = Field(
        0, ge=0, description="torch backend: token budget of one micro-batch, the summed length of its samples "
        "(they are packed, no padding); 0: micro_batch_size samples. The megatron backend has its own.",
    )
    logprob_chunk_tokens: int = Field(
        4096, gt=0, description="Tokens per chunk of the LM head's log-softmax (recomputed in the backward), so at "
        "most chunk x vocab fp32 logits exist at once (torch backend: the head's matmul is chunked too; megatron: "
        "its output layer's bf16 logits are whole, their fp32 work chunked).",
    )
    activation_checkpointing: Literal["off", "full", "selective"] = Field(
        "off", description="torch backend: recompute decoder layers' activations in the backward pass instead of "
        "keeping them. 'full': each layer's whole forward runs again (about half the memory). 'selective': the same "
        "except the attention kernel, whose outputs are kept (about tokens x hidden per layer): at long samples "
        "attention is most of a layer's FLOPs, so this spares most of full's recompute for a little more memory "
        "(engines/models/checkpointing.py). true/false: full/off.")
    compile: bool = Field(False, description="torch.compile each decoder layer (dynamic shapes; casts, norms, "
                          "rotary and SwiGLU fused; the measured gains are in docs/native_trainer.md and "
                          "docs/megatron.md), for about half a minute of compiling in the first step. megatron: the "
                          "local layer spec's layers (not Transformer Engine's).")
    fused_head: bool = Field(
        True, description="torch backend on CUDA: the LM head's log-softmax, entropy and their gradient run as a "
        "few kernels generated by torch.compile (engines/models/head_math.py) instead of a dozen fp32 passes over "
        "each chunk's logits; false: the same math as eager torch ops (as on the CPU).")
    attention_kernel: Literal["flash", "cudnn"] = Field(
        "flash", description="torch backend on CUDA: 'flash' runs every micro-batch's attention through torch's "
        "variable-length flash attention (FlashAttention-2); 'cudnn' runs a micro-batch that holds one sample (a long "
        "context: one sample per micro-batch, with or without context parallelism) through torch's cuDNN SDPA "
        "kernel, the Hopper-tuned one, and packed micro-batches as 'flash' (docs/native_trainer.md, 'Attention "
        "kernels').")
    kernels: Literal["torch", "liger"] = Field(
        "torch", description="torch backend: 'liger' swaps the decoder layers' RMSNorm, rotary and SwiGLU for "
        "liger-kernel's fused Triton kernels (CUDA; pip install 'rlflow[liger]'); 'torch': HF's modules as loaded.")
    reshard_after_forward: bool = Field(
        True, description="torch backend: FSDP2 frees each layer's gathered weights after its forward and gathers "
        "them again for its backward (memory of one layer at a time). false keeps them until the backward: no "
        "second all-gather per micro-batch, the gathered bf16 weights of every layer in memory at once.")
    expert_parallel: int = Field(
        1, ge=1, description="torch backend, MoE models: split every MoE layer's experts over this many train "
        "ranks, an all-to-all taking each token to its experts' rank (FSDP2 shards the other weights as before). "
        "1 or train.num_workers; it must divide the number of experts. Megatron: megatron.expert_parallel.")
    context_parallel: int = Field(
        1, ge=1, description="torch backend: split each micro-batch's packed token stream over this many train ranks "
        "(Ulysses: an all-to-all gives each rank every token for 1/N of the attention heads), so one sample may be "
        "up to N x train.micro_batch_tokens long. Must divide train.num_workers (data-parallel size: num_workers / "
        "N) and the model's attention heads. Not with train.lora, train.expert_parallel, algorithm.routing_replay, "
        "distill.loss forward_kl/jsd or rollout.true_on_policy (docs/native_trainer.md, 'Context parallelism').")
    cpu_offload: bool = Field(
        False, description="torch backend: FSDP2 CPU offload: parameters, gradients and optimizer state live on "
        "the host (the optimizer steps there) and each layer is copied to the GPU when it runs; trains models "
        "whose state does not fit on the GPUs, at the cost of host-device copies.",
    )
    offload_during_rollout: bool | None = Field(
        None, description="cluster.colocate: the train workers park their optimizer state and weights in pinned "
        "host memory (and drop the last step's gradients) while the rollout engine sharing their GPU generates, "
        "and take them back before they run again; logged as time/offload and time/onload. Empty: on when "
        "colocated. With weight_sync.transport cuda_ipc and one train worker the weights stay (the rollout engine "
        "maps them).",
    )
    freeze_vision: bool = Field(
        True, description="Vision-language models: keep the vision encoder and its projector (merger) at their "
        "loaded weights; only the language model trains, and weight syncs send only its tensors.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="Compute dtype of training; master weights, gradient reduction and optimizer state "
        "stay fp32 (torch backend: FSDP2's mixed-precision policy).",
    )
    threads: int = Field(2, gt=0, description="torch threads per worker.")
    device: Literal["cpu", "cuda"] = "cpu"
    lora: LoraConfig | None = Field(
        None, description="torch backend: train LoRA adapters on a frozen base instead of every weight "
        "(docs/lora.md); needs weight_sync.transport adapter. Empty: full fine-tuning.")

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_bool(cls, v):
        """Recipes from before the selective mode said true/false."""
        return {True: "full", False: "off"}[v] if isinstance(v, bool) else v


class CriticConfig(Section):
    """The value model of PPO with GAE: a second group of train workers (docs/algorithms.md)."""

    enabled: bool | None = Field(
        None, description="Train a critic. Empty: when algorithm.advantage is gae (which needs one). With another "
        "estimator the critic trains on the GAE returns beside it (warm-up, or to watch critic/vf_explained_var).",
    )
    model_path: str | None = Field(
        None, description="HF causal-LM directory the value model's body starts from; empty: the policy's starting "
        "model. Its LM head is dropped and a scalar value head, initialised to zero, is added.",
    )
    num_workers: int = Field(1, gt=0, description="Critic train workers: data-parallel copies, like train.num_workers.")
    nodes: int = nodes_field("critic's workers")
    lr: float = Field(1e-3, gt=0.0, description="The critic's learning rate (its own AdamW; betas, weight decay, "
                      "epochs, mini-batches and precision are train's).")
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="LR warm-up of the critic, in RL steps (like train.warmup_steps).")
    grad_clip: float = Field(1.0, gt=0.0)
    value_clip: float | None = Field(
        0.5, gt=0.0, description="PPO value clipping: a value may not move more than this from the one the "
        "advantages were computed with in a direction that lowers its loss; empty disables it.",
    )
    freeze_policy_steps: int = Field(
        0, ge=0, description="The first N RL steps train only the critic; the policy keeps its weights (verl's "
        "critic_warmup), so the first policy updates see a critic that already fits the returns.",
    )

    def train_config(self, train: TrainConfig) -> TrainConfig:
        """The critic's TrainConfig: train's, with the critic's optimizer settings and worker count."""
        return train.model_copy(update={
            "num_workers": self.num_workers, "lr": self.lr, "lr_schedule": self.lr_schedule,
            "warmup_steps": self.warmup_steps, "grad_clip": self.grad_clip,
        })
