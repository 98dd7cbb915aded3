"""train.kernels: the fused-kernel option is refused where it cannot run, with errors naming the field.

The liger kernels themselves are Triton (CUDA only): their speed and their agreement with HF's modules are
measured on a GPU by bench/train/scale.py (variant rlflow-8k-liger) and bench/train/fsdp_check.py."""

from __future__ import annotations

import sys

import pytest
from conftest import small_recipe
from pydantic import ValidationError

from rlflow.engines.core.config import RLConfig
from rlflow.engines.models.hf import load_model
from rlflow.engines.train.kernels import apply_kernels


def test_liger_is_refused_on_cpu_training(tmp_path) -> None:
    with pytest.raises(ValidationError, match="train.kernels: liger .* train.device 'cuda'"):
        RLConfig.model_validate(small_recipe(tmp_path, train={"steps": 1, "kernels": "liger"}))


def test_liger_with_layer_compile_is_refused(tmp_path) -> None:
    """torch.compile cannot trace liger's autograd functions (it failed in the first forward on an H100)."""
    with pytest.raises(ValidationError, match="train.kernels: liger's kernels .* torch.compile"):
        RLConfig.model_validate(small_recipe(tmp_path, train={"steps": 1, "device": "cuda", "kernels": "liger",
                                                              "compile": True}))


def test_torch_kernels_leave_the_model_as_loaded(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir)
    forwards = [type(m).forward for m in model.modules()]
    apply_kernels(model, "torch")
    assert [type(m).forward for m in model.modules()] == forwards
    assert all("forward" not in vars(m) for m in model.modules())


def test_liger_names_the_missing_package(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as on a machine without the extra
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(RuntimeError, match=r"train.kernels: liger needs the liger-kernel package"):
        apply_kernels(load_model(tiny_model_dir), "liger")


def test_liger_names_an_unwired_model_type(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir)
    model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match=r"train.kernels: liger is wired for .* the model is 'gpt2'"):
        apply_kernels(model, "liger")
