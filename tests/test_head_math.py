"""The LM head's per-chunk math (engines/models/head_math.py): the compiled kernels the GPU trainer runs
(train.fused_head) compute what the eager functions do, and the hand-written gradient is autograd's."""

import pytest
import torch

from rlflow.engines.models.head_math import compiled, head_logits_grad, head_logprobs


def _inputs(n: int = 37, vocab: int = 300, m: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n, m), generator=g)
    return logits, targets, torch.randn(n, m, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize(("temperature", "m"), [(1.0, 1), (0.7, 1), (0.7, 3)])
def test_hand_written_gradient_is_autograds(temperature, m):
    """One target per token (the policy's), or several (top-k distillation's), with entropy in the loss."""
    logits, targets, g_lp, g_h = _inputs(m=m)
    z = logits.float().requires_grad_()
    logp, _, entropy = head_logprobs(z, targets, temperature, True)
    ((logp * g_lp).sum() + (entropy * g_h).sum()).backward()
    _, lse, entropy = head_logprobs(logits, targets, temperature, True)
    got = head_logits_grad(logits.float(), targets, lse, entropy, g_lp, g_h, temperature)
    assert torch.allclose(got, z.grad, atol=1e-6)


@pytest.mark.parametrize("m", [1, 2])
def test_compiled_kernels_equal_the_eager_math(m):
    """torch.compile (inductor's C++ backend here, Triton on CUDA) of the same functions, on two chunk lengths
    (dynamic shapes: one compile serves both)."""
    for n in (37, 53):
        logits, targets, g_lp, g_h = _inputs(n, m=m)
        eager = head_logprobs(logits, targets, 0.7, True)
        fused = compiled(head_logprobs)(logits, targets, 0.7, True)
        for a, b in zip(eager, fused, strict=True):
            assert torch.allclose(a, b, atol=1e-5), (n, (a - b).abs().max())
        want = head_logits_grad(logits, targets, eager[1], eager[2], g_lp, g_h, 0.7)
        got = compiled(head_logits_grad)(logits, targets, eager[1], eager[2], g_lp, g_h, 0.7)
        assert got.dtype == torch.bfloat16
        assert torch.allclose(want.float(), got.float(), atol=1e-4, rtol=8e-3)  # one bf16 rounding apart


@pytest.mark.parametrize("with_entropy", [False, True])
def test_logits_given_by_a_model_take_the_same_math_chunk_by_chunk(with_entropy):
    """ChunkedLogitsLogprobs (the Megatron backend at tensor parallel 1: its output layer made the logits) gives
    algorithms' log-probs and entropy and autograd's gradient of the logits, over chunks that do not divide the
    tokens."""
    from rlflow.engines.core.algorithms import entropy_from_logits, token_logprobs  # the reference math
    from rlflow.engines.models.packed import ChunkedLogitsLogprobs

    logits, targets, g_lp, g_h = _inputs(m=1)
    ref = logits.float().requires_grad_()
    want_lp = token_logprobs(ref / 0.7, targets[:, 0])
    want_h = entropy_from_logits(ref / 0.7)
    ((want_lp * g_lp[:, 0]).sum() + ((want_h * g_h).sum() if with_entropy else 0)).backward()
    z = logits.float().requires_grad_()
    lp, h = ChunkedLogitsLogprobs.apply(z, targets, 0.7, 10, with_entropy, False)
    ((lp * g_lp[:, 0]).sum() + ((h * g_h).sum() if with_entropy else 0)).backward()
    assert (lp - want_lp).abs().max() <= 1e-5
    assert not with_entropy or (h - want_h).abs().max() <= 1e-5
    assert torch.allclose(z.grad, ref.grad, atol=1e-6)
