"""The SGLang HTTP contract, against the embedded rollout server and (when one is reachable) a real SGLang.

Every contract test runs against `server`, parametrised over:
- "embedded": a TorchRolloutBackend started by this module, serving on an ephemeral port;
- "sglang": a real SGLang server at $RLFLOW_SGLANG_URL. SGLang needs a GPU, so it cannot run here: those
  cases are SKIPPED unless that variable names a running server (`-m sglang` selects only them).
Tests that need the model's weights in this process (logprob parity with the train backend, tensor
updates in our safetensors payload, trace events) run against the embedded server only.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.batch import pack_samples
from rlflow.engines.core.config import AlgorithmConfig, ModelConfig, TrainConfig
from rlflow.engines.models.hf import build_tiny_model
from rlflow.engines.rollout.http_api import serialize_named_tensors
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.train.torch_backend import TorchTrainBackend

SGLANG_URL = os.environ.get("RLFLOW_SGLANG_URL")
LONG = 1000  # tokens: long enough that an abort always lands while the request still runs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny demo model, with room for LONG tokens."""
    out = tmp_path_factory.mktemp("server_model")
    build_tiny_model(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                 max_seq_len=LONG + 64), out, seed=0)
    return str(out)


@pytest.fixture(scope="module")
def embedded(model_dir):
    backend = TorchRolloutBackend(model_dir, threads=1, batch_size=16, trace=True)
    backend.start_server()
    yield backend
    backend.close()


@pytest.fixture(params=["embedded", pytest.param("sglang", marks=pytest.mark.sglang)])
def server(request) -> str:
    if request.param == "sglang":
        if not SGLANG_URL:
            pytest.skip("no SGLang server: set RLFLOW_SGLANG_URL to run the contract against a real one")
        return SGLANG_URL.rstrip("/")
    return request.getfixturevalue("embedded").server_url()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


def _gen(http, **body) -> dict | list:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http, body: dict, on_first=None) -> list[dict]:
    """The events of a streamed /generate; `on_first()` is called once the first token arrived."""
    events = []
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append("[DONE]")
                break
            events.append(json.loads(line[len("data: "):]))
            if on_first is not None and len(events) == 1:
                on_first()
    return events


def _long_streams(url: str, n: int) -> tuple[list[threading.Thread], list]:
    """`n` concurrent streamed /generate calls of LONG tokens; returns once each has its first token. Join the
    threads, then the list holds each call's final event."""
    started = [threading.Event() for _ in range(n)]
    finals: list = [None] * n

    def run(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as own:
            body = {"text": str(i), "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
            finals[i] = _stream(own, body, on_first=started[i].set)[-2]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    return threads, finals


# ---------------------------------------------------------------------------------------------- information
def test_health_and_info(http):
    """/health answers; /health_generate generates a token; the model and server information agree on what is
    served (path, weight version) and state the limits the rollout relies on (a context for LONG tokens)."""
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    model, server = http.get("/get_model_info").json(), http.get("/get_server_info").json()
    assert model["is_generation"] is True and model["model_path"] == server["model_path"]
    assert model["weight_version"] == server["weight_version"]
    assert server["context_length"] >= LONG and server["max_total_num_tokens"] >= LONG
    assert server["max_running_requests"] >= 1


# ---------------------------------------------------------------------------------------------- /generate
def test_generate_text_with_logprobs(http):
    out = _gen(http, text="12+3=", sampling_params={"max_new_tokens": 6, "temperature": 1.0}, return_logprob=True)
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 6 and meta["prompt_tokens"] > 0
    assert meta["finish_reason"]["type"] in ("stop", "length") and "weight_version" in meta
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and all(lp <= 0 for lp, _, _ in lps)


def test_generate_batch_of_input_ids_and_n(http):
    out = _gen(http, input_ids=[[1, 5, 6], [1, 7]], sampling_params={"max_new_tokens": 3, "n": 2})
    assert isinstance(out, list) and len(out) == 4
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 3, 2, 2]
    single = _gen(http, input_ids=[1, 5, 6], sampling_params={"max_new_tokens": 3, "n": 3})
    assert isinstance(single, list) and len(single) == 3


def test_ignore_eos_and_length(http):
    out = _gen(http, text="1", sampling_params={"max_new_tokens": 7, "ignore_eos": True})
    assert len(out["output_ids"]) == 7 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 7}


def test_greedy_is_repeatable_and_stops_at_a_token(http):
    body = {"text": "31+2=", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    a, b = _gen(http, **body), _gen(http, **body)
    assert a["output_ids"] == b["output_ids"]
    first = a["output_ids"][0]
    stopped = _gen(http, text="31+2=", sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                        "stop_token_ids": [first]})
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_stop_string_ends_the_text_before_it(http):
    from transformers import AutoTokenizer

    path = http.get("/get_model_info").json()["tokenizer_path"]
    if not Path(path).is_dir():
        pytest.skip(f"the server's tokenizer {path!r} is not a local directory")
    tok = AutoTokenizer.from_pretrained(path)
    ids = _gen(http, text="31+2=", sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
               )["output_ids"]
    pieces = [tok.decode([t], skip_special_tokens=True) for t in ids]
    j = next((j for j in range(1, len(ids)) if pieces[j] and pieces[j] not in "".join(pieces[:j])), None)
    if j is None:
        pytest.skip(f"no usable stop string in the greedy output {pieces}")
    out = _gen(http, text="31+2=", sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
                                                     "stop": pieces[j]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pieces[j]}
    assert out["output_ids"] == ids[: j + 1] and out["text"] == "".join(pieces[:j])


def test_stream_is_cumulative_and_ends_with_done(http):
    body = {"text": "12+", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    events = _stream(http, body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    final, whole = chunks[-1], _gen(http, **body)
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert final["output_ids"] == whole["output_ids"] and final["text"] == whole["text"]
    assert len(final["meta_info"]["output_token_logprobs"]) == 5


# ---------------------------------------------------------------------------------------------- batching and abort
def test_request_joins_a_running_batch_and_abort_by_rid(http, server):
    """A short request sent while a long one decodes finishes first (it joined the running batch); the long
    one, aborted by rid, returns the tokens it had with finish_reason abort."""
    long_body = {"text": "1", "rid": "long-1", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    short: dict = {}

    def send_short_then_abort():
        with httpx.Client(base_url=server, timeout=120) as other:
            short.update(_gen(other, text="2", sampling_params={"max_new_tokens": 3, "ignore_eos": True}))
            assert other.post("/abort_request", json={"rid": "long-1"}).status_code == 200

    helper = threading.Thread(target=send_short_then_abort)
    events = _stream(http, long_body, on_first=helper.start)
    helper.join()
    final = events[-2]
    assert short["meta_info"]["finish_reason"]["type"] == "length" and len(short["output_ids"]) == 3
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 1 <= len(final["output_ids"]) < LONG


def test_abort_all(http, server):
    threads, finals = _long_streams(server, 3)
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join()
    assert [f["meta_info"]["finish_reason"]["type"] for f in finals] == ["abort"] * 3
    assert all(len(f["output_ids"]) < LONG for f in finals)


# ---------------------------------------------------------------------------------------------- weights and memory
def test_flush_cache(http, server):
    """Refused (400) while a request runs, which goes on unharmed; done (200) once the server is idle."""
    threads, finals = _long_streams(server, 1)
    refused = http.post("/flush_cache")
    assert refused.status_code == 400, refused.text
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    threads[0].join()
    assert finals[0]["meta_info"]["finish_reason"]["type"] == "abort" and len(finals[0]["output_ids"]) >= 1
    assert http.post("/flush_cache").status_code == 200


def test_flush_cache_drops_the_kv_cache(embedded):
    """The embedded engine keeps no prefix cache across requests: a flush frees its paged KV cache, which the next
    request builds anew (its page counters start from zero), and generation after it is unchanged."""
    greedy = {"text": "12+", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=embedded.server_url(), timeout=60) as http:

        def kv() -> dict:
            return http.get("/get_server_info").json()["internal_states"][0]

        before = _gen(http, **greedy)["output_ids"]
        assert kv()["kv_pages_peak"] > 0 and kv()["kv_pages_used"] == 0  # pages in the cache, none held now
        assert http.post("/flush_cache").status_code == 200
        assert kv()["kv_pages_peak"] == 0  # the cache is gone, not only emptied
        assert _gen(http, **greedy)["output_ids"] == before
        assert kv()["kv_pages_peak"] > 0


def test_release_resume_and_update_from_disk(http, server):
    path = http.get("/get_model_info").json()["model_path"]
    greedy = {"text": "12+", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    before = _gen(http, **greedy)["output_ids"]
    assert http.post("/release_memory_occupation", json={}).status_code == 200
    assert http.post("/resume_memory_occupation", json={}).status_code == 200
    r = http.post("/update_weights_from_disk", json={"model_path": path})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert _gen(http, **greedy)["output_ids"] == before


def test_released_engine_refuses_generation(embedded):
    with httpx.Client(base_url=embedded.server_url(), timeout=60) as http:
        assert http.post("/release_memory_occupation").status_code == 200
        r = http.post("/generate", json={"text": "1", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and "released" in r.json()["error"]["message"]
        # a colocated step takes the KV cache (and SGLang's CUDA graphs) back apart from the weights: not these
        assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
        r = http.post("/generate", json={"text": "1", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and "released" in r.json()["error"]["message"]
        assert http.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        assert http.post("/update_weights_from_disk", json={"model_path": embedded.model_path}).json()["success"]


def test_update_from_disk_reads_only_the_servers_folders(model_dir, tmp_path):
    """/update_weights_from_disk loads from the model folder and the run's folders it was started with; another
    folder, '..' out of an allowed one, or a symlink pointing out of one is refused (403) naming the folders."""
    from safetensors.torch import load_file, save_file

    allowed, outside = tmp_path / "run" / "weights", tmp_path / "elsewhere"
    for folder in (allowed, outside):
        folder.mkdir(parents=True)
        save_file(load_file(str(Path(model_dir) / "model.safetensors")), str(folder / "model.safetensors"))
    (allowed / "link").symlink_to(outside, target_is_directory=True)
    backend = TorchRolloutBackend(model_dir, threads=1, batch_size=2, weight_dirs=[str(allowed)])
    try:
        with httpx.Client(base_url=backend.start_server(), timeout=60) as http:
            for path in (outside, allowed / ".." / ".." / "elsewhere", allowed / "link"):
                r = http.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": 3})
                message = r.json()["error"]["message"]
                assert r.status_code == 403 and f"model_path: {str(path)!r} is outside" in message, r.text
                assert str(allowed) in message and model_dir in message
            assert backend.weight_version == 0
            for version, path in ((1, allowed), (2, model_dir)):
                r = http.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": version})
                assert r.status_code == 200 and r.json()["success"], r.text
            assert backend.weight_version == 2
    finally:
        backend.close()


def test_a_runs_servers_may_read_its_weight_sync_and_local_store_folders(tmp_path):
    """The disk transport's versions, the adapter transport's (LoRA) and, with a local store, the run's folder."""
    from rlflow.engines.core.config import config_from_dict
    from rlflow.engines.sync.disk import disk_folder, weight_dirs
    from tests.conftest import small_recipe

    cfg = config_from_dict(small_recipe(tmp_path, weight_sync={"disk_dir": str(tmp_path / "disk")}))
    assert weight_dirs(cfg) == [f"{tmp_path}/disk/{cfg.name}/weights", f"{tmp_path}/disk/{cfg.name}/adapters",
                                f"{tmp_path}/runs/{cfg.name}"]
    assert disk_folder(cfg).path("weights", "v00000001").startswith(weight_dirs(cfg)[0])
    s3 = config_from_dict(small_recipe(tmp_path, storage={"uri": "s3://bucket/runs"}))
    # checkpoints on S3 are not a local folder
    assert weight_dirs(s3) == [disk_folder(s3).path("weights"), disk_folder(s3).path("adapters")]


def test_bad_requests_name_the_field(embedded):
    with httpx.Client(base_url=embedded.server_url(), timeout=60) as http:
        cases = [
            ({"text": "1", "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty"),
            ({"text": "1", "sampling_params": {"max_new_token": 3}}, "sampling_params.max_new_token"),
            ({"text": "1", "input_ids": [1]}, "exactly one of text or input_ids"),
            ({"input_ids": "12"}, "input_ids"),
        ]
        for body, needle in cases:
            r = http.post("/generate", json=body)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
        r = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["gASVAAAA"]})
        assert r.status_code == 400 and "never unpickles" in r.json()["error"]["message"]
        r = http.post("/update_weights_from_disk", json={"model_path": embedded.model_path + "/nonexistent"})
        assert r.status_code == 400 and "model_path" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------- logprob parity
def _train_logprobs(trainer: TorchTrainBackend, outs: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = [o["prompt_ids"] for o in outs]
    outputs = [o["output_ids"] for o in outs]
    served = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    batch = pack_samples(prompts, outputs, served, torch.zeros(len(outs)), pad_id)
    mask = batch["loss_mask"].bool()
    assert mask.sum() > 0
    return trainer.forward_logprobs(batch)[mask], batch["old_logprobs"][mask]


def test_generate_logprobs_match_the_train_backend_also_after_a_tensor_update(embedded, model_dir):
    trainer = TorchTrainBackend(model_dir, TrainConfig(threads=1), AlgorithmConfig())
    pad = embedded.tokenizer.pad_token_id
    prompts = [[1, 5, 6, 7, 15], [1, 9, 15], [1, 4, 4, 8, 9, 10, 15]]
    with httpx.Client(base_url=embedded.server_url(), timeout=120) as http:
        def sample(version: str) -> list[dict]:
            outs = _gen(http, input_ids=prompts, return_logprob=True,
                        sampling_params={"max_new_tokens": 8, "temperature": 1.0, "top_k": 5, "n": 2})
            assert all(o["meta_info"]["weight_version"] == version for o in outs)
            return [o | {"prompt_ids": p} for o, p in zip(outs, [p for p in prompts for _ in range(2)], strict=True)]

        train_lp, served_lp = _train_logprobs(trainer, sample("default"), pad)  # a fresh server, as SGLang says
        assert (train_lp - served_lp).abs().max() <= 1e-5

        # one training step, the new weights sent as base64 safetensors, then the two agree again
        outs = sample("default")
        batch = pack_samples([o["prompt_ids"] for o in outs], [o["output_ids"] for o in outs],
                             [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs],
                             torch.linspace(-1, 1, len(outs)), pad)
        trainer.train_step(batch)
        named = trainer.named_tensors()
        half = len(named) // 2
        payload = {"serialized_named_tensors": [serialize_named_tensors(named[:half]),
                                                serialize_named_tensors(named[half:])],
                   "load_format": "safetensors", "weight_version": "1"}
        r = http.post("/update_weights_from_tensor", json=payload)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        train_lp, served_lp = _train_logprobs(trainer, sample("1"), pad)
        assert (train_lp - served_lp).abs().max() <= 1e-5
        assert http.get("/get_model_info").json()["weight_version"] == "1"
        # back to the starting weights for the other tests
        assert http.post("/update_weights_from_disk", json={"model_path": model_dir, "weight_version": 0}
                         ).json()["success"]


def test_trace_records_requests_and_weight_updates(embedded):
    embedded.drain_trace()
    with httpx.Client(base_url=embedded.server_url(), timeout=60) as http:
        _gen(http, text="1", sampling_params={"max_new_tokens": 2})
        http.post("/update_weights_from_disk", json={"model_path": embedded.model_path})
    names = [e["name"] for e in embedded.drain_trace()]
    for name in ("process_name", "queued", "first_token", "request", "weight_update"):
        assert name in names, names
    assert embedded.drain_trace() == []


# ---------------------------------------------------------------------------------------------- OpenAI API
def test_openai_client_completions_and_chat(server):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="12+3=", max_tokens=5, temperature=0, logprobs=1,
                                     extra_body={"ignore_eos": True})
    choice = done.choices[0]
    assert choice.finish_reason == "length" and done.usage.completion_tokens == 5
    assert len(choice.logprobs.token_logprobs) == 5 and isinstance(choice.text, str)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "321"}], max_tokens=4,
                                          n=2, temperature=1.0, seed=3)
    assert len(chat.choices) == 2 and all(c.message.role == "assistant" for c in chat.choices)
    assert chat.usage.completion_tokens > 0 and chat.choices[0].finish_reason in ("stop", "length")
    streamed = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "321"}],
                                              max_tokens=4, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    pieces = list(streamed)
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "321"}], max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert text == whole.choices[0].message.content and pieces[-1].choices[0].finish_reason == "length"
    parts = client.chat.completions.create(  # text content parts: joined, the same prompt as the string
        model=model, messages=[{"role": "user", "content": [{"type": "text", "text": "321"}]}], max_tokens=4,
        temperature=0, extra_body={"ignore_eos": True})
    assert parts.choices[0].message.content == whole.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="not a vision-language model"):
        client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])


def test_session_starts_one_server_per_rollout_worker(recipe, tmp_path):
    from rlflow.engines.session.rl import RLSession
    from rlflow.engines.session.workers import prepare_data, prepare_model

    cfg = recipe(rollout={"num_workers": 2})
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    urls = session.server_urls
    assert len(urls) == 2 and len(set(urls)) == 2
    for url in urls:
        assert httpx.post(f"{url}/generate", json={"text": "12", "sampling_params": {"max_new_tokens": 2}}
                          ).status_code == 200
    session.shutdown()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{urls[0]}/health", timeout=5)


def test_router_balances_broadcasts_and_retries(model_dir):
    """Least-loaded: 4 concurrent long requests spread 2/2 over two workers; abort_all through the router
    reaches both; with one worker's server gone, requests are retried on the other."""
    from rlflow.engines.rollout.router import RolloutRouter

    backends = [TorchRolloutBackend(model_dir, threads=1, batch_size=4) for _ in range(2)]
    router = RolloutRouter([b.start_server() for b in backends])
    try:
        threads, finals = _long_streams(router.url, 4)
        with httpx.Client(base_url=router.url, timeout=60) as http:
            assert [w["in_flight"] for w in http.get("/workers").json()["workers"]] == [2, 2]
            r = http.post("/abort_request", json={"abort_all": True})
            assert r.status_code == 200 and r.json()["success"]
            for t in threads:
                t.join()
            assert [f["meta_info"]["finish_reason"]["type"] for f in finals] == ["abort"] * 4

            backends[0].server.stop()  # worker 0 is gone: its share is retried on worker 1
            for i in range(3):
                assert _gen(http, text=str(i), sampling_params={"max_new_tokens": 2})["meta_info"]["id"]
            workers = http.get("/workers").json()["workers"]
            assert workers[0]["healthy"] is False and workers[1]["healthy"] is True
            assert http.get("/health").status_code == 200
    finally:
        router.stop()
        for b in backends:
            b.close()


# ---- the standalone server (`python -m rlflow.engines.rollout.launch`) and its control token --------------------
def _launch_standalone(model_dir: str, *flags: str, port: int | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlflow.engines.rollout.launch", "--model-path", model_dir, "--device", "cpu",
         "--port", str(port or free_port()), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})


def test_the_standalone_server_needs_a_token_or_says_it_serves_without(model_dir):
    """Without --api-key it refuses to start, naming both ways on (it served its control routes open, silently);
    --api-key with --insecure-no-token is refused too. Both before the model is loaded."""
    for flags, expected in (((), "give --api-key KEY"), (("--api-key=k", "--insecure-no-token"), "give one")):
        proc = _launch_standalone(model_dir, *flags)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and expected in err and "--insecure-no-token" in err, err


def test_insecure_no_token_serves_the_control_routes_open_and_warns(model_dir):
    port = free_port()
    proc = _launch_standalone(model_dir, "--insecure-no-token", port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200  # no token asked: as told
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "WARNING: --insecure-no-token: the control routes" in err and url in err, err
