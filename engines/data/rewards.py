"""Reward functions: built-in verifiers for the built-in tasks, and loading and calling a user's reward.

A reward is f(prompts, responses, labels, **kwargs) -> list[float], called once per batch so a user's
function can batch its own work (a judge model, a sandbox); it may be sync or async. The data rows' other
columns reach it as keyword arguments, one list per column, for each column it names (all with **kwargs).
A verl reward, compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float or
{"score": float, ...}, is called once per sample with those columns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import math
import numbers
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

RewardFn = Callable[..., Any]

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"


class RewardError(ValueError):
    """A reward that cannot be loaded or returned something unusable; the message starts with "reward.fn: "."""


def _match(response: str, label: Any) -> float:
    response, label = response.strip(), str(label)
    if response == label:
        return 1.0
    hits = sum(r == c for r, c in zip(response, label, strict=False))
    return hits / max(len(label), len(response))


def match_reward(prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any], **kw: Any) -> list[float]:
    """Partial credit by position: matching characters over the longer of label and response, so a
    near-miss still gives a learning signal and padding the answer is penalised."""
    return [_match(r, lab) for r, lab in zip(responses, labels, strict=True)]


sort_reward = reverse_reward = add_reward = match_reward


def exact_match_reward(
    prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any], **kw: Any
) -> list[float]:
    """1.0 when the stripped response equals the label, else 0.0."""
    return [float(r.strip() == str(lab).strip()) for r, lab in zip(responses, labels, strict=True)]


def load_callable(path: str, field: str, error: type[Exception] = ValueError) -> Any:
    """Import "package.module:function" (or "package.module.function") named by recipe field `field`; the
    error says which step failed. User code (rewards, rollout functions) is only ever loaded this way."""
    if re.fullmatch(rf"{_DOTTED}:{_DOTTED}", path):
        module_name, attr = path.split(":")
    elif re.fullmatch(rf"{_DOTTED}\.[A-Za-z_]\w*", path):
        module_name, attr = path.rsplit(".", 1)
    else:
        raise error(f"{field}: {path!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise error(
            f"{field}: cannot import module {module_name!r} for {path!r}: {type(e).__name__}: {e}"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{field}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{field}: {path!r} is not callable (it is a {type(obj).__name__})")
    return obj


def load_reward_fn(path: str) -> RewardFn:
    return load_callable(path, "reward.fn", RewardError)


def _name(fn: RewardFn) -> str:
    qualname = getattr(fn, "__qualname__", None)
    return f"{fn.__module__}:{qualname}" if qualname and getattr(fn, "__module__", None) else repr(fn)


async def _await(aw: Awaitable[Any]) -> Any:
    return await aw


def _run_awaitable(aw: Awaitable[Any]) -> Any:
    """Finish an awaitable from sync code; inside a running loop, use a fresh loop on a fresh thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await(aw))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, _await(aw)).result()


def _validate(name: str, result: Any, n: int, prompts: Sequence[str] = ()) -> list[float]:
    """One finite float per prompt; an error names the fn, the index and (given `prompts`) the sample's prompt.
    A bool is refused: True/False as a reward is usually a pass/fail meant as 1.0/0.0, or a bug (a comparison
    returned where a score was meant), and float(True) would hide which."""

    def at(i: int) -> str:
        return f"index {i}" + (f" (prompt {prompts[i][:60]!r})" if i < len(prompts) else "")

    if hasattr(result, "tolist") and not isinstance(result, (list, tuple)):  # numpy array, torch tensor
        result = result.tolist()
    if isinstance(result, (str, bytes, dict)) or not isinstance(result, Sequence):
        raise RewardError(f"reward.fn: {name} returned a {type(result).__name__}, expected a list of {n} floats")
    if len(result) != n:
        raise RewardError(f"reward.fn: {name} returned {len(result)} rewards for {n} prompts")
    out = []
    for i, v in enumerate(result):
        if isinstance(v, bool):
            raise RewardError(f"reward.fn: {name} returned {v!r} (bool) at {at(i)}, expected a number: return "
                              "floats (e.g. 1.0 if correct else 0.0)")
        if not isinstance(v, numbers.Real):
            raise RewardError(f"reward.fn: {name} returned {v!r} ({type(v).__name__}) at {at(i)}, expected a number")
        if not math.isfinite(v):
            raise RewardError(f"reward.fn: {name} returned {v!r} at {at(i)}, expected a finite number")
        out.append(float(v))
    return out


def _parameters(fn: RewardFn) -> tuple[set[str], bool]:
    """The keyword parameters fn names, and whether it takes **kwargs."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: pass only what every reward takes
        return set(), False
    return {p.name for p in params}, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def is_verl_style(fn: RewardFn) -> bool:
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info): one sample per call."""
    return {"solution_str", "ground_truth"} <= _parameters(fn)[0]


def _verl_score(name: str, result: Any, i: int) -> Any:
    if isinstance(result, dict):  # verl lets compute_score return {"score": ..., other metrics}
        if "score" not in result:
            raise RewardError(f"reward.fn: {name} returned a dict without \"score\" at index {i}: {sorted(result)}")
        return result["score"]
    return result


def _columns(fn: RewardFn, metas: Sequence[dict], kwargs: dict[str, Any]) -> dict[str, list]:
    """The rows' other columns fn asks for, one list per column (None where a row has none)."""
    names, any_kw = _parameters(fn)
    keys = list(dict.fromkeys(k for m in metas for k in m))
    wanted = [k for k in keys if any_kw or k in names]
    clash = sorted(set(wanted) & set(kwargs))
    if clash:
        raise RewardError(f"reward.kwargs: {clash} are also data columns; rename one (columns reach the reward "
                          "as keyword arguments)")
    return {k: [m.get(k) for m in metas] for k in wanted if k not in ("prompts", "responses", "labels")}


def compute_rewards(
    fn: RewardFn,
    prompts: Sequence[str],
    responses: Sequence[str],
    labels: Sequence[Any],
    kwargs: dict[str, Any],
    metas: Sequence[dict] | None = None,
) -> list[float]:
    """Call fn once on the whole batch (a verl compute_score once per sample), awaiting it if async, and check it
    gave one finite number per prompt. `metas`: each sample's other data columns (the row's "meta")."""
    if not len(prompts) == len(responses) == len(labels):
        raise ValueError(
            f"compute_rewards: {len(prompts)} prompts, {len(responses)} responses and {len(labels)} labels differ"
        )
    metas = list(metas) if metas is not None else [{}] * len(prompts)
    name = _name(fn)
    try:
        if is_verl_style(fn):
            result = []
            extra = "extra_info" in _parameters(fn)[0]
            for i, (r, lab, m) in enumerate(zip(responses, labels, metas, strict=True)):
                info = {"extra_info": m.get("extra_info")} if extra else {}
                one = fn(data_source=m.get("data_source"), solution_str=r, ground_truth=lab, **info, **kwargs)
                result.append(_verl_score(name, _run_awaitable(one) if inspect.isawaitable(one) else one, i))
        else:
            result = fn(list(prompts), list(responses), list(labels), **_columns(fn, metas, kwargs), **kwargs)
            if inspect.isawaitable(result):
                result = _run_awaitable(result)
    except RewardError:
        raise
    except Exception as e:
        raise RewardError(f"reward.fn: {name} raised {type(e).__name__}: {e}") from e
    return _validate(name, result, len(prompts), prompts)
