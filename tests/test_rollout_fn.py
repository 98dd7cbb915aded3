"""Rollout functions (engines/rollout/functions.py), dynamic sampling (engines/rollout/dynamic_sampling.py) and the
examples, against real embedded servers behind the real router; nothing is mocked."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from rlflow.engines.core.config import config_from_dict
from rlflow.engines.core.protocols import RolloutBackend
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.rollout.dynamic_sampling import Carry, collect_groups
from rlflow.engines.rollout.functions import PromptSample, RolloutRunner, Sample, load_rollout_fn, single_turn
from rlflow.engines.rollout.router import RolloutRouter
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.stages.train_batch import pack
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.sync.endpoints import GpuLinkProbe
from tests.conftest import small_recipe

TOKEN = "run-token"
PARAMS = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop": []}


@pytest.fixture
def served(tiny_model_dir):
    """Two embedded servers behind one router, their control routes behind TOKEN as in a run; slots kept few so
    that requests queue."""
    backends = [TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=4) for _ in range(2)]
    router = RolloutRouter([b.start_server(token=TOKEN) for b in backends], token=TOKEN)
    yield backends, router.url
    router.stop()
    for b in backends:
        b.close()


def _prompts(backend, texts: list[str], n: int, seed: int = 11) -> list[PromptSample]:
    tok = backend.tokenizer
    return [PromptSample(index=i, prompt=t, label="", prompt_ids=tok(t)["input_ids"], n=n, seed=seed + 100 * i,
                         tokenizer=tok) for i, t in enumerate(texts)]


def test_single_turn_over_http_equals_the_engine_called_directly(served):
    """The default rollout goes through the router, batched; every sample is what the engine generates for
    the same prompt and sampling seed, tokens and logprobs."""
    backends, url = served
    runner = RolloutRunner(single_turn, url, [b.server_url() for b in backends], token=TOKEN)
    try:
        prompts = _prompts(backends[0], ["S123=", "S907=", "R55="], n=3)
        groups = runner.run(prompts, PARAMS)
    finally:
        runner.close()
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    for p, group in zip(prompts, groups, strict=True):
        assert len(group) == 3
        for j, s in enumerate(group):
            direct = backends[1].generate([p.prompt_ids], params, seed=p.seed + j)[0]
            assert s.response_ids == direct.output_ids
            assert s.logprobs == pytest.approx(direct.output_logprobs, abs=1e-6)
            assert s.weight_version == 0 and s.loss_mask is None and s.finish_reason in ("stop", "length")


async def _three_samples(prompt, router_url, sampling_params):
    return [Sample(response_ids=[5])] * 3


def rollout_that_is_not_async(prompt, router_url, sampling_params):
    return []


def test_a_bad_rollout_function_gets_an_error_naming_the_field(served):
    with pytest.raises(ValueError, match=r"rollout\.fn: cannot import module 'no_such.module'"):
        load_rollout_fn("no_such.module:fn")
    with pytest.raises(TypeError, match=r"rollout\.fn: .* must be an async function"):
        load_rollout_fn("tests.test_rollout_fn:rollout_that_is_not_async")
    backends, url = served
    runner = RolloutRunner(_three_samples, url, [b.server_url() for b in backends], token=TOKEN)
    try:
        with pytest.raises(ValueError, match=r"returned 3 samples for prompt 0; expected 2"):
            runner.run(_prompts(backends[0], ["S1="], n=2), PARAMS)
    finally:
        runner.close()


def test_closing_the_runner_releases_a_rollout_in_flight():
    """A one-step-off rollout still generating when a failed step closes the session gets an error at once; its
    thread used to wait forever on the stopped loop, and with it the flow's task runner (test_e2e hung)."""
    import asyncio
    import threading
    import time

    async def never(prompt, url, sampling_params):
        await asyncio.sleep(3600)

    runner = RolloutRunner(never, "http://127.0.0.1:9", ["http://127.0.0.1:9"])
    outcome: list[BaseException] = []

    def generate() -> None:
        try:
            runner.run([PromptSample(index=0, prompt="p", label=None, prompt_ids=[1], n=1, seed=0)], {})
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcome.append(e)

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(0.2)
    runner.close()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert isinstance(outcome[0], RuntimeError) and "rollout runner was closed" in str(outcome[0])


def test_dynamic_sampling_aborts_the_rest_and_loses_no_finished_sample(served):
    """Over-sampled prompts, slots for only 8 requests: once 3 informative groups are kept, what still runs
    is aborted. Every finished sample the rollout function returned is in the batch or carried over, and with
    partial rollout the next step continues the cut-short ones from their tokens."""
    backends, url = served
    returned: list[Sample] = []

    async def recording(prompt, router_url, sampling_params):
        group = await single_turn(prompt, router_url, sampling_params)
        returned.extend(group)
        return group

    rng = random.Random(0)

    async def score(prompt, samples):  # every group informative: nothing is dropped on purpose
        return [rng.random() for _ in samples]

    supply = iter(_prompts(backends[0], [f"S{i:03d}=" for i in range(40)], n=2))
    long = PARAMS | {"max_new_tokens": 24, "ignore_eos": True}
    runner = RolloutRunner(recording, url, [b.server_url() for b in backends], token=TOKEN)
    try:
        def collect(carry, need=3, max_prompts=40):
            return runner.submit(collect_groups(
                recording, "recording", url, long, need, lambda k: [next(supply) for _ in range(k)], score, carry,
                over_sample=4.0, max_prompts=max_prompts, partial=True))

        first = collect([])
        assert len(first.groups) == 3 and first.metrics["rollout/ds_aborted_samples"] > 0
        for _, group in first.groups:
            assert all(s.finish_reason == "length" and len(s.response_ids) == 24 for s in group)
        finished = {id(s) for s in returned if s.finish_reason != "abort"}
        kept = {id(s) for _, g in first.groups for s in g} | {id(s) for c in first.carry for s in c.samples}
        assert finished <= kept
        cut = [(c.prompt.index, j, s.response_ids) for c in first.carry for j, s in enumerate(c.samples)
               if s.finish_reason == "abort" and s.response_ids]
        assert cut, "some running request was cut short with tokens"

        carry = [Carry.from_json(c.to_json(), backends[0].tokenizer) for c in first.carry]  # as a checkpoint does
        # the next step needs exactly the carried groups and starts no new prompt, so every cut-short sample runs on
        second = collect(carry, need=len(carry), max_prompts=0)
        assert not second.carry and second.metrics["rollout/ds_aborted_samples"] == 0
        continued = {(p.index, j): s for p, g in second.groups for j, s in enumerate(g)}
        for index, j, head in cut:
            s = continued[(index, j)]
            assert s.finish_reason == "length" and len(s.response_ids) == 24
            assert s.response_ids[: len(head)] == head, "continued after the tokens it had, not generated anew"
            assert s.metadata.get("partial") and s.metadata.get("carried")
    finally:
        runner.close()


def test_calculator_example_masks_the_tool_out_of_the_loss_and_learns(tmp_path):
    """examples/calculator_tool.py: the tool's tokens sit between the model's two turns with loss_mask 0 and
    logprob 0, the model's own tokens are trained on, and a short run raises the reward."""
    raw = small_recipe(
        tmp_path, model={"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
                         "num_kv_heads": 4, "max_seq_len": 32},
        data={"train_path": str(tmp_path / "add/train.jsonl"), "eval_path": str(tmp_path / "add/eval.jsonl"),
              "generate": {"task": "add", "num_digits": 1, "num_train": 2000, "num_eval": 16}},
        rollout={"fn": "rlflow.examples.calculator_tool:calculator_rollout", "prompts_per_step": 16,
                 "samples_per_prompt": 4, "max_new_tokens": 8},
        train={"steps": 30, "threads": 1, "lr": 3e-3, "mini_batches": 2},
        algorithm={"entropy_coef": 0.0},
    )
    cfg = config_from_dict(raw)
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    tok = session.tokenizer
    rewards = []
    try:
        for step in range(cfg.train.steps):
            session.rollout(step)
            rewards.append(session.reward(step)["rollout/reward_mean"])
            if step == 0:
                st = session.steps.get(0)
                batch = pack(session, st, torch.zeros(len(st.batch)))
                for i, (p, row_mask) in enumerate(zip(st.batch.prompt_ids, batch["loss_mask"], strict=True)):
                    ids = batch["input_ids"][i, : int(batch["attention_mask"][i].sum())].tolist()
                    text = tok.decode(ids[len(p):], skip_special_tokens=False)
                    tool = [t for t, m in zip(ids[len(p):], row_mask[len(p):].tolist(), strict=False) if m == 0]
                    assert tok.decode(tool).endswith("R"), text  # the tool's answer, and only it, is masked
                    assert row_mask[: len(p)].sum() == 0 and row_mask[len(p):].sum() == len(ids) - len(p) - len(tool)
                    assert batch["old_logprobs"][i][row_mask == 0].abs().sum() == 0
            session.advantages(step)
            session.train(step)
            session.sync_weights(step)
    finally:
        session.shutdown()
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05, rewards


def test_openai_agent_example_trains_with_logprobs_the_trainer_computes(tmp_path):
    """examples/openai_agent.py returns text only; its samples train as on-policy with the train engine's
    logprobs filled in, and eval goes through the same function."""
    cfg = config_from_dict(small_recipe(tmp_path, rollout={"fn": "rlflow.examples.openai_agent:openai_rollout",
                                                          "prompts_per_step": 4, "samples_per_prompt": 2},
                                        train={"steps": 2, "threads": 1, "mini_batches": 1}))
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    try:
        session.rollout(0)
        session.reward(0)
        st = session.steps.get(0)
        assert not st.batch.has_logprobs.any() and (st.batch.weight_version == -1).all()
        session.advantages(0)
        batch = pack(session, st, torch.zeros(len(st.batch)))
        trained = batch["loss_mask"] > 0
        assert trained.any() and (batch["old_logprobs"][trained] < 0).all()
        metrics = session.train(0)
        assert torch.isfinite(torch.tensor(metrics["train/loss"]))
        assert metrics["train/staleness_max"] == 0
        assert 0.0 <= session.evaluate(0)[0]["eval/reward_mean"] <= 1.0
    finally:
        session.shutdown()


def test_dynamic_sampling_in_a_session_fills_the_batch_with_informative_groups(tmp_path):
    cfg = config_from_dict(small_recipe(tmp_path, rollout={"prompts_per_step": 8, "samples_per_prompt": 4,
                                                          "dynamic_sampling": {"enabled": True, "over_sample": 2.0}}))
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    try:
        m = session.rollout(0) | session.reward(0) | session.advantages(0)
        assert m["rollout/ds_prompts_started"] >= 8
        if m["rollout/ds_filled_groups"] == 0:
            assert m["adv/zero_std_groups"] == 0
        table = session.rollout_table(0)
        assert table.num_rows == 32 and b"rlflow.cursor" in table.schema.metadata
        state = session.save(tmp_path / "ckpt", 0)
        assert isinstance(state["carry"], list)
        session.train(0)
        session.sync_weights(0)
        session.rollout(1)
    finally:
        session.shutdown()


def test_rollout_fn_samples_are_validated():
    prompt = PromptSample(index=0, prompt="p", label="", prompt_ids=[1], n=1, seed=0)
    from rlflow.engines.rollout.functions import check_group

    with pytest.raises(ValueError, match="loss_mask must hold 2 zeros and ones"):
        check_group([Sample(response_ids=[1, 2], loss_mask=[1])], prompt, "f")
    with pytest.raises(ValueError, match="finish_reason 'done'"):
        check_group([Sample(response_ids=[1], finish_reason="done")], prompt, "f")
    with pytest.raises(TypeError, match="expected a list of Sample"):
        check_group(asyncio.sleep, prompt, "f")


@pytest.mark.parametrize(("use_ray", "transport"), [(False, "ray"), (True, "ray"), (True, "distributed")],
                         ids=["local", "ray", "ray-distributed"])
def test_a_dead_rollout_worker_is_routed_around_then_restarted_with_current_weights(tmp_path, use_ray, transport):
    """Worker 0 dies (its process is SIGKILLed on Ray; locally its server and engine are closed): the step's
    requests are retried on worker 1, and the next weight sync starts a new worker 0 that gets the trainer's
    current weights and serves behind the router again. With the distributed transport the trainer, the new
    worker and the surviving one form a new weight-update group (the survivor leaves the old one)."""
    import os
    import signal

    import httpx

    cfg = config_from_dict(small_recipe(tmp_path, rollout={"num_workers": 2},
                                        cluster={"use_ray": use_ray, "num_cpus": 4},
                                        weight_sync={"transport": transport}))
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path))
    try:
        for stage in ("rollout", "reward", "advantages", "train", "sync_weights"):
            getattr(session, stage)(0)
        old_url = session.server_urls[0]
        if use_ray:
            os.kill(session.rollout_group.call_one(0, RolloutBackend.pid), signal.SIGKILL)
        else:
            session.rollout_group.workers[0].close()
        m = session.rollout(1)  # every request lands, on worker 1
        assert m["rollout/tokens"] > 0 and session.router.workers[0].healthy is False
        for stage in ("reward", "advantages", "train"):
            getattr(session, stage)(1)
        assert session.sync_weights(1)["rollout/workers_restarted"] == 1.0  # healed at the sync, counted there
        assert session.workers_restarted == 1 and session.router.workers[0].url != old_url
        digests = session.rollout_group.call(GpuLinkProbe.weights_digest)
        assert digests[0] == pytest.approx(digests[1], rel=1e-6)
        info = httpx.get(f"{session.router.workers[0].url}/get_model_info").json()
        assert info["weight_version"] == str(session.weight_version) == "2"
        assert session.rollout(2)["rollout/workers_restarted"] == 1.0
        assert session.router.workers[0].served > 0
    finally:
        session.shutdown()


# ---- sglang-router (the real Rust binary) in front of embedded servers ------------------------------------------
def test_sglang_router_fronts_embedded_workers(tmp_path):
    """sglang-router 0.3.2 in front of two embedded servers, as a run with the SGLang backend gets it: the servers
    pass its registration checks (/health, /server_info, /model_info) through its worker API, which needs the run's
    token; the default rollout goes through it one item a request (it refuses a batched /generate), spread over
    both; an abort goes to each worker directly (it does not forward /abort_request); a restarted worker replaces
    the old one behind it."""
    import httpx

    from rlflow.engines.core.config import ModelConfig
    from rlflow.engines.models.hf import build_tiny_model
    from rlflow.engines.rollout.functions import REQUEST_TAG, abort_tagged, end_tag, generate, outstanding_rids
    from rlflow.engines.rollout.sglang_router import SGLangRouter

    build_tiny_model(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                 max_seq_len=512), tmp_path / "model", seed=0)
    backends = [TorchRolloutBackend(str(tmp_path / "model"), threads=1, batch_size=4, trace=True) for _ in range(3)]
    urls = [b.start_server(token=TOKEN) for b in backends[:2]]
    router = SGLangRouter(urls, token=TOKEN, log_dir=str(tmp_path))
    runner = RolloutRunner(single_turn, router.url, urls, token=TOKEN, batched=False)
    try:
        assert [w.healthy for w in router.workers] == [True, True]
        assert httpx.post(router.url + "/workers", json={"url": "http://127.0.0.1:9"}).status_code == 401
        batched = httpx.post(router.url + "/generate", json={"input_ids": [[1, 2], [3]], "sampling_params": [{}, {}]})
        assert batched.status_code == 422, "sglang-router takes one sampling_params per request"
        assert httpx.post(router.url + "/abort_request", json={"abort_all": True}).status_code == 404

        prompts = _prompts(backends[0], ["S123=", "S907=", "R55="], n=2)
        groups = runner.run(prompts, PARAMS)
        queued = [sum(e["name"] == "queued" for e in b.drain_trace()) for b in backends[:2]]
        assert sum(queued) == 6 and min(queued) >= 2, "one request per sample, round robin over both workers"
        for p, group in zip(prompts, groups, strict=True):
            direct = backends[0].generate([p.prompt_ids], SamplingParams(max_new_tokens=6, temperature=1.0), p.seed)
            assert group[0].response_ids == direct[0].output_ids, "the sampling seed went through the router"
            assert all(s.weight_version == 0 and len(s.logprobs) == len(s.response_ids) for s in group)

        async def tagged() -> dict:
            REQUEST_TAG.set("long")
            return await generate(router.url, [1, 4, 5], PARAMS | {"max_new_tokens": 400, "ignore_eos": True})

        async def abort_while_running() -> dict:
            task = asyncio.ensure_future(tagged())
            while not outstanding_rids("long"):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            await abort_tagged(router.url, "long")  # to each worker: the router would answer 404
            end_tag("long")
            return await task

        item = runner.submit(abort_while_running())
        assert item["meta_info"]["finish_reason"]["type"] == "abort" and len(item["output_ids"]) < 400

        new = backends[2].start_server(token=TOKEN)
        router.replace(0, new)
        assert [w.url for w in router.workers] == [new, urls[1]]
        assert sorted(router.registered()) == sorted([new, urls[1]]), "the old server is no longer registered"
    finally:
        runner.close()
        router.stop()
        for b in backends:
            b.close()
