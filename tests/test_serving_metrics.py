"""Prometheus `/metrics` of the embedded rollout servers and the router, scraped over HTTP and read with
Prometheus' own text parser: the counters move by exactly what the routes answered, the route is open while the
control routes keep their token, and the Grafana dashboard asks only for metrics that exist."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.config import KVCacheConfig
from rlflow.engines.rollout.http_api import auth_headers, serialize_named_tensors
from rlflow.engines.rollout.metrics import ROLLOUT_METRICS, ROUTER_METRICS
from rlflow.engines.rollout.router import RolloutRouter
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend

TOKEN = "metrics-test-token"
ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana-rlflow-rollout.json"
# prompts that outgrow worker 0's pool of 10 four-token pages when they generate 20 tokens each
PROMPTS = [[1, 5, 6, 7, 15], [1, 9, 15], [1, 4, 4, 8, 9, 10, 15], [1, 6, 6, 6, 6, 7], [1, 12], [1, 3, 5, 7, 9, 11]]

Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    """Two embedded servers with a control token; worker 0's KV pool is too small for PROMPTS (it preempts)."""
    backends = [TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=8,
                                    kv_cache=KVCacheConfig(page_size=4, tokens=40)),
                TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=4)]
    for b in backends:
        b.start_server(token=TOKEN)
    yield backends
    for b in backends:
        b.close()


@pytest.fixture(scope="module")
def router(workers):
    r = RolloutRouter([b.server_url() for b in workers], token=TOKEN)
    yield r
    r.stop()


def scrape(url: str) -> Samples:
    """Every sample of `url`/metrics, by (name, labels), fetched without any token."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_generate_moves_the_counters_by_what_it_returned(workers):
    """One batched /generate: tokens generated and prompt tokens move by the sums of the answer's lengths, the
    finished requests by their finish reasons, preemptions by what the engine counted; nothing is left running,
    queued or holding a KV page."""
    backend = workers[0]
    url = backend.server_url()
    before, preempted = scrape(url), backend.engine.preemptions
    params = [{"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": i % 2 == 0, "sampling_seed": 3}
              for i in range(len(PROMPTS))]
    r = httpx.post(url + "/generate", json={"input_ids": PROMPTS, "sampling_params": params}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    after = scrape(url)
    assert delta(before, after, "rlflow_rollout_generated_tokens_total") == sum(len(o["output_ids"]) for o in out)
    assert delta(before, after, "rlflow_rollout_prompt_tokens_total") == sum(map(len, PROMPTS))
    reasons = Counter(o["meta_info"]["finish_reason"]["type"] for o in out)
    for reason in ("stop", "length", "abort", "error"):
        assert delta(before, after, "rlflow_rollout_requests_finished_total", reason=reason) == reasons[reason], reason
    preemptions = delta(before, after, "rlflow_rollout_preemptions_total")
    assert preemptions == backend.engine.preemptions - preempted > 0
    assert value(after, "rlflow_rollout_requests_running") == value(after, "rlflow_rollout_requests_queued") == 0
    assert value(after, "rlflow_rollout_kv_pages_used") == 0
    assert value(after, "rlflow_rollout_kv_pages_total") == 10
    assert value(after, "rlflow_rollout_requests_max_running") == 8


def test_weight_update_sets_the_version_and_counts_its_seconds(workers):
    """/update_weights_from_tensor with version 7: the weight version reads 7, the sync summary counts one update
    of the seconds the worker measured; /update_weight_version moves the version without a sync."""
    backend = workers[1]
    url = backend.server_url()
    before, seconds = scrape(url), backend.weight_update_seconds
    name, tensor = backend.named_tensors()[0]
    body = {"serialized_named_tensors": [serialize_named_tensors([(name, tensor)])], "weight_version": "7"}
    with httpx.Client(base_url=url, timeout=60, headers=auth_headers(TOKEN)) as http:
        assert http.post("/update_weights_from_tensor", json=body).status_code == 200
        after = scrape(url)
        assert value(after, "rlflow_rollout_weight_version") == 7
        assert delta(before, after, "rlflow_rollout_weight_sync_seconds_count") == 1
        assert delta(before, after, "rlflow_rollout_weight_sync_seconds_sum") == pytest.approx(
            backend.weight_update_seconds - seconds)
        assert value(after, "rlflow_rollout_weight_sync_last_seconds") == pytest.approx(backend.last_update_s)
        assert backend.last_update_s > 0
        answer = http.post("/update_weight_version", json={"new_version": "9", "abort_all_requests": False})
        assert answer.status_code == 200, answer.text
    again = scrape(url)
    assert value(again, "rlflow_rollout_weight_version") == 9
    assert delta(after, again, "rlflow_rollout_weight_sync_seconds_count") == 0


def test_metrics_are_open_and_read_only_while_control_routes_keep_their_token(workers, router):
    """Without a token /metrics answers (the worker's and the router's) while a control route is refused (401);
    /metrics takes no POST, and its text holds counts, not the token."""
    for url in (workers[1].server_url(), router.url):
        with httpx.Client(base_url=url, timeout=30) as http:
            answer = http.get("/metrics")
            assert answer.status_code == 200 and TOKEN not in answer.text
            assert http.post("/flush_cache").status_code == 401
            assert http.post("/update_weight_version", json={"new_version": "3"}).status_code == 401
            assert http.post("/metrics").status_code == 405
    assert value(scrape(workers[1].server_url()), "rlflow_rollout_weight_version") != 3


def test_router_reports_its_workers_and_lists_them_as_targets(workers, router):
    """Four requests through the router: its per-worker requests total moves by four in all and both workers
    served; nothing is left in flight, both are healthy. It reports no worker's own metrics (each is scraped
    itself, at the addresses /metrics/targets lists)."""
    urls = [b.server_url() for b in workers]
    before, worker_before = scrape(router.url), [scrape(u) for u in urls]
    with httpx.Client(base_url=router.url, timeout=60) as http:
        for i in range(4):
            r = http.post("/generate", json={"input_ids": [1, 5 + i], "sampling_params": {"max_new_tokens": 3}})
            assert r.status_code == 200, r.text
    after, worker_after = scrape(router.url), [scrape(u) for u in urls]
    sent = [delta(before, after, "rlflow_router_requests_total", worker=u) for u in urls]
    assert sum(sent) == 4
    for u, n, b, a in zip(urls, sent, worker_before, worker_after, strict=True):
        finished = sum(delta(b, a, "rlflow_rollout_requests_finished_total", reason=r) for r in ("stop", "length"))
        assert finished == n, u  # what the router sent a worker is what that worker finished
        assert value(after, "rlflow_router_requests_in_flight", worker=u) == 0
        assert value(after, "rlflow_router_worker_healthy", worker=u) == 1
        assert value(after, "rlflow_router_failovers_total", worker=u) == 0
    assert value(after, "rlflow_router_no_worker_total") == 0
    assert not any(name.startswith("rlflow_rollout_") for name, _ in after)  # no aggregation
    groups = httpx.get(router.url + "/metrics/targets", timeout=30).json()
    by_role = {g["labels"]["rlflow_role"]: g["targets"] for g in groups}
    assert by_role == {"router": [router.url.removeprefix("http://")],
                       "rollout": [u.removeprefix("http://") for u in urls]}


def test_router_counts_failovers_and_requests_no_worker_could_take(workers):
    """A worker that cannot be reached: the request fails over to the live one (one failover, the dead one marked
    unhealthy); a router with no live worker answers 503 and counts it."""
    dead = f"http://127.0.0.1:{free_port()}"
    live = workers[1].server_url()
    body = {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}}
    router = RolloutRouter([dead, live], token=TOKEN)
    alone = RolloutRouter([f"http://127.0.0.1:{free_port()}"], token=TOKEN)
    try:
        assert httpx.post(router.url + "/generate", json=body, timeout=60).status_code == 200
        samples = scrape(router.url)
        assert value(samples, "rlflow_router_failovers_total", worker=dead) == 1
        assert value(samples, "rlflow_router_worker_healthy", worker=dead) == 0
        assert value(samples, "rlflow_router_requests_total", worker=dead) == 1
        assert value(samples, "rlflow_router_requests_total", worker=live) == 1
        assert httpx.post(alone.url + "/generate", json=body, timeout=60).status_code == 503
        assert value(scrape(alone.url), "rlflow_router_no_worker_total") == 1
    finally:
        router.stop()
        alone.stop()


def _exposed(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def test_every_metric_is_exposed_and_documented(workers, router):
    """The names metrics.py lists are what a scrape shows (a summary as its _count and _sum), and docs/rollout.md
    names each of them."""
    exposed = _exposed(scrape(workers[0].server_url())) | _exposed(scrape(router.url))
    docs = (ROOT / "docs" / "rollout.md").read_text()
    for name in (*ROLLOUT_METRICS, *ROUTER_METRICS):
        assert name in exposed or {f"{name}_count", f"{name}_sum"} <= exposed, name
        assert f"`{name}" in docs, f"docs/rollout.md does not name {name}"


METRIC_NAME = re.compile(r"\brlflow_[a-z0-9_]+")


def test_grafana_dashboard_queries_only_metrics_that_exist(workers, router):
    """docs/grafana-rlflow-rollout.json is a Grafana dashboard whose Prometheus datasource is the variable
    DS_PROMETHEUS (picked when imported or provisioned), each panel on it, and every PromQL expression (and variable
    query) names only metrics a worker or the router exposes, at least one each."""
    exposed = _exposed(scrape(workers[0].server_url())) | _exposed(scrape(router.url))
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] >= 39 and board["title"] and board["uid"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    queries = [v["definition"] for v in variables.values() if v["type"] == "query"]
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8 and len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            assert panel["targets"], panel["title"]
    for expr in exprs + queries:
        names = set(METRIC_NAME.findall(expr))
        assert names, expr
        assert names <= exposed, f"{expr}: {sorted(names - exposed)} not exposed"
    wanted = {"rlflow_rollout_generated_tokens_total", "rlflow_rollout_requests_running",
              "rlflow_rollout_requests_queued", "rlflow_rollout_kv_pages_used", "rlflow_rollout_kv_pages_total",
              "rlflow_rollout_preemptions_total", "rlflow_rollout_weight_version",
              "rlflow_rollout_weight_sync_seconds_sum", "rlflow_router_requests_in_flight"}
    assert wanted <= {n for e in exprs for n in METRIC_NAME.findall(e)}
