"""LoRA adapters on the embedded engine: read a PEFT adapter folder and merge it into the engine's weights.

The embedded engine serves ONE adapter at a time, merged: for every targeted linear,
W = W_base + s * B @ A, with s = lora_alpha / r (use_rslora: lora_alpha / sqrt(r)), computed in fp32 and cast to
the engine's dtype, then written with `copy_` into the existing parameter. The parameters keep their memory, so
the flat weight buffer, the fused q/k/v and gate/up views (engines/models/flat_weights.py) and captured CUDA
graphs stay valid, and decoding runs at the base model's speed (no LoRA GEMMs). A copy of every targeted base
weight (`MergedAdapter.base`, in host memory) is taken the first time a module is targeted, so the next adapter
merges from the exact base (no drift from merging and unmerging) and unloading restores it bitwise.
Several adapters in one batch (S-LoRA / Punica kernels) are SGLang's job: its backend serves them.

The folder is PEFT's `save_pretrained` format: `adapter_config.json` (LoraConfig's fields) and
`adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r].
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
ALL = ("all", "all-linear")  # SGLang's --lora-target-modules all, PEFT's target_modules "all-linear"

# LoraConfig options that change what merging means; the merge here supports only their defaults
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "target_parameters": None,
}


@dataclass
class Adapter:
    """One PEFT LoRA adapter, read and checked against the model: per targeted weight (HF parameter name), its
    A [r, in] and B [out, r] as stored, and the scale s of W + s * B @ A."""

    name: str
    path: str
    rank: int
    scale: float
    target_modules: list[str]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


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


def linear_names(model: torch.nn.Module) -> dict[str, str]:
    """{HF module path: its weight's parameter name} for every nn.Linear of the model: what LoRA may target."""
    return {path: f"{path}.weight" for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(
            f"lora_path: {str(folder)!r} has no {CONFIG_FILE} (a PEFT adapter folder has "
            f"{CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object (PEFT's LoraConfig)")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg['peft_type']!r}; only LoRA adapters (peft_type 'LORA') are served")
    for key, default in _UNSUPPORTED.items():
        value = cfg.get(key)
        if value is not None and value != default and not (default is None and value in ([], {})):
            raise ValueError(
                f"{path}: {key} = {value!r} is not supported by the embedded engine's merge (only {default!r})"
            )
    return cfg


def read_adapter(
    name: str, folder: str | Path, model: torch.nn.Module, shapes: Mapping[str, torch.Size], limits: LoraLimits | None
) -> Adapter:
    """Read and check the adapter in `folder` against `model` (its weights' `shapes`: they hold while the weights
    are released): its config (r, lora_alpha, use_rslora,
    target_modules), then every lora_A / lora_B pair (a known linear of the model, both halves, shapes
    [r, in] and [out, r]). ValueError naming the file and key otherwise."""
    folder = Path(folder)
    cfg = _config(folder)
    config_path = folder / CONFIG_FILE
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{config_path}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{config_path}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    linears = linear_names(model)
    short = sorted({p.rsplit(".", 1)[-1] for p in linears})
    targets = cfg.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not targets:
        raise ValueError(
            f"{config_path}: target_modules must name the model's linear modules ({short}), got "
            f"{cfg.get('target_modules')!r}"
        )
    unknown = [t for t in targets if t not in short and t not in ALL]
    if unknown:
        raise ValueError(f"{config_path}: target_modules {unknown} are not linear modules of the model ({short})")
    if limits is not None:
        if rank > limits.rank:
            raise ValueError(
                f"{config_path}: r = {rank} is above the rank the engine was started for "
                f"({limits.rank}: lora.rank, SGLang's --max-lora-rank)"
            )
        allowed = set(short) if any(m in ALL for m in limits.target_modules) else set(limits.target_modules)
        outside = sorted(set(short if any(t in ALL for t in targets) else targets) - allowed)
        if outside:
            raise ValueError(
                f"{config_path}: target_modules {outside} are outside those the engine was started "
                f"for ({sorted(allowed)}: lora.target_modules, SGLang's --lora-target-modules)"
            )

    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        other = sorted(p.name for p in folder.glob("adapter_model.*"))
        hint = f" (found {other}: only safetensors is read, never pickle)" if other else ""
        raise ValueError(f"lora_path: {str(folder)!r} has no {WEIGHTS_FILE}{hint}")
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types vary by release
        raise ValueError(f"{weights_path}: not a safetensors file ({exc})") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(
                f"{weights_path}: key {key!r} is not a LoRA weight ({KEY_PREFIX}<module>.lora_A.weight "
                "or .lora_B.weight; embedding LoRA, DoRA and bias terms are not served)"
            )
        if m["module"] not in linears:
            raise ValueError(
                f"{weights_path}: key {key!r} names module {m['module']!r}, not a linear module of the model"
            )
        halves.setdefault(m["module"], {})[m["which"]] = tensor
    if not halves:
        raise ValueError(f"{weights_path}: no LoRA weights in it")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(halves.items()):
        for which in "AB":
            if which not in pair:
                raise ValueError(
                    f"{weights_path}: {KEY_PREFIX}{module}.lora_{which}.weight is missing (its "
                    f"lora_{'B' if which == 'A' else 'A'} is there)"
                )
        a, b = pair["A"], pair["B"]
        out_f, in_f = shapes[linears[module]]
        if a.shape != (rank, in_f) or b.shape != (out_f, rank):
            raise ValueError(
                f"{weights_path}: {KEY_PREFIX}{module}: lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)} do not fit r = {rank} and the weight [{out_f}, {in_f}] (expected "
                f"lora_A [{rank}, {in_f}], lora_B [{out_f}, {rank}])"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(f"{weights_path}: {KEY_PREFIX}{module}: LoRA weights must be floating point")
        weights[linears[module]] = (a, b)
    return Adapter(name, str(folder), rank, float(scale), list(targets), weights)


@dataclass
class MergedAdapter:
    """What an engine holds while adapters are merged: the adapter served, and the base values of every weight
    an adapter has targeted since the first load (host copies, so releasing the GPU memory keeps them)."""

    adapter: Adapter | None = None
    base: dict[str, torch.Tensor] = field(default_factory=dict)

    @torch.no_grad()
    def merge(self, params: dict[str, torch.Tensor], adapter: Adapter) -> None:
        """Write base + scale * B @ A into every weight `adapter` targets (fp32, cast to the weight's dtype) and the
        plain base into the weights only the previous adapter targeted."""
        for name in adapter.weights:
            if name not in self.base:  # never targeted: the parameter holds the base
                self.base[name] = host_copy(params[name])
        for name, base in self.base.items():
            p = params[name]
            pair = adapter.weights.get(name)
            if pair is None:
                p.copy_(base)
                continue
            a, b = (t.to(p.device, torch.float32) for t in pair)
            merged = base.to(p.device, torch.float32, copy=True).addmm_(b, a, alpha=adapter.scale)
            p.copy_(merged.to(p.dtype))
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
