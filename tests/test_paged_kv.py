"""The embedded engine's paged KV cache: attention over pages, the page allocator, prefix sharing for GRPO groups,
preemption when the pool runs out, chunked prefill, and contexts past the old 4,096-token constant."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlflow.engines.core.config import KVCacheConfig, ModelConfig
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models.hf import build_tiny_model, rollout_context
from rlflow.engines.models.kv_pages import PageAllocator
from rlflow.engines.models.paged_attention import paged_decode_attention, store_kv
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend

PROMPTS = [[1, 5, 6, 7, 15], [1, 9, 15], [1, 4, 4, 8, 9, 10, 15], [1, 6, 6, 6, 6, 7], [1, 12], [1, 3, 5, 7, 9, 11]]


def _backend(model_dir: str, batch_size: int = 8, **kv) -> TorchRolloutBackend:
    return TorchRolloutBackend(model_dir, threads=1, batch_size=batch_size, trace=True, kv_cache=KVCacheConfig(**kv))


def _hf_logprobs(backend: TorchRolloutBackend, gen, temperature: float) -> torch.Tensor:
    """Teacher-forced logprobs of the generated tokens under the HF forward of the same weights."""
    ids = torch.tensor([gen.prompt_ids + gen.output_ids])
    with torch.no_grad():
        logits = backend.model(ids).logits[0, len(gen.prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp.gather(-1, ids[0, len(gen.prompt_ids) :, None])[:, 0]


def _assert_same(a, b, tol: float = 1e-5) -> None:
    assert [g.output_ids for g in a] == [g.output_ids for g in b]
    assert [g.finish_reason for g in a] == [g.finish_reason for g in b]
    for x, y in zip(a, b, strict=True):
        assert max((abs(p - q) for p, q in zip(x.output_logprobs, y.output_logprobs, strict=True)), default=0) < tol


def test_paged_decode_attention_matches_dense_attention():
    """Rows whose tokens lie in scattered pages attend exactly as dense SDPA over their own tokens (GQA: 4 query
    heads on 2 KV heads); store_kv writes each row's new key where its page table says."""
    torch.manual_seed(0)
    pages, kv, size, d, h = 9, 2, 4, 8, 4
    k_pool, v_pool = torch.randn(pages, kv, size, d), torch.randn(pages, kv, size, d)
    table = torch.tensor([[3, 7, 1], [5, 0, 0], [8, 2, 6]], dtype=torch.int32)
    lengths = torch.tensor([10, 1, 12], dtype=torch.int32)
    new_k, new_v = torch.randn(3, kv, d), torch.randn(3, kv, d)
    store_kv(k_pool, v_pool, table, (lengths - 1).long(), new_k, new_v)
    assert torch.equal(k_pool[1, :, 1], new_k[0]) and torch.equal(v_pool[6, :, 3], new_v[2])
    q = torch.randn(3, h, d)
    out = paged_decode_attention(q, k_pool, v_pool, table, lengths, d**-0.5)
    for b in range(3):
        n = int(lengths[b])
        keys = k_pool[table[b].long()].permute(1, 0, 2, 3).reshape(kv, -1, d)[:, :n]
        values = v_pool[table[b].long()].permute(1, 0, 2, 3).reshape(kv, -1, d)[:, :n]
        ref = F.scaled_dot_product_attention(
            q[b][:, None], keys.repeat_interleave(h // kv, 0), values.repeat_interleave(h // kv, 0)
        )[:, 0]
        assert (out[b] - ref).abs().max() < 1e-6


def test_page_allocator_counts_holders():
    alloc = PageAllocator(5)  # page 0 is scratch: 4 to hand out
    a = alloc.alloc(3)
    assert 0 not in a and alloc.num_free == 1 and alloc.alloc(2) is None and alloc.num_free == 1
    alloc.share(a[:2])
    alloc.release(a)
    assert alloc.num_free == 2 and alloc.refs(a[0]) == 1  # the shared pages still have a holder
    alloc.release(a[:2])
    assert alloc.num_free == 4 and alloc.peak_used == 3
    with pytest.raises(RuntimeError, match="released but not held"):
        alloc.release([a[0]])


def test_paged_outputs_match_hf_and_an_unbounded_pool(tiny_model_dir):
    """Small pages in a small pool give, token for token, what a pool that never runs short gives, and every
    logprob is the HF forward's on the generated sequence (fp32)."""
    p = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, ignore_eos=True)
    big = _backend(tiny_model_dir, page_size=64, tokens=8192)
    paged = _backend(tiny_model_dir, page_size=4, tokens=256)
    ref, out = big.generate(PROMPTS * 2, p, seed=3), paged.generate(PROMPTS * 2, p, seed=3)
    _assert_same(ref, out)
    assert max(float((_hf_logprobs(paged, g, 1.0) - torch.tensor(g.output_logprobs)).abs().max()) for g in out) <= 1e-5
    assert paged.engine.stats()["kv_pages_used"] == 0  # every page came back
    big.close()
    paged.close()


def test_group_shares_prompt_pages(tiny_model_dir):
    """A GRPO group of 8 prefills its prompt once: the samples are those of unshared prefills, and the pages
    they took are within 1.3x of one prompt plus 8 responses (8 prompts without sharing)."""
    prompt, new, size = [1, *range(4, 18), *range(4, 12)], 6, 2  # 23 tokens: a partial last page to copy
    p = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, n=8)
    shared, alone = (
        _backend(tiny_model_dir, page_size=size),
        _backend(tiny_model_dir, page_size=size, share_prompts=False),
    )
    a, b = shared.generate([prompt], p, seed=5), alone.generate([prompt], p, seed=5)
    _assert_same(a, b)
    assert len({tuple(g.output_ids) for g in a}) > 1  # the samples differ: each has its own random stream
    pages = lambda n: -(-n // size)  # noqa: E731
    budget = pages(len(prompt)) + 8 * pages(new)
    used, unshared = shared.engine.stats()["kv_pages_peak"], alone.engine.stats()["kv_pages_peak"]
    assert used <= 1.3 * budget, (used, budget)
    assert unshared == 8 * pages(len(prompt) + new), unshared  # each its own prompt
    shared.close()
    alone.close()


def test_preemption_loses_nothing_and_changes_nothing(tiny_model_dir):
    """A pool far too small for the batch: requests are preempted (counted, traced) and recomputed, every one
    finishes, with the tokens and logprobs of a run that never ran short."""
    p = SamplingParams(max_new_tokens=20, temperature=1.0, ignore_eos=True)
    tight = _backend(tiny_model_dir, page_size=4, tokens=40)  # 10 pages; the batch needs ~40
    roomy = _backend(tiny_model_dir, page_size=4)
    out, ref = tight.generate(PROMPTS, p, seed=9), roomy.generate(PROMPTS, p, seed=9)
    assert all(g.finish_reason == {"type": "length", "length": 20} for g in out)
    _assert_same(ref, out)
    stats = tight.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_pages_used"] == 0 and roomy.engine.stats()["num_preemptions"] == 0
    events = tight.drain_trace()
    assert sum(e["name"] == "preempt" for e in events) == stats["num_preemptions"]
    tight.close()
    roomy.close()


def test_chunked_prefill_is_exact_and_interleaves_with_decodes(tiny_model_dir):
    """Prefilled 3 tokens a step, prompts give the outputs of whole prefills; a long prompt that arrives while
    another request decodes does not stall it: the running request gets a token every step of the prefill."""
    p = SamplingParams(max_new_tokens=8, temperature=0.8, ignore_eos=True)
    chunked, whole = _backend(tiny_model_dir, page_size=4, prefill_chunk_tokens=3), _backend(tiny_model_dir)
    _assert_same(whole.generate(PROMPTS, p, seed=2), chunked.generate(PROMPTS, p, seed=2))

    runner = chunked.requests([PROMPTS[0]], SamplingParams(max_new_tokens=24, ignore_eos=True), seed=1)[0]
    long = chunked.requests([[1, *range(4, 18), *range(4, 11)]], SamplingParams(max_new_tokens=2), seed=2)[0]
    joined_at: list[int] = []
    runner.on_token = lambda r: chunked.engine.submit([long]) if len(r.output_ids) == 2 else None
    long.on_token = lambda r: joined_at.append(len(runner.output_ids)) if len(r.output_ids) == 1 else None
    chunked.engine.submit([runner])
    runner.future.result(timeout=60)
    long.future.result(timeout=60)
    # 22 prompt tokens, 3 a step: 8 steps, the runner sampling in each (a whole prefill: its first token at 3)
    assert joined_at == [2 + 8]
    chunked.close()
    whole.close()


def test_context_past_4096_tokens(tmp_path):
    """A model with 8,192 positions generates after a 4,600-token prompt (prefilled in 2,048-token chunks), its
    logprobs those of the HF forward; the recipe's context is the model's, not a constant."""
    cfg = ModelConfig(
        arch="qwen2", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=8192
    )
    path = str(build_tiny_model(cfg, tmp_path / "long", seed=0))
    assert rollout_context(cfg.model_copy(update={"path": path}), "torch")[0] == 8192
    backend = _backend(path, batch_size=2, page_size=16, prefill_chunk_tokens=2048)
    assert backend.engine.max_len == 8192
    g = torch.Generator().manual_seed(0)
    prompt = [1, *torch.randint(4, 18, (4599,), generator=g).tolist()]
    gen = backend.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True), seed=1)[0]
    assert len(gen.output_ids) == 6
    assert float((_hf_logprobs(backend, gen, 1.0) - torch.tensor(gen.output_logprobs)).abs().max()) <= 1e-5
    backend.close()


def test_prompt_longer_than_the_pool_is_refused(tiny_model_dir):
    backend = _backend(tiny_model_dir, page_size=4, tokens=16)
    assert backend.engine.max_len == 16  # the pool caps the context below the model's 32 positions
    with pytest.raises(ValueError, match="input_ids: the prompt has 20 tokens, the context holds 16"):
        backend.generate([[1] * 20], SamplingParams(max_new_tokens=2))
    backend.close()


def test_abort_during_a_shared_chunked_prefill_frees_its_pages(tiny_model_dir):
    """A sample of a group aborted while the group's prompt is still being prefilled in chunks returns at once
    with nothing; its group-mates generate what they would have, and every page comes back."""
    backend = _backend(tiny_model_dir, page_size=4, prefill_chunk_tokens=3)
    prompt = [1, *range(4, 18), *range(4, 11)]
    group = SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True, n=4)
    runner = backend.requests([PROMPTS[0]], SamplingParams(max_new_tokens=12, ignore_eos=True), seed=1)[0]
    members = backend.requests([prompt], group, seed=4, rid="g")

    def on_token(r):
        if len(r.output_ids) == 2:
            backend.engine.submit(members)
        if len(r.output_ids) == 4:  # the group's 22 prompt tokens take 8 steps: it is mid-prefill
            assert all(not m.output_ids for m in members)
            backend.engine.abort("g_1")

    runner.on_token = on_token
    backend.engine.submit([runner])
    gens = [m.future.result(timeout=60) for m in members]
    assert gens[1].finish_reason == {"type": "abort", "message": "Aborted by request"}  # admitted, not waiting
    assert gens[1].output_ids == []
    alone = backend.generate([prompt], group, seed=4)
    _assert_same([gens[i] for i in (0, 2, 3)], [alone[i] for i in (0, 2, 3)])
    runner.future.result(timeout=60)
    assert backend.engine.stats()["kv_pages_used"] == 0 and backend.engine.num_requests() == 0
    backend.close()
