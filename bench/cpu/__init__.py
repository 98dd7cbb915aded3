"""Benchmarks of the 2-core development machine: what orchestration and tracing cost, recipe sweeps, and the
LoRA and SFT-then-GRPO arms on the sort demo."""
