"""The grouped-matmul MoE experts (engines/models/grouped_experts.py) against transformers' own expert modules
(Qwen3-MoE, Mixtral; their eager loop over experts), in fp32 on CPU: outputs and every gradient within 1e-5."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from rlflow.engines.models.grouped_experts import _grouped_forward, experts_forward, grouped_mm, route_order

TOL = 1e-5
EXPERTS, TOP_K, HIDDEN, WIDTH = 8, 2, 32, 16


def eager_experts(kind: str) -> torch.nn.Module:
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts=EXPERTS,
                             num_experts_per_tok=TOP_K)
        cls = Qwen3MoeExperts
    else:
        cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=WIDTH, num_local_experts=EXPERTS,
                            num_experts_per_tok=TOP_K)
        cls = MixtralExperts
    cfg._experts_implementation = "eager"  # transformers' loop over experts: the reference
    module = cls(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module


def routing(tokens: int, generator: torch.Generator, skip: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, EXPERTS, generator=generator)
    if skip is not None:
        logits[:, skip] = -1e9  # an expert no token reaches: an empty group
    weights, index = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("tokens, skip", [(37, None), (5, 3), (1, None)])
def test_grouped_experts_match_transformers_in_values_and_gradients(kind, tokens, skip):
    g = torch.Generator().manual_seed(tokens)
    ref = eager_experts(kind)
    index, weights = routing(tokens, g, skip)
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    grad_out = torch.randn(tokens, HIDDEN, generator=g)

    def run(fn):
        h = hidden.clone().requires_grad_()
        w = weights.clone().requires_grad_()
        params = [ref.gate_up_proj, ref.down_proj]
        for p in params:
            p.grad = None
        out = fn(h, w)
        out.backward(grad_out)
        return out.detach(), h.grad, w.grad, *(p.grad.clone() for p in params)

    expected = run(lambda h, w: ref(h, index, w))
    got = run(lambda h, w: experts_forward(h, index, w, ref.gate_up_proj, ref.down_proj, ref.act_fn))
    for name, a, b in zip(("output", "d hidden", "d routing weights", "d gate_up_proj", "d down_proj"), got,
                          expected, strict=True):
        assert (a - b).abs().max().item() <= TOL, name


def test_the_route_order_groups_pairs_by_expert_without_a_host_sync():
    """Sorted (token, slot) pairs and cumulative counts; an expert with no token has an empty group."""
    index = torch.tensor([[2, 0], [2, 1], [0, 2]])
    order, offsets = route_order(index, num_experts=4)
    assert index.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 2]
    assert offsets.tolist() == [2, 3, 6, 6] and offsets.dtype == torch.int32
    for d_in, d_out in ((4, 8), (3, 2)):  # torch's kernel (16-byte rows), the reference loop
        x, w = torch.randn(6, d_in), torch.randn(4, d_in, d_out)
        out = grouped_mm(x, w, offsets)
        assert torch.allclose(out, torch.cat([x[:2] @ w[0], x[2:3] @ w[1], x[3:] @ w[2]]), atol=1e-6)
    x = torch.randn(6 * 4 + 1)[1:].view(6, 4)  # 4 bytes past an aligned address (a view into a flat buffer)
    assert torch.allclose(grouped_mm(x, w := torch.randn(4, 4, 8), offsets),
                          torch.cat([x[:2] @ w[0], x[2:3] @ w[1], x[3:] @ w[2]]), atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_load_model_runs_grouped_experts_and_gives_transformers_logits_and_gradients(tmp_path, arch):
    """load_model (the trainer's and the engine's) puts every MoE layer's experts on the grouped path; the model's
    logits and its parameters' gradients stay transformers' own (eager) within 1e-5 in fp32."""
    from transformers import AutoModelForCausalLM

    from rlflow.engines.models.hf import load_model
    from tests.test_engines import _arch_model

    path = _arch_model(tmp_path, arch)
    ours, eager = load_model(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    moe_layers = sum(1 for layer in eager.model.layers if hasattr(layer.mlp, "experts"))
    assert use_grouped_experts_count(ours) == moe_layers >= 1
    ids = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (ours, eager):
        model.zero_grad()
        logits = model(ids).logits
        (logits.float().log_softmax(-1)[..., 0].sum()).backward()
        grads.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert (grads[0][0] - grads[1][0]).abs().max().item() <= TOL
    assert grads[0][1].keys() == grads[1][1].keys()
    for name in grads[0][1]:
        assert (grads[0][1][name] - grads[1][1][name]).abs().max().item() <= TOL, name


def use_grouped_experts_count(model: torch.nn.Module) -> int:
    """How many experts modules of `model` run the grouped function."""
    return sum(1 for m in model.modules() if getattr(getattr(m, "forward", None), "__func__", None) is _grouped_forward)
