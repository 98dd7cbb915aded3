"""LoRA for the native trainer (train.lora): peft's adapters on the HF model the trainer already runs.

Why peft: it is the format every serving engine reads (SGLang and vLLM load a PEFT folder) and its LoRA layers
wrap the HF `nn.Linear`s in place, so the packed forward, FSDP2 (one unit per decoder layer, adapters included)
and the losses run unchanged. We use `inject_adapter_in_model` rather than `get_peft_model`: the model keeps its
own class and module paths, with each target's weight moved to `<module>.base_layer.weight` and the adapter in
`<module>.lora_A.default.weight` / `lora_B.default.weight`.

The base is frozen in the train precision; the adapters are fp32 master weights computed in that precision
(`adapter_compute`: autocast casts them, once per forward, as FSDP2's policy casts a full model's weights), so
only they have gradients and optimizer state. The reference model of the KL penalty is the
same modules with the adapters switched off (`adapters_off`), not a second copy of the model.

At the boundary the adapter takes PEFT's file names (`base_model.model.<module>.lora_A.weight`), the merged
weights HF's: `merge_into_checkpoint` writes W + (alpha / r) B A for every target, streaming the base model's
safetensors files one at a time, with the reader and merge of engines/models/peft_adapter.py that the embedded
rollout engine uses (so an exported model and the rollout engine's weights are the same numbers).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rlflow.engines.core.config import LoraConfig
from rlflow.engines.models.peft_adapter import CONFIG_FILE, KEY_PREFIX, WEIGHTS_FILE, merged_weight, read_peft_adapter


def add_adapters(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Wrap `model`'s target linears with fresh adapters (A random, B zero: the model computes what the base
    does) and freeze everything else."""
    model.requires_grad_(False)
    inject_adapter_in_model(PeftLoraConfig(**peft_fields(cfg)), model)
    for name, p in model.named_parameters():
        if is_adapter(name):
            p.data = p.data.float()  # fp32 masters whatever the base's dtype; adapter_compute runs them in its own
            p.requires_grad_(True)
    for m in model.modules():  # peft would cast each adapter's input up to fp32: extra passes over activations
        if isinstance(m, LoraLayer):
            m.cast_input_dtype_enabled = False


def adapter_compute(device: str, dtype: torch.dtype) -> AbstractContextManager:
    """Where a LoRA model's forward runs: in `dtype` (the frozen base's), the fp32 adapters cast to it by
    autocast. Measured on an H100 (docs/lora.md): with the adapters' GEMMs and the sums into the base's outputs
    in fp32, a 1.5B LoRA step was 0.71x a full fine-tuning step; the issue's "trained in bf16" is this."""
    return nullcontext() if dtype == torch.float32 else torch.autocast(device_type=device, dtype=dtype)


def peft_fields(cfg: LoraConfig) -> dict:
    """The LoraConfig fields peft takes (adapter_config.json holds these plus its type)."""
    return {k: v for k, v in cfg.peft_config().items() if k not in ("peft_type", "task_type")}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_name(name: str) -> str:
    """A parameter's name in the model ('...q_proj.lora_A.default.weight') as PEFT files name it
    ('base_model.model....q_proj.lora_A.weight')."""
    return KEY_PREFIX + name.replace(".default.", ".")


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
    save_file(weights, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(cfg.peft_config() | {"base_model_name_or_path": base_model},
                                                 indent=2))
    return sum(t.numel() * t.element_size() for t in weights.values())


def merge_into_checkpoint(base_dir: Path, adapter_dir: Path, out_dir: Path) -> None:
    """The base model of `base_dir` with the adapter of `adapter_dir` merged, as an HF checkpoint in `out_dir`:
    each safetensors file of the base is read, its adapted weights replaced by W + scale B A (in fp32, stored
    in the file's dtype) and written under the same name; the other files are copied. One file in memory."""
    files = sorted(f for f in base_dir.iterdir() if f.is_file())
    shapes = {}
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as st:
                shapes |= {k: torch.Size(st.get_slice(k).get_shape()) for k in st.keys()}  # noqa: SIM118
    linears = {k.removesuffix(".weight"): k for k, shape in shapes.items() if k.endswith(".weight") and len(shape) == 2}
    adapter = read_peft_adapter(adapter_dir, linears, shapes)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in files:
        if f.suffix != ".safetensors":
            shutil.copyfile(f, out_dir / f.name)
            continue
        tensors = load_file(str(f))
        for name in tensors.keys() & adapter.weights.keys():
            a, b = adapter.weights[name]
            tensors[name] = merged_weight(tensors[name], a, b, adapter.scale, tensors[name].dtype)
        save_file(tensors, str(out_dir / f.name), metadata={"format": "pt"})
