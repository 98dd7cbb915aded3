"""Multi-turn tool use: the model calls a calculator, reads its answer, and then answers itself.

Prompts are additions ("12+34="). The protocol, in the tiny demo vocabulary:
    turn 1 (model)   the expression to compute, ended by "="      e.g. "12+34="
    tool             the calculator's result and "R"             e.g. "46R"   (loss_mask 0)
    turn 2 (model)   the final answer, then EOS                   e.g. "46"
The model never has to add: it learns to copy the question into the tool call and the tool's result into
its answer. The tool's tokens are part of the sample (the model reads them in turn 2) but are masked out
of the loss, and their logprobs are 0: the policy did not produce them.

    rlflow run examples/calculator.yaml
"""

from __future__ import annotations

import asyncio
import re

from rlflow.engines.data.rewards import match_reward
from rlflow.engines.rollout.functions import PromptSample, Sample, generate, sample_from_item

TOOL_END = "R"


def calculate(expression: str) -> str:
    """The tool: a sum of non-negative integers, or "" for anything else (the model gets no help)."""
    if not re.fullmatch(r"\d{1,6}(\+\d{1,6})*", expression):
        return ""
    return str(sum(int(x) for x in expression.split("+")))


async def calculator_rollout(prompt: PromptSample, router_url: str, sampling_params: dict) -> list[Sample]:
    return list(await asyncio.gather(*(_episode(prompt, router_url, sampling_params, j) for j in range(prompt.n))))


async def _episode(prompt: PromptSample, router_url: str, sampling_params: dict, j: int) -> Sample:
    tok = prompt.tokenizer
    seed = prompt.seed + j
    call = sample_from_item(await generate(
        router_url, prompt.prompt_ids, sampling_params | {"max_new_tokens": 8, "stop": ["="], "sampling_seed": seed}))
    expression = (call.response or "").removesuffix("=")
    result = calculate(expression)
    tool_ids = tok(result + TOOL_END, add_special_tokens=False)["input_ids"]
    history = call.response_ids + tool_ids
    answer = sample_from_item(await generate(
        router_url, prompt.prompt_ids + history,
        sampling_params | {"max_new_tokens": 4, "stop": [], "sampling_seed": seed + 7_919_000}))
    question = prompt.prompt.removesuffix("=")
    text = answer.response or ""
    # partial credit for a tool call that copies the question and for the final answer (as the demo's tasks)
    reward = 0.5 * match_reward([""], [expression], [question])[0] + 0.5 * match_reward([""], [text], [prompt.label])[0]
    finish = "abort" if "abort" in (call.finish_reason, answer.finish_reason) else answer.finish_reason
    return Sample(
        response_ids=history + answer.response_ids,
        logprobs=call.logprobs + [0.0] * len(tool_ids) + answer.logprobs,
        loss_mask=[1] * len(call.response_ids) + [0] * len(tool_ids) + [1] * len(answer.response_ids),
        reward=reward, response=text, finish_reason=finish,
        weight_version=call.weight_version,  # the older of the two turns'
        last_weight_version=answer.last_weight_version,  # the newer: an update may land between the turns
        metadata={"tool_call": expression, "tool_result": result},
    )
