"""Prometheus `GET /metrics` of the embedded rollout server and of rlflow's router.

Each server has a `CollectorRegistry` of its own, never prometheus_client's global one: several engines live in one
process (tests, the bare loop), and each must report only itself. Its one collector reads the live state when
scraped: the engine's integer counters and the router's per-worker fields are kept anyway, so nothing runs per
token for the metrics and a scrape waits for no decode step.

The router reports its own view of the workers (in flight, healthy, requests sent, failovers); it never gathers the
workers' metrics. Each worker is scraped itself, at the address the router's `/metrics/targets` lists (Prometheus'
HTTP service discovery), so a worker's series keep its own `instance` label and a restarted worker is found.

The route is unauthenticated and read-only (docs/security.md): counts, gauges and the weight version, never a
prompt, an output or the control token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

# finish reasons reported from the start (at 0), so rate() has a series before the first of each happens
FINISH_REASONS = ("stop", "length", "abort", "error")

# name (as exposed: counters end in _total, the summary is its _count and _sum) -> what it means; docs/rollout.md
# lists the same, and the dashboard test checks its queries against what a scrape shows
ROLLOUT_METRICS = {
    "rlflow_rollout_requests_running": "requests admitted to the engine (prefilling or decoding)",
    "rlflow_rollout_requests_queued": "requests waiting for a row and KV pages (preempted ones included)",
    "rlflow_rollout_requests_max_running": "rows of the engine: the most requests that run at once",
    "rlflow_rollout_generated_tokens_total": "tokens sampled (rate(): tokens/s)",
    "rlflow_rollout_prompt_tokens_total": "prompt tokens of the requests admitted (a re-prefill after preemption "
                                          "is not counted again)",
    "rlflow_rollout_requests_finished_total": "requests ended, by finish reason (stop, length, abort, error)",
    "rlflow_rollout_kv_pages_used": "KV cache pages held by requests",
    "rlflow_rollout_kv_pages_total": "KV cache pages in the pool (the scratch page left out)",
    "rlflow_rollout_preemptions_total": "requests preempted for want of a KV page (recomputed when readmitted)",
    "rlflow_rollout_weight_version": "weight version generations are stamped with now (0: the launch weights)",
    "rlflow_rollout_weight_sync_seconds": "seconds each weight update took inside the worker (a transport's "
                                          "bucket, a route's call or a LoRA adapter merge): _count and _sum",
    "rlflow_rollout_weight_sync_last_seconds": "seconds the last weight update took inside the worker",
}
ROUTER_METRICS = {
    "rlflow_router_requests_in_flight": "generation requests the router has open on each worker",
    "rlflow_router_worker_healthy": "1 while the router sends a worker requests, 0 after it failed (until /health "
                                    "finds it up)",
    "rlflow_router_requests_total": "generation requests sent to each worker (a failed-over request counts on each "
                                    "worker it was sent to)",
    "rlflow_router_failovers_total": "requests each worker failed (unreachable, or died mid-request), sent again to "
                                     "another healthy worker if one was left",
    "rlflow_router_no_worker_total": "generation requests answered 503: no healthy worker was left",
}


def _help(name: str) -> str:
    return (ROLLOUT_METRICS | ROUTER_METRICS)[name]


def _counter(name: str, value: float | None = None, labels: Sequence[str] = ()) -> CounterMetricFamily:
    """A counter family from its exposed name (prometheus_client adds `_total` back)."""
    family = CounterMetricFamily(name.removesuffix("_total"), _help(name), labels=list(labels) or None)
    if value is not None:
        family.add_metric([], value)
    return family


def _gauge(name: str, value: float | None = None, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, _help(name), labels=list(labels) or None)
    if value is not None:
        family.add_metric([], value)
    return family


class RolloutCollector(Collector):
    """The engine's load, totals and weights, read from a TorchRolloutBackend at scrape time."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        c = self.backend.engine.counters()
        yield _gauge("rlflow_rollout_requests_running", c.running)
        yield _gauge("rlflow_rollout_requests_queued", c.queued)
        yield _gauge("rlflow_rollout_requests_max_running", c.max_running)
        yield _counter("rlflow_rollout_generated_tokens_total", c.generated_tokens)
        yield _counter("rlflow_rollout_prompt_tokens_total", c.prompt_tokens)
        finished = _counter("rlflow_rollout_requests_finished_total", labels=["reason"])
        for reason in sorted(set(FINISH_REASONS) | set(c.finished)):
            finished.add_metric([reason], c.finished.get(reason, 0))
        yield finished
        yield _gauge("rlflow_rollout_kv_pages_used", c.kv_pages_used)
        yield _gauge("rlflow_rollout_kv_pages_total", c.kv_pages_total)
        yield _counter("rlflow_rollout_preemptions_total", c.preemptions)
        backend = self.backend
        yield _gauge("rlflow_rollout_weight_version", backend.weight_version)
        yield SummaryMetricFamily("rlflow_rollout_weight_sync_seconds", _help("rlflow_rollout_weight_sync_seconds"),
                                  count_value=backend.weight_updates, sum_value=backend.weight_update_seconds)
        yield _gauge("rlflow_rollout_weight_sync_last_seconds", backend.last_update_s)


class RouterWorker(Protocol):
    """What the router keeps of a worker (engines/rollout/router.py Worker)."""

    url: str
    in_flight: int
    healthy: bool
    served: int
    failovers: int


@dataclass
class RouterCounters:
    """The router's counts that belong to no worker."""

    no_worker: int = 0  # generation requests answered 503


class RouterCollector(Collector):
    """The router's view of its workers, per worker URL; `workers` is the router's own list (a replaced worker's
    entry is read as it is at the scrape)."""

    def __init__(self, workers: Sequence[RouterWorker], counters: RouterCounters) -> None:
        self.workers, self.counters = workers, counters

    def collect(self) -> Iterator[Metric]:
        workers = list(self.workers)
        for name, field, kind in (("rlflow_router_requests_in_flight", "in_flight", _gauge),
                                  ("rlflow_router_worker_healthy", "healthy", _gauge),
                                  ("rlflow_router_requests_total", "served", _counter),
                                  ("rlflow_router_failovers_total", "failovers", _counter)):
            family = kind(name, labels=["worker"])
            for w in workers:
                family.add_metric([w.url], float(getattr(w, field)))
            yield family
        yield _counter("rlflow_router_no_worker_total", self.counters.no_worker)


def add_metrics_route(app: FastAPI, collector: Collector) -> None:
    """`GET /metrics` in Prometheus' text format, from a registry of this server's own."""
    registry = CollectorRegistry()
    registry.register(collector)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def add_targets_route(app: FastAPI, workers: Sequence[RouterWorker]) -> None:
    """`GET /metrics/targets`: the router and its workers in Prometheus' HTTP service-discovery format. The
    servers listen on ports the OS picks and a restarted worker gets a new one, so a static list would go stale."""

    @app.get("/metrics/targets")
    async def targets(request: Request) -> list[dict]:
        return [{"targets": [request.url.netloc], "labels": {"rlflow_role": "router"}},
                {"targets": [w.url.split("://", 1)[-1] for w in list(workers)], "labels": {"rlflow_role": "rollout"}}]
