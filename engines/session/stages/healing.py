"""Dead workers replaced in-run: a rollout worker whose server stopped answering (the rollout, sync and evaluate
stages check before they use them), and a reward-model worker (the reward stage checks). Both hold nothing a
fresh actor in the same bundle cannot get back: the rollout worker gets the current weights resent."""

from __future__ import annotations

import httpx

from rlflow.engines.core.protocols import RolloutBackend
from rlflow.engines.session.run_engines import RunEngines


def replace_dead_rollout_workers(s: RunEngines, probe: bool = False) -> dict[str, float]:
    """Restart every rollout worker that died: the router marked its server unreachable (its requests
    were retried on the others), or, with `probe`, its actor no longer answers. The new worker gets the
    current weights and takes the old one's place behind the router."""
    if s.router is None:
        return {}
    with s.heal_lock:
        alive = s.rollout_group.alive() if probe else [True] * len(s.rollout_group)
        dead = [i for i, w in enumerate(s.router.workers) if not alive[i] or not w.healthy]
        dead = [i for i in dead if not alive[i] or not _answers(s.router.workers[i].url)]
        for i in dead:
            s.rollout_group.restart(i)
            host, token = s.workers.rollout_host(i), s.workers.control_token
            url = s.rollout_group.call_one(i, RolloutBackend.start_server, host, 0, token)
            s.router.replace(i, url)
            s.runner.worker_urls[i] = url  # control requests the router does not forward go to each worker
        if dead:
            s.gpu.resident()  # the resend reads the trainer's weights
            s.weight_transport.reconnect()  # a connected transport connects again, the new worker included
            s.weight_transport.resend(s.weight_version)
            s.workers_restarted += len(dead)
    return {"rollout/workers_restarted": float(s.workers_restarted)} if s.workers_restarted else {}


def replace_dead_reward_workers(s: RunEngines) -> dict[str, float]:
    """Restart every reward-model worker that no longer answers. A worker holds a frozen model and nothing
    else, so a fresh actor in the same bundle is the same worker; a dead one would otherwise fail this and
    every later reward stage, the stage's retries included."""
    for group in s.workers.reward.values():
        for rank, ok in enumerate(group.alive()):
            if not ok:
                group.restart(rank)
                s.reward_workers_restarted += 1
    n = s.reward_workers_restarted
    return {"reward/workers_restarted": float(n)} if n else {}


def _answers(url: str) -> bool:
    """Whether a rollout server answers /health now (the router may have seen a passing failure)."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
