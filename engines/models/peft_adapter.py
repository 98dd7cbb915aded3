"""PEFT's LoRA adapter folder, read and checked against a model, and the merge W + s * B @ A: one implementation
for every engine that merges an adapter (the embedded rollout engine; a merged export can use the same).

A folder of `save_pretrained` holds `adapter_config.json` (peft's LoraConfig: r, lora_alpha, use_rslora,
target_modules, ...) and `adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r]. The scale s is lora_alpha / r (use_rslora: lora_alpha / sqrt(r)). Options that change
what merging means (DoRA, bias terms, per-module rank or alpha patterns, modules saved whole, fan_in_fan_out) are
refused by name rather than merged wrongly; so are keys that are not a LoRA pair of a linear of the model (LoRA on
embeddings). A pickled `adapter_model.bin` is never read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
ALL_LINEAR = ("all", "all-linear")  # SGLang's --lora-target-modules all, peft's target_modules "all-linear"

# LoraConfig options that change what merging means: only their defaults are merged
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
class PeftAdapter:
    """A LoRA adapter checked against a model: per adapted weight (its HF parameter name) A [r, in] and B [out, r]
    as stored, and the scale s of W + s * B @ A."""

    path: str
    rank: int
    scale: float
    target_modules: list[str]  # as the config names them (short names, or "all-linear")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def linear_weights(model: torch.nn.Module) -> dict[str, str]:
    """{module path: its weight's parameter name} for every nn.Linear of `model`: what LoRA may adapt."""
    return {path: f"{path}.weight" for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def module_names(linears: Mapping[str, str]) -> list[str]:
    """The short names (q_proj, ...) of the linears: what target_modules lists."""
    return sorted({path.rsplit(".", 1)[-1] for path in linears})


def lora_scale(config: Mapping) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    rank, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


@torch.no_grad()
def merged_weight(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """base + scale * B @ A computed in fp32 on base's device, cast to `dtype`."""
    a, b = a.to(base.device, torch.float32), b.to(base.device, torch.float32)
    return (base.float() + scale * (b @ a)).to(dtype)


def read_config(folder: Path) -> dict:
    """adapter_config.json, checked: a LoRA adapter whose options the merge supports, r and lora_alpha numbers."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(
            f"lora_path: {str(folder)!r} has no {CONFIG_FILE} (a PEFT adapter folder has {CONFIG_FILE} "
            f"and {WEIGHTS_FILE})"
        )
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object (peft's LoraConfig)")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg['peft_type']!r}; only LoRA adapters (peft_type 'LORA') are merged")
    for key, default in _UNSUPPORTED.items():
        value = cfg.get(key)
        if value is not None and value != default and not (default is None and value in ([], {})):
            raise ValueError(f"{path}: {key} = {value!r} is not supported by the merge (only {default!r})")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{path}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    return cfg


def read_peft_adapter(folder: str | Path, linears: Mapping[str, str], shapes: Mapping[str, torch.Size]) -> PeftAdapter:
    """Read the adapter in `folder` and check it against a model: `linears` ({module path: weight name},
    `linear_weights`) and the weights' `shapes`. ValueError naming the file and key: a target module that is no
    linear of the model, a key that is no LoRA weight of one, a lora_A without its lora_B, shapes that do not fit
    r and the weight, missing files."""
    folder = Path(folder)
    cfg = read_config(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    rank = cfg["r"]
    short = module_names(linears)
    targets = cfg.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not targets:
        raise ValueError(
            f"{config_path}: target_modules must name linear modules of the model ({short}), got "
            f"{cfg.get('target_modules')!r}"
        )
    unknown = [t for t in targets if t not in short and t not in ALL_LINEAR]
    if unknown:
        raise ValueError(f"{config_path}: target_modules {unknown} are not linear modules of the model ({short})")
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
                "or .lora_B.weight; LoRA on embeddings, DoRA and bias terms are not merged)"
            )
        if m["module"] not in linears:
            raise ValueError(f"{weights_path}: key {key!r} names {m['module']!r}, not a linear module of the model")
        halves.setdefault(m["module"], {})[m["which"]] = tensor
    if not halves:
        raise ValueError(f"{weights_path}: no LoRA weights in it")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(halves.items()):
        for which, other in (("A", "B"), ("B", "A")):
            if which not in pair:
                raise ValueError(
                    f"{weights_path}: {KEY_PREFIX}{module}.lora_{which}.weight is missing (its lora_{other} is there)"
                )
        a, b = pair["A"], pair["B"]
        out_f, in_f = shapes[linears[module]]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise ValueError(
                f"{weights_path}: {KEY_PREFIX}{module}: lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)} do not fit r = {rank} and the weight [{out_f}, {in_f}] (expected "
                f"lora_A [{rank}, {in_f}], lora_B [{out_f}, {rank}])"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(f"{weights_path}: {KEY_PREFIX}{module}: LoRA weights must be floating point")
        weights[linears[module]] = (a, b)
    return PeftAdapter(str(folder), rank, float(lora_scale(cfg)), list(targets), weights)
