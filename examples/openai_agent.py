"""An agent that only speaks the OpenAI API: no token ids, no logprobs, just chat completions.

Agent frameworks talk to an OpenAI-compatible endpoint; the router serves one at `{router_url}/v1` for the
embedded servers and for SGLang alike. This rollout function asks for `prompt.n` chat completions of the
prompt as a user message and returns their text. The framework needs tokens to train on, so the function
re-tokenizes the conversation with the policy's tokenizer (exact for the demo's character tokenizer; for a
BPE tokenizer the re-tokenized text can split differently from what was sampled). It returns no logprobs:
the trainer computes them before the update, so these samples are trained on as on-policy.

    rlflow run deployments/sort-tiny.yaml --set rollout.fn=rlflow.examples.openai_agent:openai_rollout
"""

from __future__ import annotations

from openai import AsyncOpenAI

from rlflow.engines.rollout.functions import PromptSample, Sample


async def openai_rollout(prompt: PromptSample, router_url: str, sampling_params: dict) -> list[Sample]:
    tok = prompt.tokenizer
    messages = [{"role": "user", "content": prompt.prompt}]
    async with AsyncOpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, n=prompt.n, seed=prompt.seed,
            max_tokens=sampling_params["max_new_tokens"], temperature=sampling_params["temperature"],
            top_p=sampling_params["top_p"], stop=sampling_params.get("stop") or None,
        )
    # the prompt as the server saw it: the tokenizer's chat template, then its tokens
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(chat, add_special_tokens=False)["input_ids"]
    samples = []
    for choice in sorted(reply.choices, key=lambda c: c.index):
        text = choice.message.content or ""
        ids = tok(text, add_special_tokens=False)["input_ids"]
        stopped = choice.finish_reason == "stop"
        if stopped and tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)  # the model ended its turn: train it to, like the token path does
        samples.append(Sample(response_ids=ids, response=text, prompt_ids=list(prompt_ids),
                              finish_reason="stop" if stopped else "length"))
    return samples
