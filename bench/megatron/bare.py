"""The baseline for the Megatron backend's throughput: a bare megatron-core training loop, as a pretraining script
writes it (GPTModel computing its own cross-entropy, the pipeline schedule, DDP and the distributed optimizer).

It builds the same model as the backend (the same TransformerConfig and layer spec from the same HF config) and
runs the same micro-batches, so the ratio of the two is the cost of the backend's RL step around megatron-core.
`bare_throughput` is its measurement for bench/megatron/gpu.py, beside checks.backend_throughput.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from transformers import AutoConfig

from bench import harness
from bench.megatron.checks import profile_step, split_variant
from rlflow.engines.core.config import MegatronConfig
from rlflow.engines.train.megatron.cpu import device_context
from rlflow.engines.train.megatron.fused_kernels import fuse_adam
from rlflow.engines.train.megatron.hf_config import spec_from_hf
from rlflow.engines.train.megatron.model_build import (
    build_model,
    compile_decoder_layers,
    init_parallel,
    transformer_config,
)


def bare_loop_tokens_per_s(model_dir: str, micro_batch: int, seq: int, micro_batches: int, steps: int,
                           warmup: int, device: str, dist_url: str | None, attention: str = "sdpa",
                           compile_layers: bool = False, torch_fused_kernels: bool = True,
                           transformer: dict | None = None) -> dict[str, float]:
    """Tokens/s of `steps` optimizer steps (after `warmup`) on random tokens, bf16 weights, fp32 main params;
    `compile_layers`: each decoder layer compiled as the backend's train.compile does; `torch_fused_kernels`:
    torch's stand-ins for apex's fused kernels, as the backend's megatron.torch_fused_kernels (what a megatron-core
    user with apex would have); `transformer`: megatron.transformer keys, as the backend takes them."""
    with device_context(device):
        mcfg = MegatronConfig(attention=attention, packing=attention != "unfused",
                              torch_fused_kernels=torch_fused_kernels, transformer=transformer or {})
        init_parallel(0, 1, dist_url, mcfg, device, seed=0)
        spec = spec_from_hf(AutoConfig.from_pretrained(model_dir))
        config = transformer_config(spec, mcfg, torch.bfloat16, device, compiled=compile_layers)
        core = build_model(spec, config, use_te=False, attention=attention)
        if compile_layers:
            compile_decoder_layers(core)
        model = Float16Module(config, core)
        ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True))
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-5, weight_decay=0.0, clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16,
            use_distributed_optimizer=True), [ddp])
        if torch_fused_kernels:
            fuse_adam(optimizer)
        dev = "cuda" if device == "cuda" else "cpu"
        data = torch.randint(0, spec.vocab_size, (micro_batches, micro_batch, seq + 1), device=dev)
        positions = torch.arange(seq, device=dev).expand(micro_batch, seq)

        def forward_step(data_iterator, chunk):
            tokens = next(data_iterator)
            mask = torch.ones(seq, seq, dtype=torch.bool, device=dev).triu(1).view(1, 1, seq, seq)
            per_token = chunk(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])

            def loss_func(output):
                count = torch.tensor(output.numel(), dtype=torch.int, device=output.device)
                loss = output.float().sum()
                return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

            return per_token, loss_func

        def step() -> None:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(data), model=[ddp],
                num_microbatches=micro_batches, seq_length=seq, micro_batch_size=micro_batch, forward_only=False)
            optimizer.step()

        elapsed = harness.mean_time(step, steps, warmup=warmup, on=device)
        profiled = profile_step(step)
    return {"step_s": elapsed, "tokens_per_step": micro_batches * micro_batch * seq,
            "tokens_per_s": micro_batches * micro_batch * seq / elapsed} | profiled


def bare_throughput(rank: int, world: int, model_dir: str, micro_batch: int, seq: int, micro_batches: int,
                    steps: int, warmup: int, device: str, url: str, out: str, attention: str = "sdpa") -> None:
    """bare_loop_tokens_per_s of a throughput variant (checks.split_variant), in a spawned process."""
    v = split_variant(attention)
    result = bare_loop_tokens_per_s(model_dir, micro_batch, seq, micro_batches, steps, warmup, device, url,
                                    v.attention.partition("-")[0], compile_layers=v.compile,
                                    torch_fused_kernels=v.torch_fused_kernels, transformer=v.transformer)
    result["peak_memory_gib"] = harness.peak_gib() or 0.0
    harness.write_json(out, result)
