"""LoRA adapters on the embedded engine: one adapter at a time, merged into the engine's weights.

For every adapted linear W = W_base + s * B @ A (s = lora_alpha / r, use_rslora: lora_alpha / sqrt(r)), computed
in fp32 and cast to the engine's dtype (engines/models/peft_adapter.py reads the PEFT folder and holds the
formula), then written with `copy_` into the existing parameter. The parameters keep their memory, so the flat
weight buffer, the fused q/k/v and gate/up views (engines/models/flat_weights.py) and captured CUDA graphs stay
valid, and decoding runs at the base model's speed (no LoRA GEMMs). A copy of every adapted base weight
(`MergedAdapter.base`, in host memory) is taken the first time it is adapted, so the next adapter merges from the
exact base (no drift from merging and unmerging) and unloading restores it bitwise. Several adapters in one batch
(S-LoRA / Punica kernels) are SGLang's job: its backend serves them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlflow.engines.models.peft_adapter import (
    ALL_LINEAR,
    CONFIG_FILE,
    PeftAdapter,
    linear_weights,
    merged_weight,
    module_names,
    read_peft_adapter,
)


@dataclass
class LoraLimits:
    """What the engine was started for (SGLang's --max-lora-rank and --lora-target-modules): adapters beyond them
    are refused, as SGLang refuses them, so a run that works here works on SGLang."""

    rank: int
    target_modules: list[str]

    @classmethod
    def of(cls, lora: Any) -> LoraLimits | None:
        """From the run's `train.lora` (a dict or a config object with `rank` and `target_modules`); None: none."""
        if lora is None:
            return None
        get = lora.get if isinstance(lora, Mapping) else lambda k: getattr(lora, k, None)
        rank, modules = get("rank"), get("target_modules")
        if isinstance(modules, str):
            modules = [modules]
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"lora.rank: a positive integer, got {rank!r}")
        if not modules or not all(isinstance(m, str) and m for m in modules):
            raise ValueError(f"lora.target_modules: a non-empty list of module names, got {modules!r}")
        return cls(rank, list(modules))

    def check(self, adapter: PeftAdapter, short: list[str]) -> None:
        """ValueError naming adapter_config.json when the adapter's rank or modules exceed these limits."""
        where = Path(adapter.path) / CONFIG_FILE
        if adapter.rank > self.rank:
            raise ValueError(
                f"{where}: r = {adapter.rank} is above the rank the engine was started for "
                f"({self.rank}: lora.rank, SGLang's --max-lora-rank)"
            )
        allowed = set(short) if any(m in ALL_LINEAR for m in self.target_modules) else set(self.target_modules)
        wanted = short if any(t in ALL_LINEAR for t in adapter.target_modules) else adapter.target_modules
        outside = sorted(set(wanted) - allowed)
        if outside:
            raise ValueError(
                f"{where}: target_modules {outside} are outside those the engine was started for "
                f"({sorted(allowed)}: lora.target_modules, SGLang's --lora-target-modules)"
            )


@dataclass
class Adapter:
    """An adapter the engine serves: its name and the checked PEFT adapter."""

    name: str
    peft: PeftAdapter

    @property
    def path(self) -> str:
        return self.peft.path


def read_adapter(
    name: str, folder: str | Path, model: torch.nn.Module, shapes: Mapping[str, torch.Size], limits: LoraLimits | None
) -> Adapter:
    """The adapter in `folder`, checked against `model` (its weights' `shapes`: they hold while the weights are
    released) and the engine's `limits`."""
    linears = linear_weights(model)
    adapter = read_peft_adapter(folder, linears, shapes)
    if limits is not None:
        limits.check(adapter, module_names(linears))
    return Adapter(name, adapter)


@dataclass
class MergedAdapter:
    """What an engine holds while adapters are merged: the adapter served, and the base values of every weight
    an adapter has changed since the first load (host copies, so releasing the GPU memory keeps them)."""

    adapter: Adapter | None = None
    base: dict[str, torch.Tensor] = field(default_factory=dict)

    @torch.no_grad()
    def merge(self, params: dict[str, torch.Tensor], adapter: Adapter) -> None:
        """Write base + s * B @ A into every weight `adapter` adapts and the plain base into the weights only an
        earlier adapter changed."""
        lora = adapter.peft
        for name in lora.weights:
            if name not in self.base:  # never adapted: the parameter holds the base
                self.base[name] = host_copy(params[name])
        for name, base in self.base.items():
            p = params[name]
            pair = lora.weights.get(name)
            if pair is None:
                p.copy_(base)
            else:
                p.copy_(merged_weight(base.to(p.device), *pair, lora.scale, p.dtype))
        self.adapter = adapter

    @torch.no_grad()
    def restore(self, params: dict[str, torch.Tensor]) -> None:
        """Write the base back into every weight an adapter changed (bitwise) and forget the copies."""
        for name, base in self.base.items():
            params[name].copy_(base)
        self.adapter, self.base = None, {}


def host_copy(p: torch.Tensor) -> torch.Tensor:
    """A copy of `p` in host memory (pinned when it comes from a GPU, so restoring it is one fast copy)."""
    out = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.device.type == "cuda")
    return out.copy_(p.detach())
