"""Reward models as workers, LLM judges and weighted reward sources (engines/reward/).

The reward model is a real tiny LlamaForSequenceClassification saved to tmp, built so its score is a function
we can reason about: every layer's output projection is zero, so the hidden state at the last token is that
token's embedding (normalized), and the head is the target character's normalized embedding / d, so a text
scores 1.0 when it ends with TARGET and cos(e_last, e_TARGET) otherwise.

The judges are real HTTP servers: the embedded rollout server on a tiny random model (whose short replies hold a
digit or none: a score or a parse failure scored default_score), and a small stdlib HTTP server started here that
answers /v1/chat/completions with fixed replies (scores, junk, 503s), so retries, parsing and the bearer
token are checked end to end over a socket.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import ray
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rlflow.engines.cluster.groups import LocalWorkerGroup
from rlflow.engines.core.config import (
    JudgeRewardSource,
    RecipeError,
    RewardConfig,
    config_from_dict,
    load_recipe,
    public_tree,
)
from rlflow.engines.core.protocols import RewardModelBackend
from rlflow.engines.reward.judge import JudgeError, LLMJudge
from rlflow.engines.reward.model_worker import SequenceClassifierReward
from rlflow.engines.reward.sources import RewardSources, split_evenly
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.preflight import _reward_problems
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model, role_demands
from rlflow.tasks.tracking import Tracker, flatten
from tests.conftest import small_recipe

TARGET = "R"


def build_last_char_reward_model(base_dir: str | Path, out: str | Path, target: str = TARGET) -> str:
    """A LlamaForSequenceClassification (1 label) on the tiny model's config and char tokenizer whose score is
    cos(embedding of the text's last token, embedding of `target`): 1.0 exactly when the text ends with it."""
    config = AutoConfig.from_pretrained(str(base_dir), num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # no layer adds anything to the residual stream: hidden = embedding
        model.model.norm.weight.fill_(1.0)
        e = model.model.embed_tokens.weight[tok.convert_tokens_to_ids(target)]
        n = e / e.pow(2).mean().add(config.rms_norm_eps).sqrt()
        model.score.weight.copy_((n / n.pow(2).sum())[None])  # score(target) = 1
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    return build_last_char_reward_model(tiny_model_dir, tmp_path_factory.mktemp("rm"))


# ------------------------------------------------------------------------------------------------- reward model


def test_reward_model_scores_the_last_character_in_batches(reward_model_dir):
    """Batched with padding (batch_size 2 over 5 texts of different lengths) gives each text its own score:
    1.0 for those ending with TARGET, below for others, and the same as scoring it alone."""
    rm = SequenceClassifierReward(reward_model_dir, batch_size=2)
    prompts = ["S123=", "S9=", "S12=", "S1=", "S4321="]
    responses = ["12R", "R", "123", "", "9R9"]
    scores = rm.score(prompts, responses, [""] * 5)
    assert scores[0] == pytest.approx(1.0, abs=1e-4) and scores[1] == pytest.approx(1.0, abs=1e-4)
    assert all(s < 0.9 for s in (scores[2], scores[3], scores[4]))
    alone = [rm.score([p], [r], [""])[0] for p, r in zip(prompts, responses, strict=True)]
    assert scores == pytest.approx(alone, abs=1e-5)


def test_reward_model_errors_name_the_field(reward_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"reward.sources\[2\].path"):
        SequenceClassifierReward(str(tmp_path), field="reward.sources[2]")
    with pytest.raises(ValueError, match=r"reward.sources\[0\].label: 1, but the model .* has 1 label"):
        SequenceClassifierReward(reward_model_dir, label=1, field="reward.sources[0]")


def test_model_source_splits_the_batch_over_its_workers(reward_model_dir):
    """Two workers of one group: each scores its contiguous share, the results come back in order."""
    calls: list[int] = []

    class Counting(SequenceClassifierReward):
        def score(self, prompts, responses, labels):
            calls.append(len(prompts))
            return super().score(prompts, responses, labels)

    group = LocalWorkerGroup([Counting(reward_model_dir), Counting(reward_model_dir)], protocols=(RewardModelBackend,))
    cfg = RewardConfig(sources=[{"kind": "model", "name": "rm", "path": reward_model_dir, "weight": 2.0}])
    sources = RewardSources(cfg, {"rm": group})
    out = sources.score(["S1="] * 5, ["R", "1", "R", "2", "R"], [""] * 5, [{}] * 5)
    assert calls == [2, 3] or calls == [3, 2]
    assert out[0] == pytest.approx(2.0, abs=1e-3) and out[2] == pytest.approx(2.0, abs=1e-3) and out[1] < 1.8
    assert [s.stop - s.start for s in split_evenly(1, 3)].count(1) == 1  # fewer samples than workers


# -------------------------------------------------------------------------------------------------- config


def test_reward_fn_recipes_mean_the_same():
    """Back-compat: a recipe with reward.fn alone is one fn source of weight 1 named "fn", with no extra
    metrics; reward.fn together with sources is refused, naming both."""
    cfg = RewardConfig(fn="rlflow.engines.data.rewards:exact_match_reward", kwargs={})
    (src,) = cfg.resolved_sources()
    assert (src.kind, src.name, src.weight) == ("fn", "fn", 1.0)
    assert src.fn == "rlflow.engines.data.rewards:exact_match_reward"
    sources = RewardSources(cfg)
    assert sources.score(["p", "q"], ["a", "b"], ["a", "c"], [{}, {}]) == [1.0, 0.0]
    assert sources.take_metrics() == {}
    with pytest.raises(ValueError, match=r"reward.fn / reward.kwargs: with reward.sources"):
        RewardConfig(fn="rlflow.engines.data.rewards:exact_match_reward", sources=[{"kind": "fn"}])


@pytest.mark.parametrize("source, field", [
    ({"kind": "judge", "url": "http://x/v1", "api_key": "sk-secret-123"}, "api_key: never put an API key"),
    ({"kind": "judge", "url": "http://x/v1", "rubric": "Rate {answer}"}, r"unknown placeholder\(s\) \['answer'\]"),
    ({"kind": "judge", "url": "http://x/v1", "score_pattern": "("}, "score_pattern: not a regular expression"),
    ({"kind": "judge", "url": "http://x/v1", "min_score": 5, "max_score": 5}, "max_score .* must be above"),
    ({"kind": "judge", "url": "http://u:p@x/v1"}, "url: credentials in the URL"),
    ({"kind": "judge", "url": "http://x/v1", "api_key_env": "sk-secret-123"}, "api_key_env: expected the NAME"),
    ({"kind": "judge", "url": "u:sk-secret-123@x/v1"}, "url: credentials in the URL"),
    ({"kind": "model"}, "path: required field is missing"),
    ({"kind": "oracle"}, "reward.sources.0"),
])
def test_bad_sources_name_the_field(tmp_path, source, field):
    raw = small_recipe(tmp_path, reward={"sources": [source]})
    with pytest.raises(RecipeError, match=field) as err:
        config_from_dict(raw)
    assert "reward.sources" in str(err.value) and "sk-secret-123" not in str(err.value)


def test_duplicate_source_names_are_refused(tmp_path):
    raw = small_recipe(tmp_path, reward={"sources": [{"kind": "fn"}, {"kind": "fn", "weight": 0.5}]})
    with pytest.raises(RecipeError, match=r"reward.sources\[1\].name: 'fn' is also source 0's name"):
        config_from_dict(raw)


def test_weights_combine_and_each_source_is_logged(tmp_path):
    """Final reward = sum of weight x score; reward/<name>_mean over the samples of the step (evaluation's are
    not counted); taking the metrics resets them."""
    cfg = RewardConfig(sources=[
        {"kind": "fn", "name": "exact", "fn": "rlflow.engines.data.rewards:exact_match_reward", "weight": 2.0},
        {"kind": "fn", "name": "partial", "fn": "rlflow.engines.data.rewards:match_reward", "weight": -0.5},
    ])
    sources = RewardSources(cfg)
    out = sources.score(["p", "q"], ["12", "13"], ["12", "12"], [{}, {}])
    assert out == pytest.approx([2.0 - 0.5, -0.5 * 0.5])
    sources.score(["p"], ["99"], ["12"], [{}], record=False)
    metrics = sources.take_metrics()
    assert {k: v for k, v in metrics.items() if k.startswith("reward/")} == pytest.approx(
        {"reward/exact_mean": 0.5, "reward/partial_mean": 0.75})
    assert metrics["time/reward_exact"] >= 0 and metrics["time/reward_partial"] >= 0
    assert sources.take_metrics() == {}


def test_flows_without_the_session_take_one_function():
    """The evaluate flow (and a pipeline's evaluate stage) score with one function: a recipe's single source of
    kind fn, weight 1, is that function; a reward model, a judge or a weighted sum is refused, naming the flow."""
    assert RewardConfig(fn="rlflow.engines.data.rewards:exact_match_reward").only_fn("the evaluate flow").fn == \
        "rlflow.engines.data.rewards:exact_match_reward"
    assert RewardConfig(sources=[{"kind": "fn", "fn": "m:f"}]).only_fn("x").fn == "m:f"
    for sources in ([{"kind": "fn", "weight": 2.0}], [{"kind": "fn"}, {"kind": "fn", "name": "b"}],
                    [{"kind": "judge", "url": "http://x/v1"}]):
        with pytest.raises(ValueError, match="reward.sources: the evaluate flow scores with one reward function"):
            RewardConfig(sources=sources).only_fn("the evaluate flow")


# ---------------------------------------------------------------------------------------------------- judges


class FixedJudge(BaseHTTPRequestHandler):
    """An OpenAI chat endpoint answering from a script: each reply in turn (cycling); "503" answers 503."""

    replies: list[str] = ["Score: 7"]
    seen: list[dict] = []
    lock = threading.Lock()
    delay_s, in_flight, most_in_flight = 0.0, 0, 0

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            FixedJudge.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
            reply = self.replies[(len(self.seen) - 1) % len(self.replies)]
            FixedJudge.in_flight += 1
            FixedJudge.most_in_flight = max(FixedJudge.most_in_flight, FixedJudge.in_flight)
        time.sleep(self.delay_s)
        with self.lock:
            FixedJudge.in_flight -= 1
        if reply == "503":
            self.send_response(503)
            self.end_headers()
            return
        if reply == "401":
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b'{"error": "bad key"}')
            return
        data = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fixed_judge():
    FixedJudge.seen, FixedJudge.delay_s, FixedJudge.in_flight, FixedJudge.most_in_flight = [], 0.0, 0, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), FixedJudge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _judge(url: str, **kw) -> JudgeRewardSource:
    return JudgeRewardSource(**{"kind": "judge", "name": "judge", "url": url, "retries": 2, "deadline_s": 20} | kw)


def test_judge_parses_scores_counts_failures_and_sends_the_key(fixed_judge, monkeypatch):
    """Replies in [0, 10] normalized to [0, 1]; junk and out-of-range replies are parse failures scored
    default_score; the rubric carries the sample; the key from the named variable is the bearer token."""
    FixedJudge.replies = ["Score: 7", "I think it is great", "Score: 11", "Score: 2.5"]
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", "sk-test-secret-42")
    cfg = RewardConfig(sources=[{"kind": "judge", "url": fixed_judge, "api_key_env": "JUDGE_KEY_FOR_TEST",
                                 "default_score": -1.0, "max_concurrency": 1, "system": "You grade.",
                                 "rubric": "Q: {prompt} A: {response} Ref: {label}"}])
    sources = RewardSources(cfg)
    out = sources.score(["p0", "p1", "p2", "p3"], ["r0", "r1", "r2", "r3"], ["l0", "l1", "l2", "l3"], [{}] * 4)
    assert out == pytest.approx([0.7, -1.0, -1.0, 0.25])
    metrics = sources.take_metrics()
    assert metrics.pop("time/reward_judge") > 0
    assert metrics == pytest.approx({"reward/judge_mean": (0.7 - 1 - 1 + 0.25) / 4,
                                     "reward/judge_parse_failures": 2.0, "reward/judge_request_failures": 0.0})
    first = FixedJudge.seen[0]
    assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer sk-test-secret-42"
    assert first["body"]["messages"] == [{"role": "system", "content": "You grade."},
                                         {"role": "user", "content": "Q: p0 A: r0 Ref: l0"}]
    assert "sk-test-secret-42" not in repr(sources._judges[0])
    sources.close()


def test_judge_retries_transient_errors_and_fails_on_refusal(fixed_judge, caplog):
    """A 503 is retried (the next reply scores); with on_request_failure default a request failing past its
    retries is scored default_score and counted; a 401 fails at once, its message free of the key."""
    FixedJudge.replies = ["503", "Score: 10"]
    judge = LLMJudge(_judge(fixed_judge), "reward.sources[0]", api_key="sk-never-logged")
    with caplog.at_level(logging.WARNING):
        assert judge.score(["p"], ["r"], ["l"]).scores == [1.0]
    assert len(FixedJudge.seen) == 2 and "sk-never-logged" not in caplog.text
    FixedJudge.replies, FixedJudge.seen = ["503"], []
    failing = LLMJudge(_judge(fixed_judge, retries=1, on_request_failure="default", default_score=0.5),
                       "reward.sources[0]")
    out = failing.score(["p", "q"], ["r", "s"], ["l", "m"])
    assert out.scores == [0.5, 0.5] and out.request_failures == 2 and out.parse_failures == 0
    with pytest.raises(JudgeError, match=r"reward.sources\[0\].*transient error, gave up after 2 attempts"):
        LLMJudge(_judge(fixed_judge, retries=1), "reward.sources[0]").score(["p"], ["r"], ["l"])
    FixedJudge.replies = ["401"]
    with pytest.raises(JudgeError, match="answered 401") as err:
        judge.score(["p"], ["r"], ["l"])
    assert "sk-never-logged" not in str(err.value) and err.value.__cause__ is None


def test_judge_keeps_to_its_concurrency_limit(fixed_judge):
    """8 samples, max_concurrency 3, a judge taking 0.2 s a reply: the requests overlap, never more than 3 in
    flight at once."""
    FixedJudge.replies, FixedJudge.delay_s = ["Score: 5"], 0.2
    judge = LLMJudge(_judge(fixed_judge, max_concurrency=3), "reward.sources[0]")
    assert judge.score(["p"] * 8, ["r"] * 8, ["l"] * 8).scores == [0.5] * 8
    assert FixedJudge.most_in_flight == 3


def test_judge_times_out(tmp_path):
    """A server that accepts but never answers: each attempt ends at timeout_s and the request fails."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        src = _judge(f"http://127.0.0.1:{sock.getsockname()[1]}/v1", timeout_s=0.3, retries=1)
        with pytest.raises(JudgeError, match="ReadTimeout"):
            LLMJudge(src, "reward.sources[0]").score(["p"], ["r"], ["l"])
    finally:
        sock.close()


def test_judge_parser_is_deterministic():
    judge = LLMJudge(_judge("http://127.0.0.1:9/v1", score_pattern=r"Score:\s*(\d+)", normalize=False),
                     "reward.sources[0]")
    assert [judge.parse(t) for t in ["Score: 3", "score: 3", "Score: 12", "blah 5", "Score:9 Score:1"]] == \
        [3.0, None, None, None, 9.0]
    whole = LLMJudge(_judge("http://127.0.0.1:9/v1", score_pattern=r"\d+", min_score=1, max_score=5),
                     "reward.sources[0]")
    assert [whole.parse(t) for t in ["3", "x5y", "0", "nan"]] == [0.5, 1.0, None, None]


def test_judge_against_the_embedded_server(tiny_model_dir):
    """The embedded rollout server as the judge, over its OpenAI chat and completions routes: each sample's score
    is what the judge's pattern finds in the server's own reply to the filled-in rubric (asked here directly over
    HTTP, greedy as the judge asks), normalized, and a reply without one is a parse failure scored default_score,
    counted. The tiny random model's replies to these samples hold digits or nothing, so both paths run."""
    server = TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=8)
    server.start_server()
    prompts, responses = ["S12=", "S987=", "S45=", "S7=", "S3="], ["12", "789", "54", "7", "3"]
    try:
        url = f"{server.server_url()}/v1"
        for route in ("chat", "completions"):
            expected = []
            for p, r in zip(prompts, responses, strict=True):
                body = {"max_tokens": 4, "temperature": 0.0}
                if route == "chat":
                    reply = httpx.post(f"{url}/chat/completions", json=body | {
                        "messages": [{"role": "user", "content": p + r}]}).json()["choices"][0]["message"]["content"]
                else:
                    reply = httpx.post(f"{url}/completions", json=body | {"prompt": p + r}).json()["choices"][0]["text"]
                digit = re.search(r"\d", reply)
                expected.append(int(digit.group(0)) / 9 if digit else None)
            failures = expected.count(None)
            assert 0 < failures < len(expected), f"{route}: these samples must give both kinds of reply: {expected}"
            cfg = RewardConfig(sources=[{"kind": "judge", "url": url, "route": route, "default_score": 0.25,
                                         "rubric": "{prompt}{response}", "score_pattern": r"(\d)", "max_score": 9,
                                         "max_tokens": 4}])
            sources = RewardSources(cfg)
            scores = sources.score(prompts, responses, responses, [{}] * len(prompts))
            assert scores == pytest.approx([0.25 if e is None else e for e in expected]), route
            metrics = sources.take_metrics()
            assert metrics["reward/judge_parse_failures"] == failures, route
            assert metrics["reward/judge_request_failures"] == 0
            sources.close()
    finally:
        server.close()


def test_api_key_stays_out_of_logged_params(tmp_path, monkeypatch):
    """The key lives in the environment only: the recipe names the variable, so neither MLflow's params and
    recipe.json (Tracker), the flow's config parameter (public_tree) nor the stored config.json hold it."""
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", "sk-should-never-appear")
    cfg = config_from_dict(small_recipe(tmp_path, reward={"sources": [
        {"kind": "fn"}, {"kind": "judge", "url": "https://judge.example/v1", "api_key_env": "JUDGE_KEY_FOR_TEST"}]}))
    assert _reward_problems(cfg) == []
    tracker = Tracker.for_training(cfg)
    params = tracker.client.get_run(tracker.run_id).data.params
    assert params["reward.sources"].count("JUDGE_KEY_FOR_TEST") == 1
    assert "sk-should-never-appear" not in json.dumps(params)
    assert "sk-should-never-appear" not in json.dumps(public_tree(cfg)) + json.dumps(flatten(public_tree(cfg)))
    monkeypatch.delenv("JUDGE_KEY_FOR_TEST")
    assert _reward_problems(cfg) == ["reward.sources[1].api_key_env: the environment variable JUDGE_KEY_FOR_TEST "
                                     "is not set (it must hold the judge's API key wherever the reward stage runs)"]


def test_reward_model_gets_its_own_placement(tmp_path, reward_model_dir):
    cfg = config_from_dict(small_recipe(tmp_path, train={"device": "cuda", "steps": 1}, reward={"sources": [
        {"kind": "model", "name": "rm", "path": reward_model_dir, "num_workers": 2, "num_gpus": 0.5}]}))
    demand = role_demands(cfg, 1, 1, False)[-1]
    assert (demand.field, demand.workers, demand.bundle["GPU"]) == ("reward.sources[0]", 2, 0.5)


# ------------------------------------------------------------------------------------------------ learning


def test_policy_learns_to_please_the_reward_model(tmp_path, reward_model_dir):
    """GRPO against the reward model alone (a worker group in this process): the policy learns to end its
    responses with TARGET, so the reward model's mean score rises well above the random policy's."""
    raw = small_recipe(tmp_path, reward={"sources": [{"kind": "model", "name": "rm", "path": reward_model_dir}]},
                       rollout={"prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 3},
                       train={"steps": 20, "threads": 1, "lr": 1e-2}, eval={"every": 0})
    raw["model"]["max_seq_len"] = 32
    cfg = config_from_dict(raw)
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    means = []
    try:
        for step in range(cfg.train.steps):
            session.rollout(step)
            metrics = session.reward(step)
            means.append(metrics["reward/rm_mean"])
            assert metrics["rollout/reward_mean"] == pytest.approx(metrics["reward/rm_mean"], abs=1e-5)
            session.advantages(step)
            session.train(step)
            session.sync_weights(step)
    finally:
        session.shutdown()
    print("reward/rm_mean by step:", [round(m, 3) for m in means])
    assert sum(means[:3]) / 3 < 0.3 and sum(means[-3:]) / 3 > 0.8  # measured: 0.13 -> 0.99


def test_reward_model_as_ray_workers(tmp_path, reward_model_dir):
    """With Ray the reward model is a group of actors in a placement group of its own (2 workers here), named
    after its source, scoring a real step's samples; a worker that dies is replaced at the next reward stage
    (counted), which scores the same; shutdown releases it."""
    raw = small_recipe(tmp_path, reward={"sources": [
        {"kind": "model", "name": "rm", "path": reward_model_dir, "num_workers": 2, "weight": 0.5}]},
        debug={"mode": "rollout_only"}, cluster={"num_cpus": 4, "cpus_per_worker": 0.5})
    cfg = config_from_dict(raw)
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=True)
    try:
        group = session.workers.reward["rm"]
        assert len(group) == 2 and len(set(group.call(RewardModelBackend.pid))) == 2
        assert len(group.placement) == 2  # its own placement group, planned with the run's
        session.rollout(0)
        metrics = session.reward(0)
        b = session.rollout_batch(0)
        local = SequenceClassifierReward(reward_model_dir).score(b.prompt, b.response, b.label)
        assert list(b.reward) == pytest.approx([0.5 * x for x in local], abs=1e-5)
        assert metrics["rollout/reward_mean"] == pytest.approx(0.5 * metrics["reward/rm_mean"], abs=1e-5)
        assert "reward/workers_restarted" not in metrics
        ray.kill(group.workers[1], no_restart=True)  # a worker dies: the next reward stage replaces it
        deadline = time.monotonic() + 30  # ray.kill returns before the actor is gone; wait until it is
        while group.alive(timeout_s=2)[1] and time.monotonic() < deadline:
            time.sleep(0.1)
        again = session.reward(0)
        assert again["reward/workers_restarted"] == 1.0 and group.alive() == [True, True]
        assert list(session.rollout_batch(0).reward) == pytest.approx(list(b.reward), abs=1e-6)
    finally:
        session.shutdown()
        ray.shutdown()


def test_reward_model_recipe_validates():
    """deployments/gsm8k-qwen-reward-model.yaml: three sources, their names, weights and the key by variable name;
    on this machine its model folders are missing, which validation reports naming the field."""
    cfg = load_recipe("deployments/gsm8k-qwen-reward-model.yaml")
    assert [(s.kind, s.name, s.weight) for s in cfg.reward.resolved_sources()] == [
        ("fn", "correct", 1.0), ("model", "rm", 0.1), ("judge", "judge", 0.2)]
    assert cfg.reward.sources[2].api_key_env == "JUDGE_API_KEY"
    assert "reward.sources[1].path: no Hugging Face model" in "\n".join(_reward_problems(cfg))


def test_a_hung_reward_stage_names_its_sources(tmp_path):
    from rlflow.tasks.stages import timeout_message  # Prefect's import cost, for this test only

    cfg = config_from_dict(small_recipe(tmp_path, reward={"sources": [{"kind": "fn"}, {
        "kind": "judge", "name": "grader", "url": "http://127.0.0.1:9/v1"}]}))
    assert "in reward.sources ['fn', 'grader']" in timeout_message(cfg, "reward", "reward", 3, 10)


def test_session_sums_a_function_and_a_judge(tmp_path, tiny_model_dir):
    """A run's reward stage with reward.sources [the sort verifier, weight 1; a judge on the embedded server,
    weight 0.5]: the judge (a random tiny model) fails to parse every reply, scored default_score 0.2, so each
    sample's reward is its verifier score + 0.1, and the step's metrics count the failures."""
    judge = TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=32)
    judge.start_server()
    try:
        cfg = config_from_dict(small_recipe(tmp_path, eval={"every": 0}, reward={"sources": [
            {"kind": "fn", "name": "sort", "fn": "rlflow.engines.data.rewards:sort_reward"},
            {"kind": "judge", "url": f"{judge.server_url()}/v1", "weight": 0.5, "default_score": 0.2,
             "max_tokens": 2, "score_pattern": "R{6}", "rubric": "{prompt}{response}"}]}))
        prepare_data(cfg)
        session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
        try:
            session.rollout(0)
            metrics = session.reward(0)
            b = session.rollout_batch(0)
        finally:
            session.shutdown()
    finally:
        judge.close()
    n = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    assert metrics["reward/judge_parse_failures"] == n and metrics["reward/judge_mean"] == pytest.approx(0.2)
    assert metrics["rollout/reward_mean"] == pytest.approx(metrics["reward/sort_mean"] + 0.1)
    verifier = [r + 0.1 for r in RewardSources(RewardConfig()).score(b.prompt, b.response, b.label, [{}] * n)]
    assert list(b.reward) == pytest.approx(verifier)
