"""An env host: one process's environment instances, an episode each, driven by batched calls.

`EnvHost` is a plain class (the bare loop runs it in the driver's rollout loop); `start_env_hosts` makes Ray actors
of it. A call carries many operations (reset / step / close of different episodes) and runs them concurrently, so a
step of the rollout costs one call per host, never one per episode or token. Failures come back as data naming what
went wrong (raised, timeout, malformed); the client turns them into EnvError.
"""

from __future__ import annotations

import asyncio
import inspect
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlflow.engines.core.config.sandbox import SandboxConfig
from rlflow.engines.data.rewards import load_callable
from rlflow.engines.env.pool import SandboxPool
from rlflow.engines.env.protocol import Malformed, check_observation, check_step


def load_env_class(path: str) -> type:
    """The recipe's rollout.env.cls, imported by its path (never unpickled), with reset and step."""
    cls = load_callable(path, "rollout.env.cls")
    if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise TypeError(f"rollout.env.cls: {path!r} must be a class with reset(sample) and step(action) methods "
                        "(docs/agents.md)")
    return cls


class EnvHost:
    """Up to `capacity` live episodes of one environment class; sync env methods run in a thread each, bounded by
    `step_timeout_s` (a sync call past it keeps its thread until it returns, the episode has failed already)."""

    def __init__(self, cls_path: str, kwargs: dict, capacity: int, step_timeout_s: float,
                 sandbox: dict | None = None):
        self.cls_path, self.kwargs, self.timeout = cls_path, dict(kwargs), step_timeout_s
        self.cls = load_env_class(cls_path)
        self.wants_sandbox = "sandbox" in inspect.signature(self.cls).parameters
        self.sandbox_config = SandboxConfig.model_validate(sandbox or {})
        self._sandbox: SandboxPool | None = None
        self._threads = ThreadPoolExecutor(capacity, thread_name_prefix="env")
        self.envs: dict[str, Any] = {}
        self.counts = {"episodes": 0, "steps": 0, "errors": 0}

    @property
    def sandbox(self) -> SandboxPool:
        if self._sandbox is None:  # started on first use: a host whose class needs none never probes for root
            self._sandbox = SandboxPool(self.sandbox_config)
        return self._sandbox

    async def call_batch(self, ops: list[dict]) -> list[dict]:
        """Each op {"op": reset|step|close, "episode": key, "sample"|"action": ...} -> its result, in order."""
        return list(await asyncio.gather(*(self._one(op) for op in ops)))

    def stats(self) -> dict:
        return dict(self.counts, live=len(self.envs), sandbox_peak=self._sandbox.peak if self._sandbox else 0)

    async def _one(self, op: dict) -> dict:
        kind, key = op["op"], op["episode"]
        try:
            if kind == "reset":
                kwargs = self.kwargs | ({"sandbox": self.sandbox} if self.wants_sandbox else {})
                env = self.envs[key] = self.cls(**kwargs)
                self.counts["episodes"] += 1
                return {"observation": check_observation(await self._call(env.reset, op["sample"]))}
            if kind == "step":
                self.counts["steps"] += 1
                return check_step(await self._call(self.envs[key].step, op["action"]))
            env = self.envs.pop(key, None)
            if env is not None and callable(getattr(env, "close", None)):
                await self._call(env.close)
            return {}
        except TimeoutError:
            return self._error("timeout", "TimeoutError", f"no answer within rollout.env.step_timeout_s "
                               f"({self.timeout:g} s)")
        except Malformed as e:
            return self._error("malformed", "Malformed", str(e))
        except Exception as e:  # noqa: BLE001 - the user's environment failed: reported, named, by the client
            tail = "".join(traceback.format_exception(e)[-3:])[-1500:]
            return self._error("raised", type(e).__name__, str(e), tail)

    def _error(self, kind: str, type_: str, message: str, tb: str = "") -> dict:
        self.counts["errors"] += 1
        return {"error": {"kind": kind, "type": type_, "message": message, "traceback": tb}}

    async def _call(self, method, *args) -> Any:
        if inspect.iscoroutinefunction(method):
            return await asyncio.wait_for(method(*args), self.timeout)
        future = asyncio.get_running_loop().run_in_executor(self._threads, method, *args)
        return await asyncio.wait_for(future, self.timeout)

    def close(self) -> None:
        self.envs.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.close()
