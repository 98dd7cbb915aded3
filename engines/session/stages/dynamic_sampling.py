"""Dynamic sampling's rollout (engines/rollout/dynamic_sampling.py): prompts_per_step groups whose rewards differ,
taking prompts from the data as needed and scoring each group as it finishes; what is left over carries into the
next step."""

from __future__ import annotations

import asyncio

import numpy as np

from rlflow.engines.rollout.dynamic_sampling import collect_groups
from rlflow.engines.rollout.functions import PromptSample, Sample
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.session.stages.prompting import prompt_samples, sampling, step_seed
from rlflow.engines.session.stages.reward import fill_rewards, response_texts


def collect(s: RunEngines, step: int) -> tuple[list[PromptSample], list[list[Sample]], dict[str, float]]:
    """The step's prompts, their groups and the collection's metrics. A retried rollout of the same step starts
    again from the same cursor and carry."""
    r, ds = s.cfg.rollout, s.cfg.rollout.dynamic_sampling
    carry = s.prompts.begin_dynamic(step)
    taken = 0

    def next_prompts(k: int) -> list[PromptSample]:
        nonlocal taken
        rows = s.prompts.next_rows(k)
        prompts = prompt_samples(s, rows, r.samples_per_prompt, step_seed(s, step) + taken * r.samples_per_prompt)
        for i, p in enumerate(prompts):
            p.index = taken + i
        taken += k
        return prompts

    async def score(prompt: PromptSample, samples: list[Sample]) -> list[float]:
        texts = await asyncio.to_thread(response_texts, s, [x.response_ids for x in samples],
                                        [x.response for x in samples], [x.finish_reason == "stop" for x in samples])
        for x, text in zip(samples, texts, strict=True):
            x.response = text
        given = np.array([np.nan if x.reward is None else x.reward for x in samples])
        return await asyncio.to_thread(fill_rewards, s, [prompt.prompt] * len(samples), texts,
                                       [prompt.label] * len(samples), given,
                                       [prompt.row.get("meta", {})] * len(samples))

    collected = s.runner.submit(collect_groups(
        s.rollout_fn, s.runner.name, s.runner.router_url, sampling(s, r.temperature),
        r.prompts_per_step, next_prompts, score, carry, over_sample=ds.over_sample,
        max_prompts=ds.max_prompts or 4 * r.prompts_per_step, partial=ds.partial_rollout))
    s.prompts.end_dynamic(step, collected.carry)
    return [p for p, _ in collected.groups], [g for _, g in collected.groups], collected.metrics
