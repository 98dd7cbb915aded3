"""The environment protocol: what a multi-turn task offers the env rollout (docs/agents.md).

    class MyEnv:
        def __init__(self, **kwargs): ...                  # rollout.env.kwargs; `sandbox` gets the host's SandboxPool
        def reset(self, sample: dict) -> Observation: ...  # sample: prompt, label, row, seed, episode
        def step(self, action: dict) -> tuple[Observation, float, bool, dict]: ...   # (observation, reward, done, info)

Either method may be `async def`; a sync one runs in a thread of its host, so a blocking sandbox call does not stall
the other episodes. `action` is the model's turn: {"text": decoded text, "token_ids": the engine's ids,
"finish_reason": stop|length}. An Observation is one of:
    None or ""           nothing to append (reset: the prompt is the data row's, encoded as every rollout encodes it)
    list[int]            token ids, appended as they are (token in, token out)
    str                  text, tokenized once when it arrives (no special tokens added)
    list[dict]           chat messages {"role", "content"}, rendered by the tokenizer's chat template, tokenized once
The reward of an episode is the sum of its steps' rewards. Everything crossing the host boundary is plain data.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

Observation = None | str | list[int] | list[dict]


@runtime_checkable
class Environment(Protocol):
    def reset(self, sample: dict) -> Observation: ...

    def step(self, action: dict) -> tuple[Observation, float, bool, dict]: ...


class EnvError(RuntimeError):
    """An environment failed an episode: it raised, timed out, or answered something malformed. The message names
    the environment class, the episode and what went wrong."""


class Malformed(ValueError):
    """What reset or step returned is not what the protocol expects."""


def check_observation(obs: Any) -> dict:
    """The observation as plain data ({"ids"} / {"text"} / {"messages"} / {}), or Malformed saying what was
    expected."""
    if obs is None or obs == "" or obs == []:
        return {}
    if isinstance(obs, str):
        return {"text": obs}
    if isinstance(obs, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in obs):
        return {"ids": list(obs)}
    if isinstance(obs, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                     and isinstance(m.get("content"), str) for m in obs):
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in obs]}
    shown = repr(obs)[:200]
    raise Malformed(f"malformed observation {shown} ({type(obs).__name__}); expected None, a str, a list of "
                     "non-negative token ids, or a list of {'role': str, 'content': str} messages")


def check_step(result: Any) -> dict:
    """step()'s (observation, reward, done, info) as plain data, or Malformed saying what was expected."""
    if not isinstance(result, tuple | list) or len(result) != 4:
        raise Malformed(f"step returned {repr(result)[:200]}; expected a tuple (observation, reward, done, info)")
    obs, reward, done, info = result
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise Malformed(f"step returned reward {reward!r}; expected a finite number")
    if not isinstance(done, bool):
        raise Malformed(f"step returned done {done!r}; expected True or False")
    if info is not None and not isinstance(info, dict):
        raise Malformed(f"step returned info {info!r}; expected a dict or None")
    return {"observation": check_observation(obs), "reward": float(reward), "done": done,
            "info": _plain(info or {})}


def _plain(info: dict) -> dict:
    """The JSON-like part of info (it travels back from the host; anything else is shown by its repr)."""
    def plain(v: Any) -> Any:
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return repr(v)

    return plain(info)
