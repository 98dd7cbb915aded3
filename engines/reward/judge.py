"""An LLM judge behind an OpenAI-compatible endpoint: the recipe's rubric filled in with each sample, sent to
`<url>/chat/completions` (or `/completions`), the reply parsed for a score.

Requests go out `max_concurrency` at a time from a thread pool, each through the one retry layer
(engines/core/retry.py: timeouts, dropped connections, 429 and 5xx are retried within a deadline). A reply
without a valid score is a parse failure: it is scored `default_score` and counted, never raised, because a
judge that rambles now and then must not stop training. The API key is read from the environment variable
the recipe names, kept only in the client's headers, and never appears in a message, a repr or a log line.
"""

from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from rlflow.engines.core.config import JudgeRewardSource
from rlflow.engines.core.retry import TRANSIENT_STATUS, RetriesExhausted, RetryPolicy, is_transient


class JudgeError(RuntimeError):
    """The judge refused a request (a 4xx: a wrong key or model) or failed past its retries."""


@dataclass
class JudgeScores:
    scores: list[float]
    parse_failures: int
    request_failures: int


def read_api_key(src: JudgeRewardSource, field: str) -> str | None:
    """The key from the variable `api_key_env` names (the error names the variable, never a value)."""
    if src.api_key_env is None:
        return None
    key = os.environ.get(src.api_key_env)
    if not key:
        raise ValueError(f"{field}.api_key_env: the environment variable {src.api_key_env} is not set (it must "
                         "hold the judge's API key wherever the reward stage runs)")
    return key


def _transient(err: BaseException) -> bool:
    if isinstance(err, httpx.HTTPStatusError):
        return err.response.status_code in TRANSIENT_STATUS
    return isinstance(err, httpx.TransportError) or is_transient(err)


class LLMJudge:
    """Scores samples with one judge source; `field` (reward.sources[i]) names it in errors."""

    def __init__(self, src: JudgeRewardSource, field: str, api_key: str | None = None):
        self.src, self.field = src, field
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=src.url, timeout=src.timeout_s, headers=headers,
                                    limits=httpx.Limits(max_connections=src.max_concurrency))
        self._policy = RetryPolicy(retries=src.retries, deadline_s=src.deadline_s, backoff_s=0.5, max_backoff_s=10.0)
        self._pattern = re.compile(src.score_pattern)

    def __repr__(self) -> str:  # never the headers: they hold the key
        return f"LLMJudge({self.field}, url={self.src.url!r})"

    def prompt(self, prompt: object, response: str, label: object) -> str:
        return self.src.rubric.format(prompt=prompt, response=response, label=label)

    def parse(self, reply: str) -> float | None:
        """The score in a reply, normalized if the recipe asks; None when there is none in range."""
        m = self._pattern.search(reply)
        if m is None:
            return None
        try:
            value = float(m.group(1) if self._pattern.groups else m.group(0))
        except ValueError:
            return None
        s = self.src
        if not math.isfinite(value) or not s.min_score <= value <= s.max_score:
            return None
        return (value - s.min_score) / (s.max_score - s.min_score) if s.normalize else value

    def ask(self, content: str) -> str:
        """One request (with retries): the judge's reply text."""
        s = self.src
        body: dict = {"max_tokens": s.max_tokens, "temperature": s.temperature}
        if s.model is not None:
            body["model"] = s.model
        if s.route == "chat":
            system = [{"role": "system", "content": s.system}] if s.system else []
            body["messages"] = system + [{"role": "user", "content": content}]
            path = "/chat/completions"
        else:
            body["prompt"] = content
            path = "/completions"

        def once() -> str:
            r = self._client.post(path, json=body)
            r.raise_for_status()
            choice = r.json()["choices"][0]
            return choice["message"]["content"] if s.route == "chat" else choice["text"]

        return self._policy.call(f"{self.field} (judge at {s.url})", once, transient=_transient)

    def _one(self, prompt: object, response: str, label: object) -> tuple[float | None, bool]:
        """(the parsed score or None, whether the request itself failed past its retries)."""
        try:
            reply = self.ask(self.prompt(prompt, response, label))
        except RetriesExhausted as e:
            if self.src.on_request_failure == "fail":
                raise JudgeError(f"{self.field}: {e}") from e
            return None, True
        except httpx.HTTPStatusError as e:
            raise JudgeError(f"{self.field}: the judge at {self.src.url} answered {e.response.status_code}: "
                             f"{e.response.text[:300]}") from None  # no request in the traceback: it holds the key
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise JudgeError(f"{self.field}: the judge at {self.src.url} answered no OpenAI completion: "
                             f"{type(e).__name__}: {e}") from None
        return self.parse(reply or ""), False

    def score(self, prompts: list, responses: list[str], labels: list) -> JudgeScores:
        with ThreadPoolExecutor(max_workers=min(self.src.max_concurrency, max(len(prompts), 1))) as pool:
            results = list(pool.map(self._one, prompts, responses, labels))
        default = self.src.default_score
        return JudgeScores(scores=[default if v is None else v for v, _ in results],
                           parse_failures=sum(v is None and not failed for v, failed in results),
                           request_failures=sum(failed for _, failed in results))

    def close(self) -> None:
        self._client.close()
