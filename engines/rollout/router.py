"""One HTTP endpoint in front of every rollout worker's server: a least-loaded balancer.

Generation requests (`/generate`, `/v1/completions`, `/v1/chat/completions`) go to the healthy worker
with the fewest requests in flight through this router (ties: the lowest index), streamed or not. A
worker that cannot be reached is marked unhealthy and the request is retried on the next one;
`/health` probes bring it back. Control routes (`/abort_request`, `/flush_cache`, weight, LoRA adapter and
memory routes) go to every worker. sglang-router can front the embedded servers for generation too
(docs/rollout.md), but it does not forward abort or weight routes; this router does. `GET /metrics` is the
router's own view of its workers, `GET /metrics/targets` the addresses to scrape each worker's own /metrics at
(engines/rollout/metrics.py).

`start_router` picks the router of a run (`rollout.router`): sglang-router (engines/rollout/sglang_router.py) for the
SGLang backend when it is installed, this one otherwise and for the embedded engine, whose batched /generate
sglang-router refuses.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlflow.engines.core.config import RolloutConfig
from rlflow.engines.rollout.http_api import BackgroundServer, auth_headers, require_token
from rlflow.engines.rollout.metrics import RouterCollector, RouterCounters, add_metrics_route, add_targets_route
from rlflow.engines.rollout.sglang_router import SGLangRouter, sglang_router_installed

log = logging.getLogger(__name__)

GENERATION = ("/generate", "/v1/completions", "/v1/chat/completions")
BROADCAST = ("/abort_request", "/flush_cache", "/update_weights_from_disk", "/update_weights_from_tensor",
             "/release_memory_occupation", "/resume_memory_occupation", "/load_lora_adapter", "/unload_lora_adapter",
             "/update_weight_version")


@dataclass
class Worker:
    url: str
    in_flight: int = 0
    healthy: bool = True
    served: int = 0  # requests sent to it
    failovers: int = 0  # requests it failed, sent again to another worker


class NoWorker(RuntimeError):
    pass


def build_router_app(workers: list[Worker], token: str | None = None) -> FastAPI:
    """The router's routes; with `token`, its control routes need it (as the workers' do), and every request it
    sends a worker carries it."""
    app = FastAPI(title="rlflow rollout router")
    require_token(app, token)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10), headers=auth_headers(token))
    lock = asyncio.Lock()
    counters = RouterCounters()

    async def pick(tried: set[str]) -> Worker:
        async with lock:  # choose and count in one step, so concurrent requests spread out
            free = [w for w in workers if w.healthy and w.url not in tried]
            if not free:
                raise NoWorker(f"no healthy rollout worker left (tried {sorted(tried)})")
            worker = min(free, key=lambda w: w.in_flight)
            worker.in_flight += 1
            worker.served += 1
            return worker

    async def forward(path: str, body: bytes, headers: dict) -> Response:
        tried: set[str] = set()
        try:
            parsed = json.loads(body or b"{}")
        except json.JSONDecodeError:
            return JSONResponse({"error": {"message": "request body: not JSON", "code": 400}}, status_code=400)
        stream = isinstance(parsed, dict) and bool(parsed.get("stream"))
        while True:
            worker = await pick(tried)
            tried.add(worker.url)
            try:
                req = client.build_request("POST", worker.url + path, content=body, headers=headers)
                upstream = await client.send(req, stream=True)
            except httpx.TransportError:
                worker.in_flight -= 1
                worker.healthy = False  # retried on another worker; /health probes bring it back
                worker.failovers += 1
                continue
            if stream:
                async def relay(upstream=upstream, worker=worker):
                    try:
                        async for chunk in upstream.aiter_raw():
                            yield chunk
                    finally:
                        await upstream.aclose()
                        worker.in_flight -= 1

                return StreamingResponse(relay(), status_code=upstream.status_code,
                                         media_type=upstream.headers.get("content-type"))
            try:
                content = await upstream.aread()
            except httpx.TransportError:  # the worker died mid-request: generate it again elsewhere
                worker.healthy = False
                worker.failovers += 1
                continue
            finally:
                await upstream.aclose()
                worker.in_flight -= 1
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type"))

    for path in GENERATION:
        async def route(request: Request, path: str = path) -> Response:
            try:
                return await forward(path, await request.body(), {"content-type": "application/json"})
            except NoWorker as exc:
                counters.no_worker += 1
                return JSONResponse({"error": {"message": str(exc), "code": 503}}, status_code=503)

        app.add_api_route(path, route, methods=["POST"])

    for path in BROADCAST:
        async def broadcast(request: Request, path: str = path) -> Response:
            body = await request.body()
            answers = await asyncio.gather(*(client.post(w.url + path, content=body,
                                                         headers={"content-type": "application/json"})
                                             for w in workers if w.healthy), return_exceptions=True)
            failed = [str(a) if isinstance(a, Exception) else f"{a.status_code} {a.text[:200]}"
                      for a in answers if isinstance(a, Exception) or a.status_code != 200]
            if failed:
                return JSONResponse({"success": False, "message": "; ".join(failed)}, status_code=400)
            return JSONResponse({"success": True, "message": f"{path} on {len(answers)} workers"})

        app.add_api_route(path, broadcast, methods=["POST"])

    @app.get("/health")
    async def health():
        async def probe(w: Worker) -> None:
            try:
                w.healthy = (await client.get(w.url + "/health", timeout=5)).status_code == 200
            except httpx.TransportError:
                w.healthy = False

        await asyncio.gather(*(probe(w) for w in workers))
        return Response(status_code=200 if any(w.healthy for w in workers) else 503)

    @app.get("/workers")
    async def list_workers():
        return {"workers": [{"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight, "served": w.served}
                            for w in workers]}

    @app.get("/get_model_info")
    async def model_info() -> Response:
        r = await client.get(workers[0].url + "/get_model_info")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    # its own view of the workers only: each worker is scraped itself, at the address /metrics/targets lists
    add_metrics_route(app, RouterCollector(workers, counters))
    add_targets_route(app, workers)
    return app


class RolloutRouter:
    """The router served by uvicorn from a background thread on an ephemeral port."""

    kind = "rlflow"

    def __init__(self, worker_urls: list[str], host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        """`token`: the run's control token: required on the router's control routes, sent with every request
        to the workers. It runs in the driver's process; the session binds it to the driver's node address when
        the run spans nodes, loopback otherwise."""
        if not worker_urls:
            raise ValueError("RolloutRouter: worker_urls is empty")
        self.workers = [Worker(u.rstrip("/")) for u in worker_urls]
        self._server = BackgroundServer(build_router_app(self.workers, token), "rollout router", host, port)
        self.url = self._server.url
        log.info("rollout router on %s (Prometheus targets: %s/metrics/targets)", self.url, self.url)

    def replace(self, index: int, url: str) -> None:
        """A restarted worker's server takes worker `index`'s place (requests in flight to the old one were
        already retried elsewhere)."""
        self.workers[index] = Worker(url.rstrip("/"))  # the app shares this list

    def stop(self) -> None:
        self._server.stop()


def router_kind(cfg: RolloutConfig) -> str:
    """The router a run's rollout workers get: rollout.router, `auto` resolved (sglang-router for the SGLang backend
    where it is installed, rlflow's own otherwise)."""
    if cfg.router != "auto":
        return cfg.router
    return "sglang-router" if cfg.backend == "sglang" and sglang_router_installed() else "rlflow"


def start_router(cfg: RolloutConfig, worker_urls: list[str], host: str, token: str | None
                 ) -> RolloutRouter | SGLangRouter:
    """The router in front of the workers' servers, on `host`, with the run's control token."""
    if router_kind(cfg) == "sglang-router":
        return SGLangRouter(worker_urls, host, token=token)
    return RolloutRouter(worker_urls, host, token=token)
