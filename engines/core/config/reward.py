"""reward: one reward function, or the weighted sum of sources (functions, reward models, LLM judges)."""

from __future__ import annotations

import re
import string
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from rlflow.engines.core.config.base import Name, Section

DEFAULT_REWARD_FN = "rlflow.engines.data.rewards:sort_reward"
DEFAULT_RUBRIC = (
    "Rate how well the response answers the prompt, from 0 (wrong or useless) to 10 (fully correct).\n"
    "Prompt: {prompt}\nReference answer: {label}\nResponse: {response}\n"
    "Reply with the score only, as 'Score: <number>'."
)
RUBRIC_FIELDS = ("prompt", "response", "label")
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class _RewardSource(Section):
    """What every reward source has: a name (its metrics are reward/<name>_mean) and a weight in the sum."""

    name: Name | None = Field(None, description="Its metrics' name (reward/<name>_mean); default: its kind. "
                              "Names must differ.")
    weight: float = Field(1.0, description="Its factor in the final reward, the weighted sum of every source.")


class FnRewardSource(_RewardSource):
    """A user's reward function, named by import path (as reward.fn)."""

    kind: Literal["fn"]
    fn: str = Field(DEFAULT_REWARD_FN, description="Import path 'module:function' of f(prompts, responses, labels) "
                    "-> list[float] (sync or async), or of a verl compute_score.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for it.")


class ModelRewardSource(_RewardSource):
    """A sequence-classification reward model (HF AutoModelForSequenceClassification) in a worker group of its
    own: `num_workers` workers, each with `num_gpus` GPUs (a fraction shares one), scoring `batch_size` texts a
    forward. The score is the logit of class `label` at the text's last token."""

    kind: Literal["model"]
    path: str = Field(..., description="Local Hugging Face directory of a *ForSequenceClassification model and "
                      "its tokenizer.")
    num_workers: int = Field(1, gt=0, description="Workers of its group; a batch is split evenly among them.")
    num_gpus: float = Field(1.0, gt=0, le=1, description="The share of a GPU each worker reserves when device is "
                            "cuda (0.5: two workers share one GPU); a worker holds the whole model on one GPU.")
    nodes: int = Field(1, gt=0, description="Nodes its workers spread over.")
    device: Literal["cpu", "cuda"] | None = Field(None, description="Default: train.device.")
    precision: Literal["fp32", "bf16"] = "fp32"
    batch_size: int = Field(16, gt=0, description="Texts per forward.")
    max_length: int = Field(2048, gt=0, description="Tokens a text is cut to (from the left: the score is read at "
                            "the last token).")
    template: str = Field("{prompt}{response}", description="The text scored, from the sample's {prompt}, "
                          "{response} and {label} (unused with chat_template).")
    chat_template: bool = Field(False, description="Score the conversation [user: prompt, assistant: response] in "
                                "the reward model's chat template (what most trained reward models expect).")
    label: int = Field(0, ge=0, description="Which logit is the score (num_labels 1: 0; a good/bad classifier: "
                       "the good class).")

    @field_validator("template")
    @classmethod
    def _template_fields(cls, v: str) -> str:
        return check_template(v)


class JudgeRewardSource(_RewardSource):
    """An LLM judge behind an OpenAI-compatible endpoint (the embedded rollout server, SGLang, vLLM, a hosted
    API): the rubric, filled in with the sample, is sent as a user message; the first match of score_pattern in
    the reply is the score. A reply without a valid score gets default_score and counts in
    reward/judge_parse_failures."""

    kind: Literal["judge"]
    url: str = Field(..., description="The endpoint's base URL, as the openai client's base_url: "
                     "http://host:port/v1 (requests go to <url>/chat/completions or <url>/completions).")
    model: str | None = Field(None, description="The request's model field (a hosted API needs it; the embedded "
                              "server and a one-model SGLang ignore it).")
    api_key_env: str | None = Field(None, description="Name of the environment variable "
                                    "holding the API key, sent as a bearer token. The key itself never goes in a "
                                    "recipe (recipes are logged to MLflow and Prefect).")
    route: Literal["chat", "completions"] = Field("chat", description="chat: /chat/completions with the rubric as "
                                                  "a user message; completions: the rubric as a raw prompt.")
    system: str | None = Field(None, description="A system message before the rubric (chat only).")
    rubric: str = Field(DEFAULT_RUBRIC, description="The judge's prompt, with {prompt}, {response} and {label} "
                        "replaced by the sample's (write a literal brace as {{ or }}).")
    score_pattern: str = Field(r"(-?\d+(?:\.\d+)?)", description="Regular expression whose first match in the "
                               "reply gives the score (its group 1 if it has a group, else the whole match).")
    min_score: float = Field(0.0, description="The rubric's lowest score; a parsed score below it is a failure.")
    max_score: float = Field(10.0, description="The rubric's highest score; a parsed score above it is a failure.")
    normalize: bool = Field(True, description="Map [min_score, max_score] onto [0, 1].")
    default_score: float = Field(0.0, description="The reward of a reply without a valid score (after "
                                 "normalization, as the source's output).")
    max_tokens: int = Field(32, gt=0, description="Tokens the judge may reply with.")
    temperature: float = Field(0.0, ge=0.0)
    timeout_s: float = Field(60.0, gt=0, description="Seconds one request may take.")
    retries: int = Field(3, ge=0, description="Retries of a request after a timeout, a dropped connection, a 429 "
                         "or a 5xx.")
    deadline_s: float = Field(300.0, gt=0, description="No retry starts later than this after the first attempt.")
    max_concurrency: int = Field(8, gt=0, description="Requests in flight at once.")
    on_request_failure: Literal["fail", "default"] = Field(
        "fail", description="A request that still fails after its retries: fail the reward stage, or score "
        "default_score (counted in reward/<name>_request_failures). Refused requests (4xx: a wrong key) always fail.")

    @model_validator(mode="before")
    @classmethod
    def _no_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError("api_key: never put an API key in a recipe (it is logged to MLflow and Prefect): set "
                             "it in an environment variable and give that variable's name as api_key_env")
        return data

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(_ENV_NAME, v):  # the value is not echoed: it may be a key
            raise ValueError("api_key_env: expected the NAME of an environment variable (letters, digits, _), "
                             "not the key itself")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if "@" in v.split("//", 1)[-1].split("/", 1)[0]:  # checked first: such a URL is never echoed
            raise ValueError("url: credentials in the URL would be logged; give the key through api_key_env")
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"url: expected an http:// or https:// base URL, got {v!r}")
        return v.rstrip("/")

    @field_validator("rubric")
    @classmethod
    def _rubric(cls, v: str) -> str:
        return check_template(v)

    @field_validator("score_pattern")
    @classmethod
    def _pattern(cls, v: str) -> str:
        try:
            groups = re.compile(v).groups
        except re.error as e:
            raise ValueError(f"score_pattern: not a regular expression ({e})") from None
        if groups > 1:
            raise ValueError(f"score_pattern: at most one group (the score), got {groups}")
        return v

    @model_validator(mode="after")
    def _range(self) -> JudgeRewardSource:
        if self.max_score <= self.min_score:
            raise ValueError(f"max_score ({self.max_score}) must be above min_score ({self.min_score})")
        if self.system is not None and self.route != "chat":
            raise ValueError("system: a system message needs route: chat")
        return self


def check_template(text: str) -> str:
    """A prompt template may name only the sample's fields; an unknown or malformed one fails here, not mid-run."""
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:
        raise ValueError(f"template {text[:60]!r}: {e} (write a literal brace as {{{{ or }}}})") from None
    unknown = sorted(names - set(RUBRIC_FIELDS))
    if unknown:
        raise ValueError(f"unknown placeholder(s) {unknown}: a template may use {{prompt}}, {{response}} and "
                         "{label} (a literal brace is written {{ or }})")
    return text


RewardSource = Annotated[FnRewardSource | ModelRewardSource | JudgeRewardSource, Field(discriminator="kind")]


class RewardConfig(Section):
    """The reward of a sample: `fn` alone (the common case), or the weighted sum of `sources` (functions, reward
    models, LLM judges), each also logged on its own."""

    fn: str = Field(
        DEFAULT_REWARD_FN,
        description="Import path 'module:function' of f(prompts, responses, labels) -> list[float] (sync or async).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the reward.")
    sources: list[RewardSource] = Field(
        default_factory=list, description="Several rewards, summed by weight: [{kind: fn | model | judge, weight, "
        "...}] (docs/rewards.md). Empty: fn alone, weight 1.")

    @model_validator(mode="after")
    def _one_way(self) -> RewardConfig:
        if not self.sources:
            return self
        if self.fn != DEFAULT_REWARD_FN or self.kwargs:
            raise ValueError("reward.fn / reward.kwargs: with reward.sources, give the function as a source "
                             "({kind: fn, fn: ..., kwargs: ...}); both would leave unclear which one scores")
        seen: dict[str, int] = {}
        for i, src in enumerate(self.sources):
            name = src.name or src.kind
            if name in seen:
                raise ValueError(f"reward.sources[{i}].name: {name!r} is also source {seen[name]}'s name; give each "
                                 "source its own name (its metrics are reward/<name>_mean)")
            seen[name] = i
        return self

    def resolved_sources(self) -> list[FnRewardSource | ModelRewardSource | JudgeRewardSource]:
        """The sources with their names filled in; a recipe with `fn` only is the one source fn, weight 1."""
        if not self.sources:
            return [FnRewardSource(kind="fn", name="fn", fn=self.fn, kwargs=self.kwargs)]
        return [s if s.name else s.model_copy(update={"name": s.kind}) for s in self.sources]

    def only_fn(self, where: str) -> FnRewardSource:
        """The one reward function of a flow that scores without the RL session's workers (evaluate); a recipe
        with several sources or a model / judge source is refused there, naming `where`."""
        sources = self.resolved_sources()
        if len(sources) != 1 or not isinstance(sources[0], FnRewardSource) or sources[0].weight != 1.0:
            raise ValueError(f"reward.sources: {where} scores with one reward function (reward.fn); reward models, "
                             "judges and weighted sums are scored by post_train's reward stage")
        return sources[0]
