"""A tool-use environment: the model calls a python tool, run in the sandbox, to compute what it cannot do in its
head (the `mul` task: "37*12=" -> 444), then answers.

In the demo's character vocabulary (model.extra_chars "*"), an episode reads
    prompt            the question                                    "37*12="
    turn 1 (model)    a python expression, ended by "=" (a stop)      "37*12="
    observation       what `print(<expression>)` wrote, then "R"      "444R"        (loss mask 0)
    turn 2 (model)    the answer, then EOS                            "444"
A turn that does not end with "=" is the answer: the episode ends with reward match_reward(answer, label) (partial
credit by position, as the demo's tasks). A tool call past max_tool_calls ends the episode with reward 0.

The expression runs as untrusted code (SandboxPool, config `sandbox`): no network, read-only filesystem, its own
limits. Its stdout, cut to `max_result_chars` and to characters of the vocabulary, is the observation. Results are
cached per host process by source text (the code is a pure expression under fixed limits, and a group's samples
mostly write the same one), so a step costs about one sandbox call per distinct expression.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from rlflow.engines.data.rewards import match_reward
from rlflow.engines.env.pool import SandboxPool

TOOL_END = "R"
CALL_END = "="
LIMITS = {"cpu_seconds": 2, "wall_seconds": 10, "memory_mb": 256, "max_processes": 4}
_CACHE: OrderedDict[str, tuple[str, bool]] = OrderedDict()  # source -> (observation text, ran in the sandbox ok)
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 65536


class PythonToolEnv:
    """reset: the prompt as it is; step: a tool call (text ending with "=") runs in the sandbox, anything else is
    the answer."""

    def __init__(self, sandbox: SandboxPool, max_tool_calls: int = 1, max_result_chars: int = 8,
                 result_chars: str = "0123456789", cache: bool = True):
        self.sandbox, self.max_tool_calls, self.max_result_chars = sandbox, max_tool_calls, max_result_chars
        self.result_chars, self.cache = set(result_chars), cache
        self.label, self.calls = "", 0

    def reset(self, sample: dict) -> None:
        self.label, self.calls = str(sample["label"]), 0
        return None

    def step(self, action: dict) -> tuple[str | None, float, bool, dict]:
        text = action["text"]
        if not text.endswith(CALL_END):
            return None, match_reward([""], [text], [self.label])[0], True, {"answer": text, "tool_calls": self.calls}
        if self.calls >= self.max_tool_calls:
            return None, 0.0, True, {"answer": None, "tool_calls": self.calls, "why": "too many tool calls"}
        self.calls += 1
        result, ok, cached = self.run_tool(text.removesuffix(CALL_END))
        return result + TOOL_END, 0.0, False, {"tool_call": text, "tool_result": result, "tool_ok": ok,
                                               "cached": cached, "isolation": self.sandbox.isolation}

    def run_tool(self, expression: str) -> tuple[str, bool, bool]:
        """(observation text, the code exited 0, from the cache)."""
        source = f"print({expression})"
        if self.cache:
            with _CACHE_LOCK:
                if source in _CACHE:
                    _CACHE.move_to_end(source)
                    return (*_CACHE[source], True)
        res = self.sandbox.run_python(source, limits=LIMITS)
        out = res.stdout.decode(errors="replace").strip()[: self.max_result_chars] if res.ok else ""
        text = "".join(c for c in out if c in self.result_chars)
        if self.cache:
            with _CACHE_LOCK:
                _CACHE[source] = (text, res.ok)
                while len(_CACHE) > _CACHE_SIZE:
                    _CACHE.popitem(last=False)
        return text, res.ok, False
