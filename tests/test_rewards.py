"""Built-in verifiers, loading a user's reward by import path, and calling it (sync or async) safely."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from rlflow.engines.data.rewards import (
    RewardError,
    add_reward,
    compute_rewards,
    exact_match_reward,
    load_reward_fn,
    match_reward,
    reverse_reward,
    sort_reward,
)


@pytest.mark.parametrize(
    ("response", "expected"),
    [("1234", 1.0), (" 1234\n", 1.0), ("1243", 0.5), ("12", 0.5), ("12345", 0.8), ("", 0.0), ("4321", 0.0)],
)
def test_match_reward_partial_credit(response: str, expected: float) -> None:
    assert match_reward(["S3142="], [response], ["1234"]) == [pytest.approx(expected)]


def test_aliases_and_exact_match() -> None:
    assert sort_reward is reverse_reward is add_reward is match_reward
    assert exact_match_reward(["a", "b", "c"], ["46 ", "47", ""], ["46", "46", "46"]) == [1.0, 0.0, 0.0]
    assert match_reward(["1+2="], ["3"], [3]) == [1.0]  # non-string labels compare as text


def test_load_builtin_both_spellings() -> None:
    assert load_reward_fn("rlflow.engines.data.rewards:sort_reward") is sort_reward
    assert load_reward_fn("rlflow.engines.data.rewards.exact_match_reward") is exact_match_reward


def _write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_user_reward_from_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(
        tmp_path,
        monkeypatch,
        "my_reward_mod",
        "calls = []\n"
        "def length_reward(prompts, responses, labels, scale=1.0):\n"
        "    calls.append(len(prompts))\n"
        "    return [scale * len(r) for r in responses]\n",
    )
    fn = load_reward_fn("my_reward_mod:length_reward")
    assert compute_rewards(fn, ["p", "q"], ["ab", "abc"], ["x", "y"], {"scale": 2.0}) == [4.0, 6.0]
    import my_reward_mod

    assert my_reward_mod.calls == [2]  # one call for the whole batch


async def _async_reward(prompts, responses, labels, bonus=0.0):
    await asyncio.sleep(0)
    return [float(r == lab) + bonus for r, lab in zip(responses, labels, strict=True)]


def test_async_reward_without_running_loop() -> None:
    assert compute_rewards(_async_reward, ["a", "b"], ["1", "2"], ["1", "3"], {"bonus": 0.5}) == [1.5, 0.5]


def test_async_reward_inside_running_loop() -> None:
    async def main() -> list[float]:
        return compute_rewards(_async_reward, ["a"], ["1"], ["1"], {})

    assert asyncio.run(main()) == [1.0]


def test_sync_fn_returning_awaitable_and_array() -> None:
    def returns_coro(prompts, responses, labels):
        return _async_reward(prompts, responses, labels)

    assert compute_rewards(returns_coro, ["a"], ["1"], ["2"], {}) == [0.0]
    assert compute_rewards(lambda p, r, lab: np.array([0.25, 1]), ["a", "b"], ["", ""], ["", ""], {}) == [0.25, 1.0]


def test_load_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ["sort_reward", "rlflow.engines.data.rewards:", "a:b:c", "engines/rewards:f", ""]:
        with pytest.raises(RewardError, match=r"^reward\.fn: .*not of the form 'package\.module:function'"):
            load_reward_fn(bad)

    with pytest.raises(RewardError, match=r"^reward\.fn: cannot import module 'no_such_mod_xyz'.*ModuleNotFoundError"):
        load_reward_fn("no_such_mod_xyz:f")

    _write_module(tmp_path, monkeypatch, "broken_reward_mod", "raise RuntimeError('boom at import')\n")
    with pytest.raises(RewardError, match=r"^reward\.fn: cannot import .*RuntimeError: boom at import"):
        load_reward_fn("broken_reward_mod:f")

    mod = r"rlflow\.engines\.data\.rewards"
    with pytest.raises(RewardError, match=rf"^reward\.fn: module '{mod}' has no attribute 'nope'"):
        load_reward_fn("rlflow.engines.data.rewards:nope")

    with pytest.raises(RewardError, match=rf"^reward\.fn: '{mod}:_DOTTED' is not callable \(it is a str\)"):
        load_reward_fn("rlflow.engines.data.rewards:_DOTTED")


def _const(value):
    def reward(prompts, responses, labels):
        return value

    return reward


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1.0], r"returned 1 rewards for 2 prompts"),
        ({"a": 1.0, "b": 2.0}, r"returned a dict, expected a list of 2 floats"),
        ("10", r"returned a str"),
        (None, r"returned a NoneType"),
        ([1.0, math.nan], r"returned nan at index 1 \(prompt 'b'\), expected a finite number"),
        ([math.inf, 1.0], r"returned inf at index 0 \(prompt 'a'\), expected a finite number"),
        ([1.0, "1"], r"returned '1' \(str\) at index 1 \(prompt 'b'\), expected a number"),
        ([None, 1.0], r"returned None \(NoneType\) at index 0 \(prompt 'a'\)"),
        ([1.0, True], r"returned True \(bool\) at index 1 \(prompt 'b'\), expected a number: return floats"),
        (np.array([False, True]), r"returned False \(bool\) at index 0 \(prompt 'a'\)"),
    ],
)
def test_compute_rewards_validates_result(value, message: str) -> None:
    with pytest.raises(RewardError, match=r"^reward\.fn: .*_const\.<locals>\.reward " + message):
        compute_rewards(_const(value), ["a", "b"], ["1", "2"], ["1", "2"], {})


def test_compute_rewards_wraps_exceptions_and_checks_lengths() -> None:
    def fails(prompts, responses, labels):
        raise KeyError("label")

    with pytest.raises(RewardError, match=r"^reward\.fn: .*fails raised KeyError: 'label'") as info:
        compute_rewards(fails, ["a"], ["1"], ["1"], {})
    assert isinstance(info.value.__cause__, KeyError)

    with pytest.raises(RewardError, match=r"got an unexpected keyword argument 'scale'"):
        compute_rewards(fails, ["a"], ["1"], ["1"], {"scale": 1})
    with pytest.raises(ValueError, match="1 prompts, 2 responses and 1 labels differ"):
        compute_rewards(sort_reward, ["a"], ["1", "2"], ["1"], {})


def verl_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A reward written for verl (its default_compute_score signature), used unchanged."""
    assert data_source == "gsm8k" and extra_info["split"] == "train"
    return {"score": float(solution_str.strip() == ground_truth), "acc": 1.0}


def test_verl_compute_score_gets_each_samples_columns():
    metas = [{"data_source": "gsm8k", "extra_info": {"split": "train", "index": i}} for i in range(2)]
    assert compute_rewards(verl_compute_score, ["p", "q"], ["3", "5"], ["3", "4"], {}, metas) == [1.0, 0.0]
    with pytest.raises(RewardError, match=r'returned a dict without "score" at index 0'):
        compute_rewards(lambda data_source, solution_str, ground_truth: {"s": 1}, ["p"], ["3"], ["3"], {}, metas[:1])


def test_extra_columns_reach_a_batch_reward():
    def named(prompts, responses, labels, difficulty):
        return [float(d) for d in difficulty]

    def any_kw(prompts, responses, labels, **kw):
        return [float(len(kw["tags"][i])) for i in range(len(prompts))]

    metas = [{"difficulty": 2, "tags": ["a"]}, {"difficulty": 3, "tags": ["a", "b"]}]
    assert compute_rewards(named, ["p", "q"], ["", ""], ["", ""], {}, metas) == [2.0, 3.0]  # only what it names
    assert compute_rewards(any_kw, ["p", "q"], ["", ""], ["", ""], {}, metas) == [1.0, 2.0]
    with pytest.raises(RewardError, match=r"reward.kwargs: \['difficulty'\] are also data columns"):
        compute_rewards(named, ["p", "q"], ["", ""], ["", ""], {"difficulty": 1}, metas)
