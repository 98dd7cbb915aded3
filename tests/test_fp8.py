"""FP8 rollout (rollout.precision fp8): the e4m3 weight store, the decoder on it, quantize-on-receipt updates and the
refusals. `torch._scaled_mm` runs on the CPU in torch 2.13, so the decoder's fp8 path is checked here in fp32 against
HF's forward on the dequantized weights; the engine itself refuses the CPU (decode speed is the point), and the GPU
figures are bench/rollout/fp8_decode.py's."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from rlflow.engines.models.decoder import DecoderLM
from rlflow.engines.models.fp8 import E4M3_MAX, GROUPS, dequantize_rows, fp8_linear, quantize_rows
from rlflow.engines.models.hf import load_model
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from tests.test_engines import _arch_model

PROJECTIONS = tuple(f".{m}.weight" for _, members, _ in GROUPS for m in members)


def test_quantize_round_trip_keeps_each_row_within_e4m3_precision():
    torch.manual_seed(0)
    w = torch.randn(64, 48) * torch.logspace(-3, 2, 64)[:, None]  # rows five decades apart
    w[7] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    assert torch.equal(q.float().abs().amax(-1)[torch.arange(64) != 7], torch.full((63,), E4M3_MAX))
    back = dequantize_rows(q, scale)
    assert torch.equal(back[7], torch.zeros(48))
    # e4m3 keeps 3 mantissa bits: a normal value is within 2^-4 of itself; near zero the row's step (scale / 2^9)
    err = (back - w).abs()
    assert (err <= w.abs() / 16 + scale[:, None] * 2**-9 + 1e-12).all()


def test_fp8_linear_matches_the_dequantized_product():
    torch.manual_seed(1)
    x, w, b = torch.randn(5, 3, 32), torch.randn(48, 32), torch.randn(48)
    q, scale = quantize_rows(w)
    xq, xs = quantize_rows(x.reshape(-1, 32))  # the per-token activation scales fp8_linear takes
    want = (dequantize_rows(xq, xs) @ dequantize_rows(q, scale).T + b).view(5, 3, 48)
    got = fp8_linear(x, q, scale, b)
    assert got.shape == (5, 3, 48)
    assert (got - want).abs().max() < 1e-4
    assert (got - (x @ w.T + b)).abs().max() < 0.1 * (x @ w.T).abs().max()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_decoder_on_fp8_weights_matches_hf_on_the_dequantized_weights(tmp_path, arch):
    """Qwen2 (q/k/v biases) and Qwen3-MoE (an MoE layer, whose experts stay in the model dtype): the bf16 copies of
    the projections are freed, and the logits are HF's on dequantized weights up to the activations' rounding."""
    path = _arch_model(tmp_path, arch)
    hf = load_model(path).eval()
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(PROJECTIONS):
                p.copy_(dequantize_rows(*quantize_rows(p)))
    lm = DecoderLM(hf)
    fp8 = lm.quantize_fp8()
    assert hf.model.layers[0].self_attn.q_proj.weight.numel() == 0  # no bf16 copy held
    assert "model.layers.0.self_attn.q_proj.bias" in fp8.names or arch != "qwen2"
    assert ("model.layers.0.mlp.gate_proj.weight" in fp8.names) == (arch == "qwen2")  # MoE layer 0: experts
    cache = lm.new_cache(rows=2, max_len=32, num_pages=8, page_size=4)
    prompt = [1, 5, 9, 2, 7, 3, 3, 8]
    with torch.no_grad():
        got = lm.prefill(cache, [prompt], [0], [[0, 1]])[0]
        want = ref(torch.tensor([prompt])).logits[0, -1]
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_weight_updates_are_quantized_on_receipt(tmp_path):
    hf = load_model(_arch_model(tmp_path, "qwen2")).eval()
    lm = DecoderLM(hf)
    fp8 = lm.quantize_fp8()
    torch.manual_seed(3)
    sent = {n: torch.randn(fp8.shape_of(n), dtype=torch.bfloat16) for n in sorted(fp8.names)}
    before = lm.weight_pointers()
    for name, t in sent.items():
        fp8.write(name, t)
    assert lm.weight_pointers() == before  # written in place: a captured decode graph stays valid
    for name, t in sent.items():
        want = t.float() if name.endswith(".bias") else dequantize_rows(*quantize_rows(t))
        assert torch.equal(fp8.read(name, torch.float32), want), name
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight.*expected"):
        fp8.write("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3))
    fp8.release()
    assert fp8.nbytes() == 0
    fp8.allocate()
    assert fp8.nbytes() == sum(t.numel() for n, t in sent.items() if n.endswith(".weight")) + 4 * sum(
        t.shape[0] for n, t in sent.items() if n.endswith(".weight")) + 4 * sum(
        t.numel() for n, t in sent.items() if n.endswith(".bias"))


def test_the_cpu_engine_refuses_fp8(tiny_model_dir):
    with pytest.raises(ValueError, match="rollout.precision fp8: needs rollout.device cuda"):
        TorchRolloutBackend(tiny_model_dir, device="cpu", dtype=torch.bfloat16, fp8=True)


def test_config_fp8_turns_correction_on_and_refuses_what_it_cannot_serve(recipe):
    gpu = {"train": {"device": "cuda", "threads": 1}, "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4,
                                                                   "max_new_tokens": 4, "precision": "fp8"}}
    assert recipe(**gpu).algorithm.is_correction == "tis"
    with pytest.warns(UserWarning, match="fp8 .* nothing corrects"):
        assert recipe(**gpu, algorithm={"is_correction": "none"}).algorithm.is_correction == "none"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert recipe(**gpu, algorithm={"rejection": "token"}).algorithm.rejection == "token"
    refusals = [
        (dict(gpu, train={"device": "cpu"}), "needs rollout.device cuda"),
        (dict(gpu, rollout={**gpu["rollout"], "backend": "sglang"}), r"quantization: fp8"),
        (dict(gpu, weight_sync={"transport": "nccl"}), "weight_sync.transport nccl with rollout.precision fp8"),
        (dict(gpu, train={"device": "cuda", "num_workers": 2}, weight_sync={"transport": "cuda_ipc"}),
         "cuda_ipc with one train worker"),
    ]
    for sections, message in refusals:
        with pytest.raises(ValueError, match=message):
            recipe(**sections)
