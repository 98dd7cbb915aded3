"""The recipe's rewards, combined: every source of `reward.sources` (functions, reward-model worker groups, LLM
judges) scores the batch, and a sample's reward is the weighted sum. A recipe with `reward.fn` only is one
function source of weight 1, so it scores exactly as before. Each source's mean (and a judge's parse and
request failures) is kept until the reward stage takes the metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rlflow.engines.core.config import FnRewardSource, JudgeRewardSource, ModelRewardSource, RewardConfig
from rlflow.engines.core.protocols import RewardModelBackend, WorkerGroup
from rlflow.engines.data.rewards import RewardError, compute_rewards, load_callable
from rlflow.engines.reward.judge import LLMJudge, read_api_key

# a source's scores for a batch: (scores, {metric suffix: count to add})
Scorer = Callable[[list, list[str], list, list[dict]], tuple[list[float], dict[str, float]]]


def split_evenly(n: int, parts: int) -> list[slice]:
    """Contiguous shares of n items over `parts` workers, sizes differing by at most one."""
    bounds = np.linspace(0, n, parts + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def model_scorer(group: WorkerGroup[RewardModelBackend]) -> Scorer:
    """A reward model's group: the batch split among its workers, scored concurrently (Ray actors)."""

    def score(prompts: list, responses: list[str], labels: list, metas: list[dict]):
        shares = split_evenly(len(prompts), len(group))  # a worker with an empty share scores nothing
        parts = group.call_each(RewardModelBackend.score, [(prompts[s], responses[s], labels[s]) for s in shares])
        return [float(x) for part in parts for x in part], {}

    return score


def judge_scorer(judge: LLMJudge) -> Scorer:
    def score(prompts: list, responses: list[str], labels: list, metas: list[dict]):
        out = judge.score(prompts, responses, labels)
        return out.scores, {"parse_failures": out.parse_failures, "request_failures": out.request_failures}

    return score


def fn_scorer(src: FnRewardSource, field: str) -> Scorer:
    fn = load_callable(src.fn, f"{field}.fn" if field != "reward" else "reward.fn", RewardError)

    def score(prompts: list, responses: list[str], labels: list, metas: list[dict]):
        return compute_rewards(fn, prompts, responses, labels, src.kwargs, metas), {}

    return score


class RewardSources:
    """Scores samples with every source of the recipe and sums them by weight."""

    def __init__(self, cfg: RewardConfig, model_groups: Mapping[str, WorkerGroup[RewardModelBackend]] | None = None):
        self.explicit = bool(cfg.sources)  # per-source metrics only when the recipe lists sources
        self.sources = cfg.resolved_sources()
        self._judges: list[LLMJudge] = []
        self.scorers: list[tuple[str, float, Scorer]] = []
        model_groups = model_groups or {}
        for i, src in enumerate(self.sources):
            field = f"reward.sources[{i}]" if self.explicit else "reward"
            if isinstance(src, FnRewardSource):
                scorer = fn_scorer(src, field)
            elif isinstance(src, ModelRewardSource):
                if src.name not in model_groups:
                    raise ValueError(f"{field}: reward model {src.name!r} has no worker group (RLSession.create "
                                     "starts one per model source)")
                scorer = model_scorer(model_groups[src.name])
            else:
                assert isinstance(src, JudgeRewardSource)
                judge = LLMJudge(src, field, read_api_key(src, field))
                self._judges.append(judge)
                scorer = judge_scorer(judge)
            self.scorers.append((str(src.name), src.weight, scorer))
        self._lock = threading.Lock()
        self._sums: dict[str, float] = {}

    def score(self, prompts: Sequence, responses: Sequence[str], labels: Sequence, metas: Sequence[dict],
              record: bool = True) -> list[float]:
        """The weighted sum of every source's score per sample; with `record`, the sources' figures are kept for
        `take_metrics` (evaluation passes False: its samples are not the step's)."""
        prompts, responses, labels, metas = list(prompts), list(responses), list(labels), list(metas)

        def run(scorer: Scorer) -> tuple[list[float], dict[str, float], float]:
            t0 = time.perf_counter()
            scores, counts = scorer(prompts, responses, labels, metas)
            return scores, counts, time.perf_counter() - t0

        if len(self.scorers) == 1:
            results = [run(self.scorers[0][2])]
        else:  # a reward model's workers, a judge's server and a function work at the same time
            with ThreadPoolExecutor(max_workers=len(self.scorers)) as pool:
                results = list(pool.map(run, [scorer for _, _, scorer in self.scorers]))
        total = np.zeros(len(prompts))
        figures: dict[str, float] = {}
        for (name, weight, _), (scores, counts, seconds) in zip(self.scorers, results, strict=True):
            if len(scores) != len(prompts):
                raise RewardError(f"reward source {name!r} gave {len(scores)} scores for {len(prompts)} samples")
            values = np.asarray(scores, dtype=float)
            total += weight * values
            figures[f"{name}_sum"] = float(values.sum())
            figures[f"{name}_seconds"] = seconds
            figures |= {f"{name}_{k}": float(v) for k, v in counts.items()}
        if record and self.explicit:
            with self._lock:
                self._sums["n"] = self._sums.get("n", 0.0) + len(prompts)
                for k, v in figures.items():
                    self._sums[k] = self._sums.get(k, 0.0) + v
        return total.tolist()

    def take_metrics(self) -> dict[str, float]:
        """reward/<name>_mean of every source over the samples scored since the last call, the seconds it took
        (time/reward_<name>; sources score concurrently, so they overlap), and each judge's
        reward/<name>_parse_failures and _request_failures (counts), summed over judges as
        reward/judge_parse_failures."""
        with self._lock:
            sums, self._sums = self._sums, {}
        n = sums.pop("n", 0.0)
        if not n:
            return {}
        out: dict[str, Any] = {}
        for name, _, _ in self.scorers:
            out[f"reward/{name}_mean"] = sums.get(f"{name}_sum", 0.0) / n
            out[f"time/reward_{name}"] = sums.get(f"{name}_seconds", 0.0)
            for k in ("parse_failures", "request_failures"):
                if f"{name}_{k}" in sums:
                    out[f"reward/{name}_{k}"] = sums[f"{name}_{k}"]
        if self._judges:
            out["reward/judge_parse_failures"] = sum(sums.get(f"{j.src.name}_parse_failures", 0.0)
                                                     for j in self._judges)
        return out

    def close(self) -> None:
        for judge in self._judges:
            judge.close()
