"""LoRA for the native trainer (train.lora): peft's adapters on the HF model the trainer already runs.

Why peft: it is the format every serving engine reads (SGLang and vLLM load a PEFT folder) and its LoRA layers
wrap the HF `nn.Linear`s in place, so the packed forward, FSDP2 (one unit per decoder layer, adapters included)
and the losses run unchanged. We use `inject_adapter_in_model` rather than `get_peft_model`: the model keeps its
own class and module paths, with each target's weight moved to `<module>.base_layer.weight` and the adapter in
`<module>.lora_A.default.weight` / `lora_B.default.weight`.

The base is frozen in the train precision; the adapters are fp32 master weights (peft's autocast) computed in
that precision, so only they have gradients and optimizer state. The reference model of the KL penalty is the
same modules with the adapters switched off (`adapters_off`), not a second copy of the model.

At the boundary the adapter takes PEFT's file names (`base_model.model.<module>.lora_A.weight`), the merged
weights HF's: `merge_into_checkpoint` writes W + (alpha / r) B A for every target, streaming the base model's
safetensors files one at a time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from rlflow.engines.core.config import LoraConfig

PEFT_PREFIX = "base_model.model."
ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"


def add_adapters(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Wrap `model`'s target linears with fresh adapters (A random, B zero: the model computes what the base
    does) and freeze everything else."""
    model.requires_grad_(False)
    inject_adapter_in_model(PeftLoraConfig(**peft_fields(cfg)), model)
    for name, p in model.named_parameters():
        if is_adapter(name):
            p.data = p.data.float()  # fp32 masters whatever the base's dtype; FSDP2 computes in train.precision
            p.requires_grad_(True)


def peft_fields(cfg: LoraConfig) -> dict:
    """The LoraConfig fields peft takes (adapter_config.json holds these plus its type)."""
    return {k: v for k, v in cfg.peft_config().items() if k not in ("peft_type", "task_type")}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_name(name: str) -> str:
    """A parameter's name in the model ('...q_proj.lora_A.default.weight') as PEFT files name it
    ('base_model.model....q_proj.lora_A.weight')."""
    return PEFT_PREFIX + name.replace(".default.", ".")


@contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model: every adapter skipped for the duration (the KL penalty's reference policy)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], cfg: LoraConfig, base_model: str) -> int:
    """A PEFT adapter folder from the adapter's (model-named, full) tensors; returns the weights' bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = {peft_name(n): t.detach().cpu().contiguous() for n, t in tensors.items()}
    save_file(weights, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(cfg.peft_config() | {"base_model_name_or_path": base_model},
                                                 indent=2))
    return sum(t.numel() * t.element_size() for t in weights.values())


def read_adapter(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json and the adapter's tensors (PEFT names) of a PEFT folder."""
    for f in (CONFIG_FILE, ADAPTER_FILE):
        if not (folder / f).is_file():
            raise FileNotFoundError(f"LoRA adapter {folder}: no {f} (expected a PEFT adapter folder)")
    return json.loads((folder / CONFIG_FILE).read_text()), load_file(str(folder / ADAPTER_FILE))


Delta = tuple[torch.Tensor, torch.Tensor, float]  # A [r, in], B [out, r], scale


def merged_deltas(config: dict, weights: dict[str, torch.Tensor]) -> dict[str, Delta]:
    """HF weight name -> (A [r, in], B [out, r], scale) for every adapted linear of a PEFT adapter."""
    scale = config["lora_alpha"] / (config["r"] ** 0.5 if config.get("use_rslora") else config["r"])
    out = {}
    for key, a in weights.items():
        if ".lora_A." not in key:
            continue
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in weights:
            raise ValueError(f"LoRA adapter: {key} has no {b_key}")
        module = key.removeprefix(PEFT_PREFIX).split(".lora_A.")[0]
        out[f"{module}.weight"] = (a, weights[b_key], scale)
    return out


def merge_into_checkpoint(base_dir: Path, adapter_dir: Path, out_dir: Path) -> None:
    """The base model of `base_dir` with the adapter of `adapter_dir` merged, as an HF checkpoint in `out_dir`:
    each safetensors file of the base is read, its adapted weights replaced by W + scale B A (in fp32, stored
    in the file's dtype) and written under the same name; the other files are copied. One file in memory."""
    config, weights = read_adapter(adapter_dir)
    deltas = merged_deltas(config, weights)
    out_dir.mkdir(parents=True, exist_ok=True)
    seen = set()
    for f in sorted(base_dir.iterdir()):
        if f.is_dir():
            continue
        if f.suffix != ".safetensors":
            shutil.copyfile(f, out_dir / f.name)
            continue
        tensors = load_file(str(f))
        for name in tensors.keys() & deltas.keys():
            a, b, scale = deltas[name]
            w = tensors[name]
            tensors[name] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
            seen.add(name)
        save_file(tensors, str(out_dir / f.name), metadata={"format": "pt"})
    missing = sorted(deltas.keys() - seen)
    if missing:
        raise ValueError(f"LoRA adapter {adapter_dir}: the base model in {base_dir} has no weight {missing[0]} "
                         f"(and {len(missing) - 1} more)")
