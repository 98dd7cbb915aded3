"""A verifier reward for GSM8K-style math answers, built on math-verify (Hugging Face's maintained answer parser).

math-verify extracts the final answer from free text (\\boxed{...}, "the answer is ...", LaTeX, or the last
number) and compares it with the gold answer symbolically (3/4 == 0.75, 1,000 == 1000). Two things are ours:
GSM8K's own "#### <answer>" anchor, which math-verify does not know (we cut the text after the last "####"
first), and its timeouts, which use signal.alarm and so only work in the main thread: the reward stage runs in
Prefect's and Ray's worker threads, so there we turn them off and bound the work by parsing only the last
`max_chars` characters of a response instead.

    reward:
      fn: rlflow.engines.data.math_reward:gsm8k_reward
      kwargs: {format_weight: 0.0}
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

from rlflow.engines.data.builtin_tasks import write_rows_atomic
from rlflow.engines.data.prompts import load_prompts

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as e:  # an optional extra: the reward names the install command when the recipe is validated
    raise ImportError("rlflow.engines.data.math_reward needs math-verify: pip install 'rlflow[math]'") from e

MARKER = "####"
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: "48/2 = <<48/2=24>>24"
_EXTRACTION = [LatexExtractionConfig(), ExprExtractionConfig()]
DEFAULT_INSTRUCTION = ("Solve the problem step by step, then give the final answer on its own last line as "
                       "'#### <answer>'.")


def _timeout() -> int | None:
    """math-verify's timeouts use signal.alarm, which only the main thread may set."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def final_answer_text(text: str) -> str:
    """The part of a response that holds its final answer: the line after the last '####' when there is one
    (GSM8K's format), else the whole text (math-verify finds \\boxed{}, 'the answer is', or the last number)."""
    _, marker, tail = text.rpartition(MARKER)
    if not marker:
        return text
    lines = tail.strip().splitlines()
    return lines[0] if lines else ""


def gold_answer(label: Any) -> str:
    """The reference answer from a label: a plain answer ('72', '1,000') or a GSM8K solution ending '#### 72'."""
    return final_answer_text(str(label)).replace(",", "").strip()


def is_correct(response: str, label: Any, max_chars: int = 2000) -> bool:
    """Whether the response's final answer equals the label's, as math-verify compares them."""
    timeout = _timeout()
    gold = parse(gold_answer(label), _EXTRACTION, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"gsm8k_reward: cannot read a number or expression in the label {str(label)[-80:]!r}")
    answer = parse(final_answer_text(response)[-max_chars:], _EXTRACTION, parsing_timeout=timeout)
    return bool(answer) and verify(gold, answer, timeout_seconds=timeout)


def gsm8k_reward(
    prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any], *, format_weight: float = 0.0,
    max_chars: int = 2000,
) -> list[float]:
    """1 for a correct final answer, else 0; plus format_weight for a response that states it after '####'
    (a small shaping term for models that have not learnt the format yet; 0 disables it)."""
    out = []
    for response, label in zip(responses, labels, strict=True):
        score = float(is_correct(response, label, max_chars))
        if format_weight and MARKER in response:
            score += format_weight
        out.append(score)
    return out


def convert_gsm8k(input_path: str, out_path: str, instruction: str | None = None) -> int:
    """GSM8K rows (question, answer: a worked solution ending '#### N') -> rlflow rows: prompt (the question and
    the instruction), label (N), response (the solution without calculator annotations, for SFT)."""
    instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
    rows = []
    for row in load_prompts(input_path, "question", "answer"):
        solution = str(row["label"])
        if MARKER not in solution:
            raise ValueError(f"{input_path}: an answer without '{MARKER} <final answer>': {solution[-80:]!r}")
        body, _, final = solution.rpartition(MARKER)
        response = f"{_CALCULATOR.sub('', body).strip()}\n{MARKER} {final.strip()}"
        prompt = f"{row['prompt'].strip()}\n{instruction}" if instruction else row["prompt"].strip()
        rows.append({"prompt": prompt, "label": gold_answer(solution), "response": response})
    write_rows_atomic(rows, out_path)
    return len(rows)
