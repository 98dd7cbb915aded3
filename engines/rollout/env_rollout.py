"""The built-in env rollout (`rollout.env`, docs/agents.md): each sample is an episode of the recipe's environment,
the model's turns generated through the router with the run's sampling settings, the environment's observations in
between.

Token in, token out: the trained sequence is the prompt's ids, then each turn's ids exactly as the engine returned
them, then each observation's ids, tokenized once when it arrives (or given as ids by the environment). Nothing is
ever decoded and encoded again: the model's text goes to the environment, its ids to training. The loss mask is 1 on
the model's tokens only; the episode's reward is the sum of the environment's step rewards.
"""

from __future__ import annotations

import asyncio
import uuid

from rlflow.engines.env.client import EnvClient
from rlflow.engines.rollout.functions import PromptSample, Sample, generate, sample_from_item

TURN_SEED_STRIDE = 7_919_000  # turn t of a sample seeded s samples with s + t * stride (reproducible, apart)
_CLIENTS: dict[str, tuple[EnvClient, int]] = {}  # router url -> the run's env hosts, and the rollout context


def register_env(router_url: str, client: EnvClient, context_len: int) -> None:
    """Make `client`'s environment the one env_rollout drives for rollouts against `router_url`; `context_len`:
    tokens a sequence holds (prompt and every turn and observation)."""
    _CLIENTS[router_url] = (client, context_len)


def unregister_env(router_url: str) -> EnvClient | None:
    entry = _CLIENTS.pop(router_url, None)
    return entry[0] if entry else None


def turn_seed(seed: int, turn: int) -> int:
    return seed + turn * TURN_SEED_STRIDE


def observation_ids(tokenizer, obs: dict, first: bool) -> list[int]:
    """An observation's token ids, tokenized here once: ids as given; text as a prompt is (special tokens) at reset,
    bare afterwards; messages through the chat template, with the generation prompt (no BOS after the first)."""
    if "ids" in obs:
        return list(obs["ids"])
    if "text" in obs:
        return tokenizer(obs["text"], add_special_tokens=first)["input_ids"]
    if "messages" in obs:
        text = tokenizer.apply_chat_template(obs["messages"], tokenize=False, add_generation_prompt=True)
        bos = tokenizer.bos_token
        if not first and bos and text.startswith(bos):
            text = text[len(bos):]
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return []


async def env_rollout(prompt: PromptSample, router_url: str, sampling_params: dict) -> list[Sample]:
    """prompt.n episodes of rollout.env's environment, run concurrently."""
    entry = _CLIENTS.get(router_url)
    if entry is None:
        raise RuntimeError("rollout.fn: env_rollout drives rollout.env's environment, and this run has no "
                           "rollout.env (set rollout.env.cls, docs/agents.md)")
    client, context = entry
    return list(await asyncio.gather(*(episode(client, context, prompt, router_url, sampling_params, j)
                                       for j in range(prompt.n))))


async def episode(client: EnvClient, context: int, prompt: PromptSample, router_url: str, sampling_params: dict,
                  j: int) -> Sample:
    """One episode: reset, then model turn / env step until done, max_turns, or the context is full."""
    tok, seed = prompt.tokenizer, prompt.seed + j
    episode_id = f"{prompt.seed}:{j}"  # reproducible: the same step, prompt and sample get the same id
    key = f"{uuid.uuid4().hex[:12]}-{episode_id}"  # unique on the hosts, whatever else runs
    sample = {"prompt": prompt.prompt, "label": prompt.label, "row": prompt.row, "seed": seed, "episode": episode_id}
    host, first = await client.reset(key, sample)
    try:
        prompt_ids = observation_ids(tok, first, first=True) or list(prompt.prompt_ids)
        response, logprobs, mask, rewards = [], [], [], []
        has_logprobs, versions, last_versions = True, [], []
        finish, info = "length", {}
        for turn in range(client.cfg.max_turns):
            room = context - len(prompt_ids) - len(response)
            if room <= 0:
                break
            params = sampling_params | {"sampling_seed": turn_seed(seed, turn),
                                        "max_new_tokens": min(sampling_params.get("max_new_tokens", room), room)}
            made = sample_from_item(await generate(router_url, prompt_ids + response, params))
            response += made.response_ids  # the engine's ids, as returned: never re-encoded
            if made.logprobs is None:
                has_logprobs = False
            logprobs += made.logprobs or [0.0] * len(made.response_ids)
            mask += [1] * len(made.response_ids)
            versions.append(made.weight_version)
            last_versions.append(made.last_weight_version)
            if made.finish_reason == "abort":
                finish = "abort"
                break
            action = {"text": tok.decode(made.response_ids, skip_special_tokens=True),
                      "token_ids": list(made.response_ids), "finish_reason": made.finish_reason}
            out = await client.step(host, key, action)
            rewards.append(out["reward"])
            info = out["info"]
            if out["done"]:
                finish = "stop"
                break
            obs = observation_ids(tok, out["observation"], first=False)
            if len(prompt_ids) + len(response) + len(obs) >= context:
                break  # the next turn would have no room: truncated (finish length)
            response += obs
            logprobs += [0.0] * len(obs)
            mask += [0] * len(obs)
    finally:
        await client.close(host, key)
    known = [v for v in versions if v is not None]
    known_last = [v for v in last_versions if v is not None]
    return Sample(
        response_ids=response, logprobs=logprobs if has_logprobs else None, loss_mask=mask,
        reward=float(sum(rewards)), response=tok.decode(response), finish_reason=finish,
        weight_version=min(known) if known else None, last_weight_version=max(known_last) if known_last else None,
        prompt_ids=None if prompt_ids == list(prompt.prompt_ids) else prompt_ids,
        metadata={"episode": episode_id, "turns": len(versions), "env_rewards": rewards, "env_info": info},
    )
