"""Dynamic sampling (DAPO): over-sample prompts, keep only groups whose rewards differ, stop generating once
the batch is full.

A group whose samples all got the same reward has zero group-relative advantage: it costs a train step's
compute and teaches nothing. `collect_groups` starts more prompts than the batch needs, scores each group
as it finishes, keeps the informative ones, and when `need` groups are kept aborts the requests still
running. Nothing finished is thrown away: surplus groups, and the finished samples of cut-short groups, are
carried to the next step (`Carry`); the cut-short samples are generated again there, or, with partial
rollout, continued from the tokens they already have.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace

from rlflow.engines.models.routing import routing_from_text, routing_to_text
from rlflow.engines.models.vision_language import data_uri
from rlflow.engines.rollout.functions import (
    REQUEST_GROUP,
    REQUEST_TAG,
    PromptSample,
    RolloutFn,
    Sample,
    abort_tagged,
    check_group,
    end_tag,
    generate,
    image_pad_id,
    sample_from_item,
)

_tags = itertools.count()


@dataclass
class Carry:
    """A group that goes on into the next step: finished samples (with rewards) and cut-short ones."""

    prompt: PromptSample
    samples: list[Sample] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.prompt.n and all(s.finish_reason != "abort" for s in self.samples)

    def to_json(self) -> dict:
        """JSON of the group (a checkpoint's and a dynamic batch's state). A vision-language prompt keeps only its
        images' digests: the bytes are in the run store once, and from_json reads them back."""
        row = {k: v for k, v in self.prompt.row.items() if k != "images"}
        prompt = asdict(replace(self.prompt, tokenizer=None, row=row, image_data=[]))
        prompt.pop("tokenizer")
        samples = [asdict(replace(s, routed_experts=None)) | {
            "routed_experts": None if s.routed_experts is None else routing_to_text(s.routed_experts)}
            for s in self.samples]
        return {"prompt": prompt, "samples": samples}

    @classmethod
    def from_json(cls, d: dict, tokenizer, image_bytes: Callable[[str], bytes] | None = None) -> Carry:
        """The group to_json wrote; `image_bytes` reads a carried image's bytes by digest (the run store)."""
        samples = [Sample(**(s | {"routed_experts": None if s.get("routed_experts") is None
                                  else routing_from_text(s["routed_experts"], "carried sample routed_experts")}))
                   for s in d["samples"]]
        prompt = PromptSample(**d["prompt"], tokenizer=tokenizer)
        if prompt.images:
            if image_bytes is None:
                raise ValueError("a carried group names images, and no image store was given to read them")
            data = [image_bytes(digest) for digest in prompt.images]
            prompt = replace(prompt, row=prompt.row | {"images": data}, image_data=[data_uri(b) for b in data])
        return cls(prompt, samples)


@dataclass
class Collected:
    groups: list[tuple[PromptSample, list[Sample]]]  # the batch: `need` groups, rewards set on every sample
    carry: list[Carry]  # for the next step
    metrics: dict[str, float]


Score = Callable[[PromptSample, list[Sample]], Awaitable[list[float]]]


def informative(rewards: list[float]) -> bool:
    return max(rewards) > min(rewards)


async def collect_groups(
    fn: RolloutFn, name: str, router_url: str, sampling_params: dict, need: int,
    next_prompts: Callable[[int], list[PromptSample]], score: Score, carry: list[Carry], *,
    over_sample: float, max_prompts: int, partial: bool,
) -> Collected:
    """`need` informative groups (filled up with uninformative ones once `max_prompts` new prompts were
    started without enough), plus what carries over. `next_prompts(k)` takes k prompts from the data."""
    tag = f"ds{next(_tags)}"
    token = REQUEST_TAG.set(tag)
    try:
        return await _collect(fn, name, router_url, sampling_params, need, next_prompts, score, carry,
                              over_sample, max_prompts, partial, tag)
    finally:
        REQUEST_TAG.reset(token)
        end_tag(tag)


async def _collect(fn, name, router_url, sampling_params, need, next_prompts, score, carry, over_sample,
                   max_prompts, partial, tag) -> Collected:
    kept: list[tuple[PromptSample, list[Sample]]] = []
    dropped: list[tuple[PromptSample, list[Sample]]] = []
    running: dict[asyncio.Task, Carry] = {}
    started = finished_carried = 0

    async def judge(prompt: PromptSample, samples: list[Sample]) -> None:
        rewards = await score(prompt, samples)
        for s, r in zip(samples, rewards, strict=True):
            s.reward = r
        (kept if informative(rewards) else dropped).append((prompt, samples))

    def start(c: Carry) -> None:
        token = REQUEST_GROUP.set(f"{tag}:{c.prompt.index}")  # the group's requests go out on their own
        running[asyncio.ensure_future(complete(fn, name, router_url, sampling_params, c, partial))] = c
        REQUEST_GROUP.reset(token)

    for c in carry:  # last step's leftovers go first
        for s in c.samples:
            s.metadata["carried"] = True
        if c.finished:
            finished_carried += 1
            await judge(c.prompt, c.samples)
        else:
            start(c)
    while len(kept) < need:
        missing = need - len(kept)
        want = min(math.ceil(missing * over_sample) - len(running), max_prompts - started)
        if want > 0:
            for p in next_prompts(want):
                start(Carry(p))
            started += want
        if not running:
            break
        done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            c = running.pop(task)
            await judge(c.prompt, check_group(task.result(), c.prompt, name))
    filled = max(0, need - len(kept))
    kept += dropped[:filled]
    batch, surplus = kept[:need], kept[need:]
    leftover = [Carry(p, s) for p, s in surplus]
    aborted = 0
    if running:
        await abort_tagged(router_url, tag)
        for task, c in running.items():
            try:
                samples = await task
            except Exception:  # the group could not finish: its prompt starts again next step
                samples = []
            aborted += sum(s.finish_reason == "abort" for s in samples)
            leftover.append(Carry(c.prompt, samples))
    metrics = {
        "rollout/ds_prompts_started": float(started),
        "rollout/ds_kept_fraction": (len(kept) - filled) / max(1, len(kept) + len(dropped) - filled),
        "rollout/ds_filled_groups": float(filled),
        "rollout/ds_aborted_samples": float(aborted),
        "rollout/ds_carried_groups": float(len(carry)),
        "rollout/ds_carried_finished": float(finished_carried),
    }
    return Collected(batch, leftover, metrics)


async def complete(fn: RolloutFn, name: str, router_url: str, sampling_params: dict, c: Carry,
                   partial: bool) -> list[Sample]:
    """The group of `c`: a fresh rollout for a prompt with no samples; otherwise its finished samples kept
    and the cut-short ones generated again (or continued from their tokens, with partial rollout)."""
    prompt = c.prompt
    if not c.samples:
        return await fn(prompt, router_url, dict(sampling_params))
    todo = [j for j, s in enumerate(c.samples) if s.finish_reason == "abort"]
    out = list(c.samples)
    if partial:
        redone = await asyncio.gather(*(continue_sample(router_url, prompt, c.samples[j], sampling_params, j)
                                        for j in todo))
    else:
        again = replace(prompt, n=len(todo), seed=prompt.seed + prompt.n)
        redone = check_group(await fn(again, router_url, dict(sampling_params)), again, name)
    for j, s in zip(todo, redone, strict=True):
        out[j] = s
    return out


async def continue_sample(router_url: str, prompt: PromptSample, s: Sample, sampling_params: dict,
                          j: int) -> Sample:
    """Partial rollout: generate the rest of a cut-short single-turn sample after the tokens it has."""
    left = sampling_params["max_new_tokens"] - len(s.response_ids)
    if left <= 0:
        return replace(s, finish_reason="length")
    params = sampling_params | {"max_new_tokens": left, "sampling_seed": prompt.seed + prompt.n + j}
    rest = sample_from_item(await generate(router_url, prompt.prompt_ids + s.response_ids, params,
                                           return_routed_experts=prompt.record_routing,
                                           image_data=prompt.image_data or None, image_pad_id=image_pad_id(prompt)))
    # the continuation's prefill recorded the experts of every token before it: its record covers the sample
    return replace(
        s, response_ids=s.response_ids + rest.response_ids, logprobs=(s.logprobs or []) + (rest.logprobs or []),
        response=None, finish_reason=rest.finish_reason,
        weight_version=min((v for v in (s.weight_version, rest.weight_version) if v is not None), default=None),
        last_weight_version=max((v for v in (s.last_weight_version, s.weight_version, rest.last_weight_version)
                                 if v is not None), default=None),
        metadata=s.metadata | {"partial": True}, routed_experts=rest.routed_experts,
    )

