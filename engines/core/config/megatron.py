"""megatron: the Megatron-core train backend's parallelism and pass-through settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlflow.engines.core.config.base import Section


class MegatronConfig(Section):
    """The Megatron-core backend (train.backend: megatron). The three dicts reach megatron-core untouched."""

    tensor_parallel: int = Field(1, gt=0, description="Tensor-parallel size.")
    pipeline_parallel: int = Field(1, gt=0, description="Pipeline-parallel size.")
    expert_parallel: int = Field(
        1, gt=0, description="Expert-parallel size (MoE models): each rank holds 1/expert_parallel of every layer's "
        "experts, and tokens travel to their experts by all-to-all. Must divide the data-parallel size "
        "(train.num_workers / (tensor_parallel x pipeline_parallel)) and the number of experts."
    )
    micro_batch_tokens: int = Field(
        0, ge=0, description="Token budget of one micro-batch: summed sample lengths when packed, rows x padded "
        "length otherwise; 0: train.micro_batch_size rows."
    )
    packing: bool = Field(
        False, description="Run each micro-batch's samples as one token stream (megatron's THD layout, attention "
        "kept within each sample): no padding work. false: right-padded rows, as fast on an H100 today "
        "(docs/benchmarks.md)."
    )
    use_distributed_optimizer: bool = Field(True, description="Shard optimizer state over data-parallel ranks.")
    torch_fused_kernels: bool = Field(
        True, description="Where neither apex nor Transformer Engine is installed, torch's fused kernels stand in "
        "for theirs: weight-gradient GEMMs accumulate straight into the fp32 main_grad, a fused AdamW, foreach "
        "gradient norm and copies (engines/train/megatron/fused_kernels.py). false: megatron-core's own per-tensor "
        "fallbacks (slower; kept to compare)."
    )
    transformer_engine: bool | None = Field(
        None, description="Build layers from Transformer Engine; empty: when it is installed."
    )
    attention: Literal["sdpa", "unfused"] = Field(
        "sdpa", description="Core attention of the local (no Transformer Engine) layer spec: 'sdpa' runs torch's "
        "fused flash / memory-efficient kernels; 'unfused' megatron's DotProductAttention (materialises the score "
        "matrix; the reference). Ignored when Transformer Engine layers are used."
    )
    transformer: dict[str, Any] = Field(
        default_factory=dict, description="Extra TransformerConfig keyword arguments (override the derived ones)."
    )
    optimizer: dict[str, Any] = Field(
        default_factory=dict, description="Extra OptimizerConfig keyword arguments (override the derived ones)."
    )
    ddp: dict[str, Any] = Field(
        default_factory=dict, description="Extra DistributedDataParallelConfig keyword arguments."
    )

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @model_validator(mode="after")
    def _packing_needs_an_attention_that_packs(self) -> MegatronConfig:
        if self.packing and self.attention == "unfused" and not self.transformer_engine:
            raise ValueError("megatron.packing: true needs megatron.attention: sdpa (or Transformer Engine); "
                             "megatron's unfused DotProductAttention cannot run packed sequences. Set "
                             "megatron.packing: false to train the unfused attention on padded rows")
        return self

    @model_validator(mode="after")
    def _context_parallel_needs_transformer_engine(self) -> MegatronConfig:
        cp = self.transformer.get("context_parallel_size", 1)
        if cp != 1 and self.transformer_engine is not True:
            raise ValueError(f"megatron.transformer.context_parallel_size {cp} needs Transformer Engine's attention "
                             "(set megatron.transformer_engine: true where it is installed): the local layer spec's "
                             "attentions (sdpa, unfused) have no context-parallel form")
        return self
