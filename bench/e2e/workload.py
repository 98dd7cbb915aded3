"""The RL workload of bench/train/scale.py as a rollout function (`rollout.fn: bench.e2e.workload:fixed_lengths`),
for end-to-end runs on random weights (bench/e2e/grpo.py).

Every sample gets a 256-token prompt of random ids and a response whose length is drawn uniformly from 64-1,792
and generated to that length (`ignore_eos`), all from the prompt's seed. A step's token count then does not depend
on what random weights happen to emit, and every mode of a benchmark generates the same lengths. The recipe's
`rollout.max_new_tokens` caps the drawn lengths (a smoke run's short responses).

`long_tail` (issue 45 item 7) draws the lengths from a lognormal instead, as reasoning RL produces them: median
3,000 tokens, sigma 1.0, capped by `rollout.max_new_tokens` (28,672 in bench/e2e/grpo.py's `--workload long-tail`),
so about 1 sample in 50 runs to the cap while most of the batch is done, the shape where a synchronous step waits
on its slowest sample and asynchronous rollout (max_staleness >= 2: generations continue across weight updates)
keeps the GPUs busy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

from rlflow.engines.rollout.functions import PromptSample, Sample, generate, sample_from_item

PROMPT_TOKENS = 256
RESPONSE_TOKENS = (64, 1792)
LONG_TAIL = (math.log(3000), 1.0)  # lognormal (mu, sigma) of long_tail's response lengths: median 3,000 tokens
LONG_TAIL_MIN = 64


async def fixed_lengths(prompt: PromptSample, router_url: str, sampling_params: dict) -> list[Sample]:
    """prompt.n samples of the workload's shape; the dataset's own prompt text is not used."""
    rng = random.Random(prompt.seed)
    ids = [rng.randrange(3, len(prompt.tokenizer)) for _ in range(PROMPT_TOKENS)]
    cap = sampling_params.get("max_new_tokens") or RESPONSE_TOKENS[1]
    lengths = [min(rng.randint(*RESPONSE_TOKENS), cap) for _ in range(prompt.n)]
    return await _generate_to(prompt, ids, lengths, router_url, sampling_params)


async def long_tail(prompt: PromptSample, router_url: str, sampling_params: dict) -> list[Sample]:
    """prompt.n samples with lognormal lengths (LONG_TAIL) capped by max_new_tokens."""
    rng = random.Random(prompt.seed)
    ids = [rng.randrange(3, len(prompt.tokenizer)) for _ in range(PROMPT_TOKENS)]
    cap = sampling_params.get("max_new_tokens") or 28672
    lengths = [max(LONG_TAIL_MIN, min(int(rng.lognormvariate(*LONG_TAIL)), cap)) for _ in range(prompt.n)]
    return await _generate_to(prompt, ids, lengths, router_url, sampling_params)


async def _generate_to(prompt: PromptSample, ids: list[int], lengths: list[int], router_url: str,
                       sampling_params: dict) -> list[Sample]:
    """One sample of each length, generated to that length (ignore_eos), sample j with seed prompt.seed + j."""
    items = await asyncio.gather(*(
        generate(router_url, ids, sampling_params | {"max_new_tokens": n, "ignore_eos": True,
                                                     "sampling_seed": prompt.seed + j})
        for j, n in enumerate(lengths)
    ))
    return [dataclasses.replace(sample_from_item(item), prompt_ids=ids) for item in items]
