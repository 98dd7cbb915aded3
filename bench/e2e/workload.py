"""The RL workload of bench/train/scale.py as a rollout function (`rollout.fn: bench.e2e.workload:fixed_lengths`),
for end-to-end runs on random weights (bench/e2e/grpo.py).

Every sample gets a 256-token prompt of random ids and a response whose length is drawn uniformly from 64-1,792
and generated to that length (`ignore_eos`), all from the prompt's seed. A step's token count then does not depend
on what random weights happen to emit, and every mode of a benchmark generates the same lengths. The recipe's
`rollout.max_new_tokens` caps the drawn lengths (a smoke run's short responses).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

from rlflow.engines.rollout.functions import PromptSample, Sample, generate, sample_from_item

PROMPT_TOKENS = 256
RESPONSE_TOKENS = (64, 1792)


async def fixed_lengths(prompt: PromptSample, router_url: str, sampling_params: dict) -> list[Sample]:
    """prompt.n samples of the workload's shape; the dataset's own prompt text is not used."""
    rng = random.Random(prompt.seed)
    ids = [rng.randrange(3, len(prompt.tokenizer)) for _ in range(PROMPT_TOKENS)]
    cap = sampling_params.get("max_new_tokens") or RESPONSE_TOKENS[1]
    lengths = [min(rng.randint(*RESPONSE_TOKENS), cap) for _ in range(prompt.n)]
    items = await asyncio.gather(*(
        generate(router_url, ids, sampling_params | {"max_new_tokens": n, "ignore_eos": True,
                                                     "sampling_seed": prompt.seed + j})
        for j, n in enumerate(lengths)
    ))
    return [dataclasses.replace(sample_from_item(item), prompt_ids=ids) for item in items]
