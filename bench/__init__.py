"""Benchmarks and GPU checks of rlflow, grouped by area; run from the repository root:
`python -m bench.<area>.<script>`.

    harness.py  what every script repeats: device info, timing, the JSON report, --smoke, child processes
    ranks.py    one function on N spawned ranks under a time limit (the multi-GPU scripts)
    train/      the native trainer: one GPU against a plain loop, N GPUs, FSDP2 checks, head kernels, offload
    megatron/   the Megatron backend: parity, throughput against bare megatron-core, layouts, fused kernels
    rollout/    the rollout engine: throughput, paged decode kernels, the HTTP server, SGLang's flag table
    sync/       weight sync between real processes without Ray (the transports, SGLang's distributed update)
    e2e/        the RL loop end to end: the bare loop, GRPO per placement, one-step-off, a killed GPU worker
    cpu/        the 2-core development machine: orchestration overhead, tracing, recipe sweeps, LoRA and SFT arms
    figures/    the docs' images: the step breakdown plot, the Prefect run form screenshot

bench/ may import rlflow; nothing in rlflow imports bench/, and bench's packages import each other without a
circle (both held by import-linter, pyproject.toml). Recorded results are in bench/results/, the figures and the
commands that made them in docs/benchmarks.md.
"""
