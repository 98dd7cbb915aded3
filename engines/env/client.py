"""The driver's side of the env hosts: episodes placed on hosts with room, their calls coalesced into one batched
call per host (the rollout loop's pending calls go out together, as functions.generate batches /generate), and a
failure turned into an EnvError naming the environment, the episode and what went wrong."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from rlflow.engines.cluster.groups import init_ray
from rlflow.engines.core.config import ClusterConfig, EnvConfig, SandboxConfig
from rlflow.engines.env.host import EnvHost, load_env_class
from rlflow.engines.env.protocol import EnvError

KINDS = {"raised": "raised", "timeout": "timed out", "malformed": "returned a malformed result"}


class EnvClient:
    """Episodes over `hosts` (EnvHost objects in this process, or Ray actor handles of EnvHost), at most `capacity`
    live on each; used from one event loop (the rollout runner's)."""

    def __init__(self, cfg: EnvConfig, hosts: list[Any], remote: bool):
        self.cfg, self.hosts, self.remote = cfg, hosts, remote
        self.live = [0] * len(hosts)
        self._room: asyncio.Condition | None = None
        self._pending: dict[int, list[tuple[dict, asyncio.Future]]] = {}
        self.calls = 0  # batched calls made to hosts (a test checks they are far fewer than operations)

    # ---- episodes -------------------------------------------------------------------------------------------
    async def reset(self, key: str, sample: dict) -> tuple[int, dict]:
        """A slot on the least-loaded host with room (waiting for one), and the episode's first observation."""
        if self._room is None:
            self._room = asyncio.Condition()
        async with self._room:
            await self._room.wait_for(lambda: min(self.live) < self.cfg.episodes_per_actor)
            host = min(range(len(self.hosts)), key=self.live.__getitem__)
            self.live[host] += 1
        try:
            result = await self._call(host, {"op": "reset", "episode": key, "sample": sample}, "reset", key)
        except BaseException:
            await self.close(host, key)
            raise
        return host, result["observation"]

    async def step(self, host: int, key: str, action: dict) -> dict:
        """{"observation", "reward", "done", "info"} of the episode's next step."""
        return await self._call(host, {"op": "step", "episode": key, "action": action}, "step", key)

    async def close(self, host: int, key: str) -> None:
        """Drop the episode's environment and free its slot (errors of its close are ignored: it is over)."""
        try:
            await self._call(host, {"op": "close", "episode": key}, "close", key)
        except EnvError:
            pass
        finally:
            async with self._room:
                self.live[host] -= 1
                self._room.notify_all()

    # ---- batching ---------------------------------------------------------------------------------------------
    async def _call(self, host: int, op: dict, what: str, key: str) -> dict:
        fut = asyncio.get_running_loop().create_future()
        queue = self._pending.setdefault(host, [])
        if not queue:
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush(host)))
        queue.append((op, fut))
        result = await fut
        if "error" in result:
            e = result["error"]
            detail = f"{e['type']}: {e['message']}" if e["kind"] == "raised" else e["message"]
            raise EnvError(f"rollout.env: {self.cfg.cls} {KINDS[e['kind']]} in {what} of episode {key}: {detail}"
                           + (f"\n{e['traceback']}" if e.get("traceback") else ""))
        return result

    async def _flush(self, host: int) -> None:
        batch = self._pending.pop(host, [])
        if not batch:
            return
        self.calls += 1
        ops = [op for op, _ in batch]
        try:
            if self.remote:
                # the host answers each op within step_timeout_s; the margin covers a host that is itself stuck
                ref = self.hosts[host].call_batch.remote(ops)
                results = await asyncio.wait_for(ref, self.cfg.step_timeout_s * 2 + 30)
            else:
                results = await self.hosts[host].call_batch(ops)
        except Exception as exc:  # noqa: BLE001 - the host itself failed (its actor died): every op fails, named
            err = EnvError(f"rollout.env: env host {host} of {self.cfg.cls} failed: {type(exc).__name__}: {exc}")
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    def stats(self) -> list[dict]:
        """Each host's counts (episodes, steps, errors, live, sandbox_peak)."""
        if self.remote:
            return ray.get([h.stats.remote() for h in self.hosts])
        return [h.stats() for h in self.hosts]

    def close_hosts(self) -> None:
        for h in self.hosts:
            if self.remote:
                ray.kill(h)
            else:
                h.close()


def start_env_hosts(cfg: EnvConfig, sandbox: SandboxConfig, use_ray: bool,
                    cluster: ClusterConfig | None = None) -> EnvClient:
    """cfg.actors env hosts (Ray actors, or objects here); the class is imported here first, so a wrong path fails
    before any actor starts. Their arguments are plain data."""
    load_env_class(cfg.cls)
    args = (cfg.cls, dict(cfg.kwargs), cfg.episodes_per_actor, cfg.step_timeout_s, sandbox.model_dump())
    if not use_ray:
        return EnvClient(cfg, [EnvHost(*args) for _ in range(cfg.actors)], remote=False)
    init_ray(cluster or ClusterConfig())
    actor = ray.remote(num_cpus=0)(EnvHost)
    hosts = [actor.options(max_concurrency=max(2, cfg.episodes_per_actor)).remote(*args) for _ in range(cfg.actors)]
    ray.get([h.__ray_ready__.remote() for h in hosts])
    return EnvClient(cfg, hosts, remote=True)
