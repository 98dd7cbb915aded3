"""The environment protocol (engines/env/), the env rollout (engines/rollout/env_rollout.py) and token in / token out:
real embedded servers behind the real router, env hosts in this process and as Ray actors, the real sandbox."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import ray
import torch

from rlflow.engines.core.config import EnvConfig, SandboxConfig, config_from_dict
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.data.rewards import match_reward
from rlflow.engines.env.client import start_env_hosts
from rlflow.engines.env.pool import SandboxPool
from rlflow.engines.env.protocol import EnvError
from rlflow.engines.rollout.env_rollout import env_rollout, register_env, turn_seed, unregister_env
from rlflow.engines.rollout.functions import PromptSample, RolloutRunner
from rlflow.engines.rollout.router import RolloutRouter
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.stages.train_batch import pack
from rlflow.engines.session.workers import prepare_data, prepare_model
from tests.conftest import small_recipe

PARAMS = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop": []}
UNK, BOS = 3, 1
OBS = [UNK, BOS, 7, 12]  # <unk>, <bos>, "3", "+": decoded (as text for a reader) and encoded again, other ids
TURNS = 3


class FixedIdsEnv:
    """Answers every turn with OBS as token ids; done after TURNS model turns; reward = the turn's number."""

    def __init__(self, turns: int = TURNS):
        self.turns, self.turn = turns, 0

    def reset(self, sample: dict) -> None:
        assert {"prompt", "label", "row", "seed", "episode"} <= set(sample)
        return None

    def step(self, action: dict):
        assert isinstance(action["text"], str) and all(isinstance(t, int) for t in action["token_ids"])
        self.turn += 1
        return list(OBS), float(self.turn), self.turn >= self.turns, {"turn": self.turn}


class RaisingEnv(FixedIdsEnv):
    def step(self, action: dict):
        raise ZeroDivisionError("the tool divided by zero")


class SlowEnv(FixedIdsEnv):
    async def step(self, action: dict):
        await asyncio.sleep(30)


class MalformedEnv(FixedIdsEnv):
    def step(self, action: dict):
        return {"tokens": [1, 2]}, 1.0, False, {}


@pytest.fixture
def served(tiny_model_dir):
    backend = TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=16)
    router = RolloutRouter([backend.start_server()])
    yield backend, router.url
    router.stop()
    backend.close()


def _prompts(tok, texts: list[str], n: int) -> list[PromptSample]:
    return [PromptSample(index=i, prompt=t, label="", prompt_ids=tok(t)["input_ids"], n=n, seed=5 + 100 * i,
                         tokenizer=tok) for i, t in enumerate(texts)]


def _run(backend, url, cls: str, prompts, **env) -> tuple[list, object]:
    client = start_env_hosts(EnvConfig(cls=cls, max_turns=TURNS + 1, **env), SandboxConfig(), use_ray=False)
    register_env(url, client, context_len=32)
    runner = RolloutRunner(env_rollout, url, [backend.server_url()])
    try:
        return runner.run(prompts, PARAMS), client
    finally:
        runner.close()
        unregister_env(url)
        client.close_hosts()


def test_multi_turn_tokens_are_the_engines_and_the_envs_ids_never_re_encoded(served):
    """The trained sequence is prompt ids + each turn's ids as the engine generates them (for the same input and
    sampling seed) + the env's observation ids, byte for byte; the mask covers the model's tokens only; the reward is
    the sum of the env's. OBS and the model's turns do not survive decode -> encode (checked), so an implementation
    that re-tokenized either would fail here."""
    backend, url = served
    tok = backend.tokenizer
    prompts = _prompts(tok, ["S123=", "R45="], n=3)
    groups, client = _run(backend, url, "tests.test_env:FixedIdsEnv", prompts, actors=2, episodes_per_actor=2)
    assert tok(tok.decode(OBS, skip_special_tokens=True), add_special_tokens=False)["input_ids"] != OBS
    round_trips = []
    for p, group in zip(prompts, groups, strict=True):
        for j, s in enumerate(group):
            ids, mask = list(p.prompt_ids), []
            for turn in range(TURNS):
                made = backend.generate([ids], SamplingParams(max_new_tokens=4, temperature=1.0),
                                        seed=turn_seed(p.seed + j, turn))[0].output_ids
                round_trips.append(tok(tok.decode(made, skip_special_tokens=True),
                                       add_special_tokens=False)["input_ids"] == made)
                ids += made
                mask += [1] * len(made)
                if turn < TURNS - 1:
                    ids += OBS
                    mask += [0] * len(OBS)
            assert list(p.prompt_ids) + s.response_ids == ids
            assert s.loss_mask == mask
            assert s.reward == sum(range(1, TURNS + 1)) and s.finish_reason == "stop"
            assert all(lp == 0.0 for lp, m in zip(s.logprobs, mask, strict=True) if m == 0)
            assert s.metadata["episode"] == f"{p.seed}:{j}" and s.metadata["turns"] == TURNS
    assert not all(round_trips), "some model turn must not survive decode -> encode, or the test proves nothing"
    assert sum(h["episodes"] for h in client.stats()) == 6 and all(h["live"] == 0 for h in client.stats())


@pytest.mark.parametrize("cls, message", [
    ("RaisingEnv", r"tests.test_env:RaisingEnv raised in step of episode \S+5:\d: ZeroDivisionError: the tool "
                   r"divided by zero"),
    ("SlowEnv", r"tests.test_env:SlowEnv timed out in step of episode \S+: no answer within "
                r"rollout.env.step_timeout_s \(0.5 s\)"),
    ("MalformedEnv", r"tests.test_env:MalformedEnv returned a malformed result in step of episode \S+: malformed "
                     r"observation \{'tokens': \[1, 2\]\} \(dict\); expected None, a str, a list of non-negative "
                     r"token ids, or a list of"),
])
def test_a_bad_environment_gets_an_error_naming_it_the_episode_and_the_fault(served, cls, message):
    backend, url = served
    t0 = time.monotonic()
    with pytest.raises(EnvError, match=message):
        _run(backend, url, f"tests.test_env:{cls}", _prompts(backend.tokenizer, ["S1="], n=2), step_timeout_s=0.5)
    assert time.monotonic() - t0 < 10


def test_env_config_names_the_field_and_refuses_a_class_without_the_protocol(tmp_path):
    with pytest.raises(ValueError, match=r"rollout.env.cls: Value error, 'tests.test_env' is not an import path"):
        config_from_dict(small_recipe(tmp_path, rollout={"env": {"cls": "tests.test_env"}}))
    with pytest.raises(TypeError, match=r"rollout.env.cls: 'tests.test_env:_prompts' must be a class with reset"):
        start_env_hosts(EnvConfig(cls="tests.test_env:_prompts"), SandboxConfig(), use_ray=False)
    cfg = config_from_dict(small_recipe(tmp_path,
                                        rollout={"env": {"cls": "tests.test_env:FixedIdsEnv"}}))
    assert cfg.rollout.fn == "rlflow.engines.rollout.env_rollout:env_rollout"


def test_env_hosts_as_ray_actors_take_batched_calls(served):
    """The same episodes through two Ray actor hosts: their arguments are plain data, the results equal the
    in-process hosts'."""
    backend, url = served
    prompts = _prompts(backend.tokenizer, ["S9=", "S10=", "R2="], n=2)
    local, client = _run(backend, url, "tests.test_env:FixedIdsEnv", prompts)
    ops = 6 * (TURNS + 2)  # a reset, the steps and a close per episode
    assert client.calls * 3 <= ops, f"{client.calls} host calls for {ops} operations: not batched"
    started = not ray.is_initialized()
    client = start_env_hosts(EnvConfig(cls="tests.test_env:FixedIdsEnv", actors=2, max_turns=TURNS + 1),
                             SandboxConfig(), use_ray=True)
    register_env(url, client, context_len=32)
    runner = RolloutRunner(env_rollout, url, [backend.server_url()])
    try:
        remote = runner.run(prompts, PARAMS)
        assert sum(h["episodes"] for h in client.stats()) == 6 and client.calls * 3 <= ops
    finally:
        runner.close()
        unregister_env(url)
        client.close_hosts()
        if started:
            ray.shutdown()
    assert [[s.response_ids for s in g] for g in remote] == [[s.response_ids for s in g] for g in local]


def test_openai_routes_return_token_ids_and_take_them_back(served):
    """return_token_ids gives the prompt's and the completion's ids (the engine's, for the same seed), streamed too;
    a prompt of ids, non-round-trip ones included, goes in as it is."""
    backend, _ = served
    tok = backend.tokenizer
    with httpx.Client(base_url=backend.server_url(), timeout=60) as http:
        ids = tok("S12=")["input_ids"]
        body = {"prompt": ids, "max_tokens": 4, "seed": 3, "return_token_ids": True, "temperature": 1.0}
        r = http.post("/v1/completions", json=body).json()
        choice = r["choices"][0]
        direct = backend.generate([ids], SamplingParams(max_new_tokens=4, temperature=1.0), seed=3)[0].output_ids
        assert choice["prompt_token_ids"] == ids and choice["token_ids"] == direct
        follow = choice["prompt_token_ids"] + choice["token_ids"] + OBS  # the harness appends a tool's ids
        r2 = http.post("/v1/completions", json=body | {"prompt": follow}).json()["choices"][0]
        assert r2["prompt_token_ids"] == follow
        assert "token_ids" not in http.post("/v1/completions", json=body | {"return_token_ids": False}
                                            ).json()["choices"][0]
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "S12="}],
                                                       "max_tokens": 4, "seed": 3, "return_token_ids": True}).json()
        c = chat["choices"][0]
        chat_text = tok.apply_chat_template([{"role": "user", "content": "S12="}], tokenize=False,
                                            add_generation_prompt=True)
        assert c["prompt_token_ids"] == tok(chat_text, add_special_tokens=False)["input_ids"]
        assert tok.decode(c["token_ids"], skip_special_tokens=True) == c["message"]["content"]
        chunks = [json.loads(line[6:]) for line in http.post("/v1/completions", json=body | {"stream": True}
                                                             ).text.splitlines()
                  if line.startswith("data: {")]
        assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == direct
        bad = http.post("/v1/completions", json=body | {"return_token_ids": "yes"})
        assert bad.status_code == 400 and "return_token_ids: expected true or false" in bad.text


def _tool_recipe(tmp_path, **rollout):
    return config_from_dict(small_recipe(
        tmp_path, model={"max_seq_len": 32, "extra_chars": "*"},
        data={"train_path": str(tmp_path / "mul/train.jsonl"), "eval_path": str(tmp_path / "mul/eval.jsonl"),
              "generate": {"task": "mul", "num_digits": 2, "num_train": 500, "num_eval": 16}},
        rollout={"env": {"cls": "rlflow.engines.env.python_tool:PythonToolEnv", "max_turns": 3,
                         "kwargs": {"cache": False}},
                 "prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 7, "stop": ["="], **rollout},
        train={"steps": 2, "threads": 1}))


def test_python_tool_loop_runs_tool_calls_in_the_sandbox(tmp_path):
    """Two GRPO steps of the mul tool task in the bare loop: every tool call the model made ran in the sandbox (its
    observation is what the sandbox prints for it, and "R"), observations are masked out, the reward is the env's
    score of the answer, and the step trains."""
    cfg = _tool_recipe(tmp_path)
    with SandboxPool() as pool:  # the sandbox runs Python here at all (a broken one would fail every call alike)
        assert pool.run_python("print(6 * 7)").stdout == b"42\n"
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    tok = session.tokenizer
    calls = 0
    try:
        for step in range(2):
            session.rollout(step)
            b = session.steps.get(step).batch
            for i in range(len(b)):
                out, mask = b.split("output_ids")[i].tolist(), b.split("loss_mask")[i].tolist()
                turns, k = [], 0
                while k < len(out):  # runs of model tokens (1) and observations (0)
                    j = k
                    while j < len(out) and mask[j] == mask[k]:
                        j += 1
                    turns.append((mask[k], out[k:j]))
                    k = j
                model = [tok.decode(t, skip_special_tokens=True) for m, t in turns if m == 1]
                for (m, ids), call in zip(turns[1::2], model, strict=False):
                    assert m == 0 and call.endswith("=")
                    calls += 1
                    with SandboxPool() as pool:
                        res = pool.run_python(f"print({call[:-1]})")
                    assert res.ok or b"Error" in res.stderr, res  # the code ran: a result, or Python's own error
                    printed = res.stdout.decode().strip()[:8] if res.ok else ""
                    assert tok.decode(ids) == "".join(c for c in printed if c.isdigit()) + "R"
                answer = model[-1]
                if not answer.endswith("="):
                    assert b.fn_reward[i] == pytest.approx(match_reward([""], [answer], [b.label[i]])[0])
            assert session.reward(step)["rollout/reward_mean"] == pytest.approx(float(b.fn_reward.mean()))
            session.advantages(step)
            st = session.steps.get(step)
            batch = pack(session, st, torch.zeros(len(st.batch)))
            assert batch["loss_mask"].sum() < batch["attention_mask"].sum() - sum(map(len, st.batch.prompt_ids))
            assert torch.isfinite(torch.tensor(session.train(step)["train/loss"]))
            session.sync_weights(step)
        stats = session.env.stats()[0]
        assert calls > 0 and stats["sandbox_peak"] >= 1 and stats["errors"] == 0 and stats["live"] == 0
        assert stats["episodes"] == 2 * 4 * 4
    finally:
        session.shutdown()
