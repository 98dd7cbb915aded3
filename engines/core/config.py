"""The one configuration tree of rlflow.

A recipe (YAML in deployments/) is parsed into `RLConfig`; the same model is the post_train flow's
parameter type, so Prefect's run form shows these fields with their defaults and descriptions.
Every section forbids unknown keys, so a typo is an error that names the field, not a silent default.
"""

from __future__ import annotations

import re
import string
import tempfile
import warnings
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from rlflow.engines.core.retry import RetryPolicy
from rlflow.engines.core.sglang_args import DETERMINISTIC, normalise_args, weight_update_ranks


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="Local Hugging Face causal-LM directory. Empty: build a tiny model from the fields "
        "below with the built-in character tokenizer (the CPU demo).",
    )
    arch: Literal["llama", "qwen2"] = Field("llama", description="Architecture of a model built from scratch.")
    hidden_size: int = Field(96, gt=0)
    intermediate_size: int = Field(256, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(4, gt=0)
    max_seq_len: int = Field(64, gt=0, description="Longest prompt + response, in tokens.")


class BuiltinTaskConfig(Section):
    task: Literal["sort", "reverse", "add"] = Field(..., description="Which built-in verifiable task to generate.")
    num_digits: int = Field(4, gt=0, le=12)
    num_train: int = Field(20000, gt=0)
    num_eval: int = Field(256, gt=0)
    seed: int = 1234


class DataConfig(Section):
    train_path: str = Field(
        ..., description="Prompt file for training: .jsonl, .json or .parquet; a path or an s3:// URL (reached with "
        "`storage`'s endpoint and credentials). Plain, verl and TRL rows (docs/data.md).")
    eval_path: str | None = Field(None, description="Held-out prompt file; empty disables eval.")
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    label_key: str = Field("label", description="Column holding what the reward checks against.")
    shuffle: bool = True
    seed: int = 0
    chat_template: bool = Field(
        False,
        description="Wrap each prompt as one user message in the tokenizer's chat template (with the generation "
        "prompt) before tokenizing; for instruct models. False: the prompt text is tokenized as it is.",
    )
    generate: BuiltinTaskConfig | None = Field(
        None, description="Write a built-in task to train_path/eval_path first, if those files are missing."
    )


# launch modules whose flags are SGLang's (the stand-in takes a subset of them, with the same names)
SGLANG_LAUNCHERS = ("sglang.launch_server", "rlflow.engines.rollout.launch")


class SGLangConfig(Section):
    """rollout.backend: sglang. Each rollout worker runs `<python> -m <launch_module> --model-path <model> --host
    <its address> --port <free port> <args>` on the GPUs Ray gave it (docs/rollout.md)."""

    python: str | None = Field(
        None, description="The interpreter that runs the server: an environment with SGLang installed (it pins its "
        "own torch and transformers, so it rarely fits rlflow's). Empty: this interpreter. Weight transports across "
        "two environments: docs/rollout.md.")
    launch_module: str = Field("sglang.launch_server", description="Module started with `python -m` as the server.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="SGLang's launch_server flags: `mem-fraction-static: 0.8` -> `--mem-fraction-static 0.8`; true "
        "-> the bare flag; false or null -> left out; a list -> its values after one flag. Names are checked against "
        "SGLang's flags at validation and written canonically (`tp_size`/`tp-size` -> `tensor-parallel-size`; an "
        "ambiguous one such as `pp` is refused). model-path, host, port and api-key are set by the worker.",
    )
    deterministic: bool = Field(
        True, description="Launch with --enable-deterministic-inference: SGLang honours a request's sampling_seed "
        "only then (a retried request, or a rerun, gives the same tokens). false: SGLang's faster sampling and "
        "attention kernels, and sampling_seed is ignored.")
    startup_timeout_s: float = Field(600, gt=0, description="Seconds to wait for the server's /health to answer 200.")
    drain_timeout_s: float = Field(
        120, gt=0, description="Colocated: seconds to wait for running requests to finish before the server's memory "
        "is released (SGLang releases only an idle server).")

    @model_validator(mode="after")
    def _check_args(self) -> SGLangConfig:
        checked = self.launch_module in SGLANG_LAUNCHERS  # a custom launcher's flags are its own: only re-spelled
        args = normalise_args(self.args, check=checked)
        if checked:
            given = args.get(DETERMINISTIC)
            if given is not None and bool(given) != self.deterministic:
                raise ValueError(f"rollout.sglang.args.{DETERMINISTIC}: {given} contradicts rollout.sglang."
                                 f"deterministic: {self.deterministic}; set deterministic only")
            args[DETERMINISTIC] = self.deterministic
        self.args.clear()  # in place: assigning would validate the model again (validate_assignment)
        self.args.update(args)
        return self


class DynamicSamplingConfig(Section):
    """Over-sample prompts, drop groups whose rewards are all equal (they carry no group-relative signal), and
    abort what is still generating once prompts_per_step groups are kept."""

    enabled: bool = False
    over_sample: float = Field(
        1.5, ge=1.0, description="Prompts started per round, as a multiple of the groups still missing.")
    max_prompts: int = Field(
        0, ge=0, description="Give up filtering after this many prompts in a step and fill the batch with "
        "dropped groups (0: 4 x prompts_per_step).")
    partial_rollout: bool = Field(
        False, description="Keep the generations cut short by the abort and continue them next step (with the "
        "default rollout.fn); otherwise their prompts are started again next step. Finished surplus groups are "
        "always kept for the next step.")


def nodes_field(workers: str) -> Any:
    return Field(1, gt=0, description=f"Ray nodes the {workers} are spread over, num_workers / nodes on each (one "
                 "placement group per node, packed on it); checked against the cluster before any worker starts.")


class KVCacheConfig(Section):
    """The embedded engine's paged KV cache (docs/rollout.md): one pool of fixed-size pages shared by every
    running sequence, so contexts are bounded by the model's positions and the pool, not a fixed slot."""

    page_size: int = Field(16, gt=0, description="Tokens per KV page.")
    memory_fraction: float = Field(
        0.5, gt=0.0, lt=1.0, description="CUDA: the share of the GPU memory free once the weights are loaded "
        "that the page pool takes (SGLang's mem_fraction_static idea, of free rather than total memory).")
    tokens: int | None = Field(
        None, gt=0, description="Pool size in tokens; overrides memory_fraction. Empty: from memory_fraction on "
        "CUDA, 65536 tokens on CPU (never more than batch_size x context_len).")
    prefill_chunk_tokens: int = Field(
        8192, gt=0, description="Prompt tokens prefilled per engine step; a longer prompt is prefilled in chunks "
        "over several steps, between the running decodes.")
    share_prompts: bool = Field(
        True, description="Requests with the same prompt (the samples of a GRPO group) prefill once and share the "
        "prompt's full pages (the partial last page is copied); false: each prefills and stores its own.")


class RolloutConfig(Section):
    backend: Literal["torch", "sglang"] = Field(
        "torch", description="Rollout engine: the embedded PyTorch generator, or an SGLang server per worker "
        "(rollout.sglang).")
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description="The SGLang backend's server.")
    router: Literal["auto", "sglang-router", "rlflow"] = Field(
        "auto", description="The router in front of the workers' servers. auto: sglang-router (pip install "
        "'rlflow[router]') for backend sglang where it is installed, else rlflow's own (engines/rollout/router.py), "
        "which also serves the embedded engine: it takes a batched /generate, sglang-router only one item a request.")
    num_workers: int = Field(1, gt=0)
    nodes: int = nodes_field("rollout workers")
    prompts_per_step: int = Field(64, gt=0)
    samples_per_prompt: int = Field(8, gt=0, description="Group size for group-relative advantages.")
    max_new_tokens: int = Field(8, gt=0)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    stop: list[str] = Field(default_factory=list, description="Stop strings besides the EOS token.")
    batch_size: int = Field(512, gt=0, description="Sequences generated together per worker (page-table rows).")
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig, description="The embedded engine's paged KV cache.")
    compile: bool = Field(
        False, description="Embedded engine on CUDA: torch.compile its decode step before capturing it in CUDA graphs "
        "(norms, rotary, SwiGLU and residual adds fused; 1.6x a step on an H100, docs/benchmarks.md), at the cost of "
        "compiling at the first rollout. SGLang's --enable-torch-compile.")
    fn: str = Field(
        "rlflow.engines.rollout.functions:single_turn",
        description="Import path of the async rollout function f(prompt, router_url, sampling_params) -> "
        "list[Sample] (docs/rollout.md): multi-turn, tools and agents live there. The default generates "
        "samples_per_prompt single-turn completions through SGLang's /generate.",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=lambda: DynamicSamplingConfig(), description="DAPO-style group filtering (off by default).")
    device: Literal["cpu", "cuda"] | None = Field(None, description="Where rollout engines run; empty: train.device.")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="Weights and compute dtype of the rollout engine.")
    max_staleness: int = Field(
        0, ge=0,
        description="How many weight versions rollout may run ahead of training (docs/rollout.md, asynchronous "
        "training). 0: synchronous (step k samples with step k's weights). 1: one-step-off: step k+1 generates "
        "while step k trains, with weights one update behind, and the sync waits for it (each step's samples "
        "come from one version). k >= 2: the rollouts of steps up to k ahead run while training goes on and "
        "weights are updated under them (a generation in flight continues with the new weights); a step's "
        "rollout starts only once version step - k is on the rollout workers; use algorithm.is_correction with "
        "it (docs/algorithms.md). Replaces off_policy_steps.",
    )

    @model_validator(mode="before")
    @classmethod
    def _off_policy_steps_alias(cls, data: Any) -> Any:
        """`off_policy_steps` (0 or 1), the field's old name, still reads as max_staleness, with a warning."""
        if not isinstance(data, dict) or "off_policy_steps" not in data:
            return data
        data = dict(data)
        old = data.pop("off_policy_steps")
        if "max_staleness" in data and data["max_staleness"] != old:
            raise ValueError(f"rollout.off_policy_steps ({old}) and rollout.max_staleness ({data['max_staleness']}) "
                             "disagree: off_policy_steps is max_staleness's old name; give max_staleness alone")
        data["max_staleness"] = old
        warnings.warn(f"rollout.off_policy_steps is deprecated: it is read as rollout.max_staleness: {old} "
                      "(the same run); rename it in the recipe", FutureWarning, stacklevel=2)
        return data


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

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description="Its metrics' name "
                             "(reward/<name>_mean); default: its kind. Names must differ.")
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


GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp_baseline_seq", "opo",
                    "grpo_passk", "passk")


# the settings of one policy loss: changed from their defaults with another loss, they would do nothing
_POLICY_LOSS_KEYS = {
    "sapo": ("sapo_tau_pos", "sapo_tau_neg"),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "kl_cov_coef"),
}


class AlgorithmConfig(Section):
    """Advantage estimator, policy loss, KL, entropy and rollout/train mismatch correction (docs/algorithms.md)."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "reinforce_pp_baseline_seq",
                       "opo", "grpo_passk", "passk", "remax", "gae"] = Field(
        "grpo",
        description="grpo: (r - mean) / std per group; dr_grpo: r - mean; rloo: r - mean of the group's other "
        "samples; reinforce_pp: discounted token returns whitened over the batch (no group needed); "
        "reinforce_pp_baseline: r - group mean, whitened over the batch's response tokens (verl, OpenRLHF); "
        "reinforce_pp_baseline_seq: r - group mean, divided by its std over the batch's samples; opo: r - the "
        "length-weighted mean reward of the group (OPO's optimal baseline); grpo_passk: only each group's best "
        "sample is reinforced, by its margin over the runner-up (pass@n training, verl's grpo_passk); passk: "
        "analytic pass@k advantages for binary rewards (passk_k; Pass@k Training); remax: r - the "
        "reward of the prompt's greedy response, generated as one extra sample per prompt (ReMax); gae: PPO "
        "with a "
        "critic (the critic section), generalised advantage estimation over the critic's token values, whitened "
        "over the batch. Group estimators take groups by the samples' group ids: groups may differ in size.",
    )
    normalize_std: bool | None = Field(
        None, description="Override std normalisation of grpo / dr_grpo / grpo_passk (default: grpo and grpo_passk "
        "yes, dr_grpo no)."
    )
    passk_k: int = Field(
        2, ge=1, description="passk: the k of pass@k the group's reward is (at most rollout.samples_per_prompt). "
        "1 is GRPO on 0/1 rewards; a larger k rewards exploration (a prompt counts as solved by any of k samples).",
    )
    passk_threshold: float = Field(
        1.0, description="passk: a sample counts as correct when its reward is >= this (1: fully correct, as "
        "rollout/accuracy counts).",
    )
    gamma: float = Field(
        1.0, gt=0.0, le=1.0,
        description="Discount of reinforce_pp's and gae's token returns; 1 credits every token fully.",
    )
    lam: float = Field(
        1.0, ge=0.0, le=1.0,
        description="GAE's lambda (gae and a critic only): 1 is Monte-Carlo returns minus V (unbiased, noisier); "
        "0 the one-step TD error r_t + gamma V_t+1 - V_t (leans on the critic).",
    )
    policy_loss: Literal["ppo", "gspo", "cispo", "gmpo", "sapo", "clip_cov", "kl_cov"] = Field(
        "ppo",
        description="ppo: token-level clipped ratio; gspo: clipped sequence ratio exp(mean token log-ratio) "
        "(use clip_low 3e-4, clip_high 4e-4 and loss_agg seq_mean_token_mean); cispo: clipped importance weight "
        "under stop-gradient times log p, every token keeps a gradient (MiniMax-M1); gmpo: geometric mean of the "
        "token ratios, clip_low / clip_high bound the log-ratio (paper: 0.4 / 0.4, seq_mean_token_mean); sapo: "
        "sigmoid soft gate instead of a clip (sapo_tau_pos / sapo_tau_neg, seq_mean_token_mean); clip_cov: PPO-clip "
        "and the gradient of a few high-covariance tokens detached; kl_cov: unclipped ratio and a |log-ratio| "
        "penalty on the highest-covariance tokens (docs/algorithms.md).",
    )
    clip_low: float = Field(
        0.2, ge=0.0, description="Ratio may fall to 1 - clip_low before the loss clips it (gmpo: the log-ratio to "
        "-clip_low; cispo: >= 1 sets no lower bound, as the paper; unused by sapo and kl_cov)."
    )
    clip_high: float = Field(
        0.2, ge=0.0, description="Ratio may rise to 1 + clip_high; above clip_low is DAPO's clip-higher (gmpo: the "
        "log-ratio to clip_high; unused by sapo and kl_cov)."
    )
    clip_ratio_c: float | None = Field(
        None,
        gt=1.0,
        description="Dual-clip PPO: caps the loss of negative-advantage tokens at clip_ratio_c * |A| (typically "
        "3); empty disables. ppo only.",
    )
    sapo_tau_pos: float = Field(
        1.0, gt=0.0, description="sapo: temperature of the soft gate for tokens with A > 0 (paper: 1.0); larger "
        "damps a token's gradient sooner as its ratio leaves 1.",
    )
    sapo_tau_neg: float = Field(
        1.05, gt=0.0, description="sapo: temperature for tokens with A <= 0 (paper: 1.05; above sapo_tau_pos, "
        "since negative updates destabilise more).",
    )
    clip_cov_ratio: float = Field(
        2e-4, gt=0.0, le=1.0, description="clip_cov: share of a micro-batch's response tokens (at least 1) whose "
        "gradient is detached, drawn among those with covariance in (clip_cov_lb, clip_cov_ub) (paper: 2e-4).",
    )
    clip_cov_lb: float = Field(1.0, description="clip_cov: covariance a token must exceed to be drawn (paper: 1).")
    clip_cov_ub: float = Field(5.0, description="clip_cov: covariance a token must stay below to be drawn (paper: 5).")
    kl_cov_ratio: float = Field(
        2e-4, gt=0.0, le=1.0, description="kl_cov: share of a micro-batch's response tokens (at least 1), those "
        "with the largest covariance, that get the KL penalty (authors' recipes: 2e-3 for 7B, 2e-4 for 32B).",
    )
    kl_cov_coef: float = Field(
        1.0, ge=0.0, description="kl_cov: weight of the |log(p / p_old)| penalty on those tokens (verl's ppo_kl_coef; "
        "authors' recipes: 1).",
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum",
                      "seq_mean_token_sum"] = Field(
        "token_mean",
        description="How per-token losses become one number: over all tokens, per sequence then batch, "
        "Dr.GRPO's sum over tokens divided by a constant (max_new_tokens), the plain sum over tokens (token_sum), "
        "or each sequence's sum averaged over sequences (seq_mean_token_sum).",
    )
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of KL to the frozen reference model; 0 disables it.")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3",
        description="k1: log-ratio; k2: squared log-ratio / 2; k3: the low-variance estimator q/p - log(q/p) - 1, "
        "clamped to [-10, 10] as verl's; low_var_kl: verl's name for the same k3.",
    )
    kl_ctrl: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: kl_coef throughout. adaptive: PPO's adaptive KL controller (kl_in: reward "
        "only, as verl's kl_ctrl): kl_coef is the starting value, then each step it is multiplied by "
        "1 + clip(KL / kl_target - 1, -0.2, 0.2) * batch size / kl_horizon, with KL the batch's mean per-token KL; "
        "the coefficient is saved with each checkpoint.",
    )
    kl_target: float = Field(0.1, gt=0.0, description="adaptive kl_ctrl: the KL per token the coefficient steers "
                             "toward (verl's target_kl).")
    kl_horizon: int = Field(10000, gt=0, description="adaptive kl_ctrl: samples over which the coefficient may "
                            "change by the full 20% (verl's horizon).")
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: kl_coef * KL is added to the loss; reward: kl_coef * per-token KL is subtracted from "
        "the rewards before the advantages.",
    )
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (subtracted from the loss).")
    is_correction: Literal["none", "tis", "icepop"] = Field(
        "none",
        description="Rollout/train mismatch correction: tis weighs each token by min(p_train / p_rollout, "
        "tis_cap); icepop drops tokens whose ratio is outside [icepop_low, icepop_high]. Either costs one "
        "extra forward pass per step (the train engine's logprobs before the update).",
    )
    is_level: Literal["token", "sequence"] = Field(
        "token", description="Ratio the is_correction weight is taken from: each token's own, or the sequence's "
        "exp(sum of token log-ratios) given to all its tokens (verl's rollout_is: sequence; unbiased, higher "
        "variance: raise tis_cap).",
    )
    is_batch_normalize: bool = Field(
        False, description="Divide the importance weights by their mean over the step's batch (tokens, or "
        "sequences at sequence level), so they only re-weight (verl's rollout_is_batch_normalize).",
    )
    rejection: Literal["none", "token", "sequence", "geometric"] = Field(
        "none", description="Rejection of mismatched rollouts (verl's rollout_rs): drop from the loss mask the "
        "tokens (token), whole sequences by their ratio exp(sum log-ratio) (sequence, verl's seq_sum_k1) or by "
        "their geometric-mean ratio exp(mean log-ratio) (geometric, verl's seq_mean_k1) whose p_train / "
        "p_rollout is outside [reject_low, reject_high]. Combines with is_correction; costs the same extra "
        "forward pass.",
    )
    reject_low: float = Field(0.5, gt=0.0, description="rejection: smallest ratio kept (at most 1).")
    reject_high: float = Field(2.0, gt=0.0, description="rejection: largest ratio kept (at least 1).")
    tis_cap: float = Field(2.0, gt=0.0, description="TIS: upper bound of the importance weight.")
    icepop_low: float = Field(0.5, gt=0.0, description="IcePop: smallest p_train / p_rollout kept.")
    icepop_high: float = Field(5.0, gt=0.0, description="IcePop: largest p_train / p_rollout kept.")
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO overlong shaping: the last overlong_buffer tokens before rollout.max_new_tokens cost "
        "reward linearly, up to overlong_penalty at the limit; 0 disables.",
    )
    overlong_penalty: float = Field(0.0, ge=0.0, description="Reward lost at the length limit; 0 disables.")

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.normalize_std is not None and self.advantage not in ("grpo", "dr_grpo", "grpo_passk"):
            raise ValueError(f"normalize_std applies to grpo / dr_grpo / grpo_passk only, not advantage "
                             f"{self.advantage!r}")
        if self.clip_ratio_c is not None and self.policy_loss != "ppo":
            raise ValueError("clip_ratio_c (dual clip) applies to policy_loss 'ppo' only")
        changed = [k for k in ("passk_k", "passk_threshold") if getattr(self, k) != type(self).model_fields[k].default]
        if changed and self.advantage != "passk":
            raise ValueError(f"{', '.join(changed)} apply to advantage 'passk' only (advantage is {self.advantage!r})")
        for loss, keys in _POLICY_LOSS_KEYS.items():
            changed = [k for k in keys if getattr(self, k) != type(self).model_fields[k].default]
            if changed and self.policy_loss != loss:
                verb = "apply" if len(changed) > 1 else "applies"
                raise ValueError(f"{', '.join(changed)} {verb} to policy_loss {loss!r} only "
                                 f"(policy_loss is {self.policy_loss!r})")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub})")
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"icepop_low ({self.icepop_low}) must be below icepop_high ({self.icepop_high})")
        if self.is_correction == "none" and (self.is_level != "token" or self.is_batch_normalize):
            raise ValueError("is_level / is_batch_normalize shape the is_correction weights: set is_correction "
                             "to tis or icepop")
        if not self.reject_low <= 1.0 <= self.reject_high or self.reject_low == self.reject_high:
            raise ValueError(f"reject_low ({self.reject_low}) must be <= 1 <= reject_high ({self.reject_high}), "
                             "and below it: a token the engines agree on (ratio 1) must be kept")
        if self.kl_ctrl == "adaptive" and (self.kl_in != "reward" or self.kl_coef <= 0):
            raise ValueError("kl_ctrl: adaptive steers the KL penalty in the reward: it needs kl_in: reward and "
                             f"a starting kl_coef > 0 (got kl_in {self.kl_in!r}, kl_coef {self.kl_coef})")
        return self

    @property
    def corrects_rollout(self) -> bool:
        """Whether the step needs the train engine's logprobs of the pre-update weights against the rollout's:
        importance weights or rejection."""
        return self.is_correction != "none" or self.rejection != "none"

    def loss_kwargs(self) -> dict[str, Any]:
        """rl_loss's keyword arguments from this config, so every train backend passes the same ones."""
        return {
            "clip_low": self.clip_low, "clip_high": self.clip_high, "loss_agg": self.loss_agg,
            "kl_coef": self.kl_coef if self.kl_in == "loss" else 0.0, "kl_estimator": self.kl_estimator,
            "entropy_coef": self.entropy_coef, "policy": self.policy_loss, "clip_ratio_c": self.clip_ratio_c,
            "is_correction": self.is_correction, "tis_cap": self.tis_cap,
            "icepop_low": self.icepop_low, "icepop_high": self.icepop_high, "is_level": self.is_level,
            "sapo_tau_pos": self.sapo_tau_pos, "sapo_tau_neg": self.sapo_tau_neg,
            "clip_cov_ratio": self.clip_cov_ratio, "clip_cov_lb": self.clip_cov_lb, "clip_cov_ub": self.clip_cov_ub,
            "kl_cov_ratio": self.kl_cov_ratio, "kl_cov_coef": self.kl_cov_coef,
        }


class RejectionSamplingConfig(Section):
    """Rejection sampling (flows/rejection_sampling.py): generate, keep what the verifier accepts, SFT on it."""

    rounds: int = Field(3, gt=0, description="Generate-filter-train rounds.")
    threshold: float = Field(
        1.0, description="A sample is kept when the reward (reward.fn) is >= threshold and it ended on its own."
    )
    max_per_prompt: int = Field(1, gt=0, description="Distinct accepted responses kept per prompt and round.")
    steps_per_round: int = Field(20, gt=0, description="SFT optimizer steps on the kept samples each round.")
    accumulate: bool = Field(
        True, description="Train on the samples kept in every round so far; false: only on this round's."
    )


class SFTConfig(Section):
    """Supervised fine-tuning (flows/sft.py) and rejection sampling. The train section gives the optimizer
    settings (lr unless sft.lr is set, schedule, warmup, grad_clip, threads, device); data gives the prompts
    for evaluation and for rejection sampling."""

    train_path: str | None = Field(
        None, description="Prompt/response file (.jsonl or .parquet) for `rlflow sft`; unused by rejection sampling."
    )
    response_key: str = Field("response", description="Column holding the target response text.")
    generate: BuiltinTaskConfig | None = Field(
        None,
        description="Write a built-in task's prompts with their correct answers to train_path first, if missing "
        "(same task, num_digits, num_eval and seed as data.generate keep the held-out prompts out of it).",
    )
    steps: int = Field(100, gt=0, description="SFT optimizer steps (`rlflow sft`).")
    batch_size: int = Field(64, gt=0, description="Sequences per optimizer step (over all data-parallel workers).")
    lr: float | None = Field(None, gt=0.0, description="Learning rate; empty: train.lr.")
    add_eos: bool = Field(True, description="End every response with the EOS token, so the model learns to stop.")
    rejection: RejectionSamplingConfig = Field(default_factory=RejectionSamplingConfig)

    def total_steps(self, rejection: bool) -> int:
        r = self.rejection
        return r.rounds * r.steps_per_round if rejection else self.steps


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """LoRA RL (docs/lora.md): the base model stays frozen in the train precision and only low-rank adapters
    train; weight sync moves the adapter alone (weight_sync.transport adapter), the reference model is the base
    with the adapters switched off, and checkpoints hold the adapter, its optimizer state, a PEFT export and the
    merged weights."""

    ADAPTER_NAME: ClassVar[str] = "policy"  # what rollout workers serve the adapter as (/generate's lora_path)

    rank: int = Field(16, gt=0, description="r: the adapters' rank.")
    alpha: float = Field(32.0, gt=0.0, description="lora_alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1,
        description="Linear layers that get an adapter, by module name (Llama/Qwen: q_proj k_proj v_proj o_proj "
        "gate_proj up_proj down_proj).",
    )

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, v: list[str]) -> list[str]:
        unknown = sorted(set(v) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"unknown module(s) {unknown}; the decoders rlflow runs have {list(LORA_TARGETS)}")
        return list(dict.fromkeys(v))

    def peft_config(self) -> dict:
        """The adapter_config.json fields PEFT (and SGLang's adapter loader) read."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "lora_dropout": self.dropout, "target_modules": self.target_modules, "bias": "none",
                "use_rslora": False, "fan_in_fan_out": False}


class TrainConfig(Section):
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="Train engine: the native PyTorch backend, or Megatron-core (see the megatron section)."
    )
    num_workers: int = Field(
        1, gt=0, description="Train workers (gloo on CPU, nccl on GPU): FSDP2 ranks for torch (parameters, "
        "gradients and optimizer state sharded over them); tensor x pipeline x data-parallel ranks for megatron."
    )
    nodes: int = nodes_field("train workers")
    steps: int = Field(100, gt=0, description="RL iterations.")
    lr: float = Field(3e-3, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0.0)
    mini_batches: int = Field(1, gt=0, description="Optimizer steps per pass over the batch (PPO mini-batches).")
    epochs: int = Field(1, gt=0, description="Passes over each rollout batch (PPO epochs).")
    micro_batch_size: int = Field(512, gt=0, description="Sequences per forward/backward on one worker (at most).")
    micro_batch_tokens: int = Field(
        0, ge=0, description="torch backend: token budget of one micro-batch, the summed length of its samples "
        "(they are packed, no padding); 0: micro_batch_size samples. The megatron backend has its own.",
    )
    logprob_chunk_tokens: int = Field(
        4096, gt=0, description="Tokens per chunk of the LM head's log-softmax (recomputed in the backward), so at "
        "most chunk x vocab fp32 logits exist at once (torch backend: the head's matmul is chunked too; megatron: "
        "its output layer's bf16 logits are whole, their fp32 work chunked).",
    )
    activation_checkpointing: bool = Field(
        False, description="torch backend: recompute each decoder layer's activations in the backward pass.")
    compile: bool = Field(False, description="torch.compile each decoder layer (dynamic shapes; casts, norms, "
                          "rotary and SwiGLU fused; the measured gains are in docs/native_trainer.md and "
                          "docs/megatron.md), for about half a minute of compiling in the first step. megatron: the "
                          "local layer spec's layers (not Transformer Engine's).")
    fused_head: bool = Field(
        True, description="torch backend on CUDA: the LM head's log-softmax, entropy and their gradient run as a "
        "few kernels generated by torch.compile (engines/models/head_math.py) instead of a dozen fp32 passes over "
        "each chunk's logits; false: the same math as eager torch ops (as on the CPU).")
    kernels: Literal["torch", "liger"] = Field(
        "torch", description="torch backend: 'liger' swaps the decoder layers' RMSNorm, rotary and SwiGLU for "
        "liger-kernel's fused Triton kernels (CUDA; pip install 'rlflow[liger]'); 'torch': HF's modules as loaded.")
    reshard_after_forward: bool = Field(
        True, description="torch backend: FSDP2 frees each layer's gathered weights after its forward and gathers "
        "them again for its backward (memory of one layer at a time). false keeps them until the backward: no "
        "second all-gather per micro-batch, the gathered bf16 weights of every layer in memory at once.")
    cpu_offload: bool = Field(
        False, description="torch backend: FSDP2 CPU offload: parameters, gradients and optimizer state live on "
        "the host (the optimizer steps there) and each layer is copied to the GPU when it runs; trains models "
        "whose state does not fit on the GPUs, at the cost of host-device copies.",
    )
    offload_during_rollout: bool | None = Field(
        None, description="cluster.colocate: the train workers park their optimizer state and weights in pinned "
        "host memory (and drop the last step's gradients) while the rollout engine sharing their GPU generates, "
        "and take them back before they run again; logged as time/offload and time/onload. Empty: on when "
        "colocated. With weight_sync.transport cuda_ipc and one train worker the weights stay (the rollout engine "
        "maps them).",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="Compute dtype of training; master weights, gradient reduction and optimizer state "
        "stay fp32 (torch backend: FSDP2's mixed-precision policy).",
    )
    threads: int = Field(2, gt=0, description="torch threads per worker.")
    device: Literal["cpu", "cuda"] = "cpu"
    lora: LoraConfig | None = Field(
        None, description="torch backend: train LoRA adapters on a frozen base instead of every weight "
        "(docs/lora.md); needs weight_sync.transport adapter. Empty: full fine-tuning.")


class CriticConfig(Section):
    """The value model of PPO with GAE: a second group of train workers (docs/algorithms.md)."""

    enabled: bool | None = Field(
        None, description="Train a critic. Empty: when algorithm.advantage is gae (which needs one). With another "
        "estimator the critic trains on the GAE returns beside it (warm-up, or to watch critic/vf_explained_var).",
    )
    model_path: str | None = Field(
        None, description="HF causal-LM directory the value model's body starts from; empty: the policy's starting "
        "model. Its LM head is dropped and a scalar value head, initialised to zero, is added.",
    )
    num_workers: int = Field(1, gt=0, description="Critic train workers: data-parallel copies, like train.num_workers.")
    nodes: int = nodes_field("critic's workers")
    lr: float = Field(1e-3, gt=0.0, description="The critic's learning rate (its own AdamW; betas, weight decay, "
                      "epochs, mini-batches and precision are train's).")
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="LR warm-up of the critic, in RL steps (like train.warmup_steps).")
    grad_clip: float = Field(1.0, gt=0.0)
    value_clip: float | None = Field(
        0.5, gt=0.0, description="PPO value clipping: a value may not move more than this from the one the "
        "advantages were computed with in a direction that lowers its loss; empty disables it.",
    )
    freeze_policy_steps: int = Field(
        0, ge=0, description="The first N RL steps train only the critic; the policy keeps its weights (verl's "
        "critic_warmup), so the first policy updates see a critic that already fits the returns.",
    )

    def train_config(self, train: TrainConfig) -> TrainConfig:
        """The critic's TrainConfig: train's, with the critic's optimizer settings and worker count."""
        return train.model_copy(update={
            "num_workers": self.num_workers, "lr": self.lr, "lr_schedule": self.lr_schedule,
            "warmup_steps": self.warmup_steps, "grad_clip": self.grad_clip,
        })


class DistillConfig(Section):
    """On-policy distillation (docs/distillation.md): a frozen teacher scores the student's own samples token by
    token, and the reverse KL(student || teacher) on them joins the loss (or replaces the RL loss)."""

    teacher_path: str | None = Field(
        None, description="HF causal-LM directory of the teacher; empty: no distillation. Any size and architecture "
        "our loaders take, larger than the student or not, with the student's tokenizer (the same vocabulary: "
        "checked at the start).",
    )
    loss: Literal["reverse_kl", "forward_kl", "jsd"] = Field(
        "reverse_kl", description="reverse_kl: KL(student || teacher) estimated on the student's sampled tokens "
        "from the teacher's per-token logprobs (verl's k1/k3 estimator modes, Thinking Machines' on-policy "
        "distillation). forward_kl: KL(teacher || student) over the teacher's top_k tokens at each position "
        "(verl's forward_kl_topk); jsd: GKD's generalised Jensen-Shannon divergence (beta) on the same top_k "
        "(train.backend torch).",
    )
    top_k: int = Field(32, gt=0, description="forward_kl / jsd: the teacher's likeliest tokens per position the "
                       "divergence is taken over.")
    beta: float = Field(0.5, gt=0.0, lt=1.0, description="jsd: the teacher's weight in the mixture m = beta q + "
                        "(1 - beta) p.")
    estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k1", description="Per-token KL estimator (as algorithm.kl_estimator). With policy_gradient its negation, "
        "taken at the sampling policy, is the token's advantage (k1: log q - log p, the reverse-KL gradient); "
        "without, it is backpropagated directly (k2: the reverse-KL gradient; k3: the forward KL's in expectation).",
    )
    policy_gradient: bool = Field(
        True, description="Use the negated per-token estimate as an advantage in the PPO-clip loss (verl's "
        "use_policy_gradient); false: backpropagate the estimator as a loss (GKD-style).",
    )
    coef: float = Field(1.0, gt=0.0, description="Weight of the distillation loss.")
    mode: Literal["added", "alone"] = Field(
        "added", description="added: the distillation loss is added to the RL loss; alone: the RL policy loss "
        "is dropped, the student learns from the teacher only (rewards are still scored and logged).",
    )
    num_workers: int = Field(1, gt=0, description="Teacher workers: data-parallel copies, each scoring its slice.")
    nodes: int = nodes_field("teacher's workers")
    precision: Literal["fp32", "bf16"] | None = Field(
        None, description="The teacher's weights and compute dtype; empty: train.precision.",
    )
    gpus_per_worker: float = Field(
        1.0, gt=0.0, description="GPUs each teacher worker reserves on cuda (a fraction packs a small teacher "
        "beside others).",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.teacher_path)

    def loss_kwargs(self) -> dict[str, Any]:
        """rl_loss's distillation arguments, so every train backend passes the same ones ({} when off)."""
        if not self.enabled:
            return {}
        return {"distill_coef": self.coef, "distill_estimator": self.estimator,
                "distill_policy_gradient": self.policy_gradient, "distill_alone": self.mode == "alone",
                "distill_loss_name": self.loss, "distill_beta": self.beta}

    @property
    def uses_top_k(self) -> bool:
        """The loss needs the teacher's top-k log-probs and ids (forward_kl, jsd), not its sampled-token ones."""
        return self.loss in ("forward_kl", "jsd")


class MegatronConfig(Section):
    """The Megatron-core backend (train.backend: megatron). The three dicts reach megatron-core untouched."""

    tensor_parallel: int = Field(1, gt=0, description="Tensor-parallel size.")
    pipeline_parallel: int = Field(1, gt=0, description="Pipeline-parallel size.")
    expert_parallel: int = Field(
        1, gt=0, description="Expert-parallel size (MoE models): each rank holds 1/expert_parallel of every layer's "
        "experts, and tokens travel to their experts by all-to-all. Must divide the data-parallel size "
        "(train.num_workers / (tensor_parallel x pipeline_parallel)) and the number of experts."
    )
    micro_batch_tokens: int = Field(
        0, ge=0, description="Token budget of one micro-batch: summed sample lengths when packed, rows x padded "
        "length otherwise; 0: train.micro_batch_size rows."
    )
    packing: bool = Field(
        False, description="Run each micro-batch's samples as one token stream (megatron's THD layout, attention "
        "kept within each sample): no padding work. false: right-padded rows, as fast on an H100 today "
        "(docs/benchmarks.md)."
    )
    use_distributed_optimizer: bool = Field(True, description="Shard optimizer state over data-parallel ranks.")
    torch_fused_kernels: bool = Field(
        True, description="Where neither apex nor Transformer Engine is installed, torch's fused kernels stand in "
        "for theirs: weight-gradient GEMMs accumulate straight into the fp32 main_grad, a fused AdamW, foreach "
        "gradient norm and copies (engines/train/megatron/fused_kernels.py). false: megatron-core's own per-tensor "
        "fallbacks (slower; kept to compare)."
    )
    transformer_engine: bool | None = Field(
        None, description="Build layers from Transformer Engine; empty: when it is installed."
    )
    attention: Literal["sdpa", "unfused"] = Field(
        "sdpa", description="Core attention of the local (no Transformer Engine) layer spec: 'sdpa' runs torch's "
        "fused flash / memory-efficient kernels; 'unfused' megatron's DotProductAttention (materialises the score "
        "matrix; the reference). Ignored when Transformer Engine layers are used."
    )
    transformer: dict[str, Any] = Field(
        default_factory=dict, description="Extra TransformerConfig keyword arguments (override the derived ones)."
    )
    optimizer: dict[str, Any] = Field(
        default_factory=dict, description="Extra OptimizerConfig keyword arguments (override the derived ones)."
    )
    ddp: dict[str, Any] = Field(
        default_factory=dict, description="Extra DistributedDataParallelConfig keyword arguments."
    )

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @model_validator(mode="after")
    def _packing_needs_an_attention_that_packs(self) -> MegatronConfig:
        if self.packing and self.attention == "unfused" and not self.transformer_engine:
            raise ValueError("megatron.packing: true needs megatron.attention: sdpa (or Transformer Engine); "
                             "megatron's unfused DotProductAttention cannot run packed sequences. Set "
                             "megatron.packing: false to train the unfused attention on padded rows")
        return self

    @model_validator(mode="after")
    def _context_parallel_needs_transformer_engine(self) -> MegatronConfig:
        cp = self.transformer.get("context_parallel_size", 1)
        if cp != 1 and self.transformer_engine is not True:
            raise ValueError(f"megatron.transformer.context_parallel_size {cp} needs Transformer Engine's attention "
                             "(set megatron.transformer_engine: true where it is installed): the local layer spec's "
                             "attentions (sdpa, unfused) have no context-parallel form")
        return self


class ClusterConfig(Section):
    address: str | None = Field(
        None, description="Ray address to join ('auto' joins the one in RAY_ADDRESS); empty starts a private local Ray."
    )
    num_cpus: int | None = Field(None, gt=0, description="CPUs for a local Ray; empty: all.")
    cpus_per_worker: float = Field(0.5, ge=0, description="CPUs Ray reserves for each train/rollout actor.")
    object_store_mb: int = Field(512, gt=0, description="Object store size of a local Ray, MiB.")
    use_ray: bool = Field(True, description="False runs the workers inside the flow process (debugging).")
    colocate: bool = Field(
        False,
        description="GPU placement. true: rollout worker i shares train worker i's GPU; the rollout engine releases "
        "its weights' memory while training runs and takes the new ones after (slime's --colocate). false "
        "(disaggregated): train and rollout workers get GPUs of their own.",
    )
    shared_dir: str | None = Field(
        None, description="A folder every node mounts at the same path (NFS, Lustre, ...): the run's working files go "
        "there (the built model, checkpoints before they are committed to the store, a resumed checkpoint), since "
        "workers read and write them by path. Required when workers run on other nodes than the driver's (not "
        "when train.backend torch checkpoints into an object store and model.path is set); empty: the driver's "
        "temporary folder.")
    collective_timeout_s: float = Field(
        1800, gt=0, description="How long a torch.distributed collective (train ranks, weight-sync groups) waits for "
        "a peer before it fails the stage: a dead or hung rank ends the step, and the run resumes from its last "
        "checkpoint, instead of hanging.")


class CheckpointConfig(Section):
    """When a run saves what it needs to resume. The last step always saves. The defaults make a run with no
    checkpoint settings resumable: a crash loses at most 50 steps or about an hour of work, whichever is less,
    for one checkpoint per interval (docs/operations.md, "When a run checkpoints")."""

    every: int = Field(
        50, ge=0, description="Save every N steps (slime's --save-interval, verl's trainer.save_freq) and at the last "
        "step; 0: no step interval (with every_minutes 0: only at the end).",
    )
    every_minutes: float = Field(
        60, ge=0, description="Also save once this many minutes have passed since the last save (or since this "
        "attempt started), at the end of the step they pass in: bounds the work a crash loses when steps are slow; "
        "0: no time interval.",
    )
    keep_last: int = Field(2, gt=0, description="Committed checkpoints kept; the newest is never deleted.")
    async_save: bool = Field(
        False, description="Write checkpoints in the background (train.backend torch, not with train.lora): the "
        "checkpoint stage returns once every rank has copied its state to host memory (one more copy of each "
        "rank's model and optimizer state there), and the ranks train on while threads write it. It is committed "
        "once every rank's write is done; a run that fails before that resumes from the checkpoint before it. The "
        "last step's checkpoint is waited for.")
    save_rollouts: bool = Field(True, description="Persist each step's samples so a retried step reuses them.")
    keep_rollouts: bool = Field(False, description="Keep rollout batches older than the newest checkpoint.")


class EvalConfig(Section):
    every: int = Field(10, ge=0, description="Evaluate every N steps on data.eval_path; 0 disables.")
    max_prompts: int = Field(256, gt=0)
    temperature: float = Field(0.0, ge=0.0, description="0 means greedy decoding.")


class TrackingConfig(Section):
    uri: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI (sqlite:///file.db, http(s)://host:port, "
                     "or a folder); leave the key out for the default, an empty value is an error.")
    experiment: str = "rlflow"
    log_samples: int = Field(8, ge=0, description="Sample rollouts logged as a table each eval.")
    deadline_s: float = Field(120, gt=0, description="No retry of an MLflow call starts later than this many "
                              "seconds after its first attempt: an unreachable tracking server stops the run "
                              "within about this long.")
    timeout_s: float = Field(30, gt=0, description="Seconds one MLflow HTTP request may take.")

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(retries=8, deadline_s=self.deadline_s)

    @field_validator("uri")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        # MLflow reads an empty URI as "use the default", a ./mlruns folder in whatever directory the run starts in:
        # the metrics would land somewhere nobody looks (an unset environment variable in a template does this)
        if not v.strip():
            raise ValueError("empty; expected an MLflow tracking URI (sqlite:///mlflow.db, http://host:5000, a "
                             "folder), or leave the key out for the default sqlite:///mlflow.db")
        return v


class StorageConfig(Section):
    uri: str = Field("runs", description="Run store root: a local path, file:// or s3:// URI.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto, ...); empty: AWS.")
    profile: str | None = Field(None, description="AWS profile name; empty: the environment's credentials.")
    key: SecretStr | None = Field(None, description="Access key id (prefer the environment: AWS_ACCESS_KEY_ID).")
    secret: SecretStr | None = Field(None, description="Secret key (prefer the environment: AWS_SECRET_ACCESS_KEY).")
    region: str | None = None
    retries: int = Field(5, ge=0, description="Retries of a storage call after a transient error (backoff).")
    deadline_s: float = Field(120, gt=0, description="No retry of a storage call starts later than this many "
                              "seconds after its first attempt: an unreachable or failing store stops the run "
                              "within about this long.")
    timeout_s: float = Field(60, gt=0, description="Seconds one S3 request may take to connect, and to read.")

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(retries=self.retries, deadline_s=self.deadline_s)

    def fsspec_options(self, uri: str | None = None) -> dict[str, Any]:
        """Keyword arguments for fsspec to reach `uri` (default: the store's root): these settings serve any
        s3:// file of the run (data files too); empty for local paths. Secrets appear here and nowhere else."""
        if not (uri or self.uri).startswith(("s3://", "s3a://")):
            return {}
        opts: dict[str, Any] = {}
        client: dict[str, Any] = {}
        if self.endpoint_url:
            client["endpoint_url"] = self.endpoint_url
        if self.region:
            client["region_name"] = self.region
        if client:
            opts["client_kwargs"] = client
        if self.profile:
            opts["profile"] = self.profile
        if self.key and self.secret:
            opts["key"], opts["secret"] = self.key.get_secret_value(), self.secret.get_secret_value()
        return opts

    def run_store_options(self) -> dict[str, Any]:
        """fsspec_options for the run store: botocore tries each request once (and the run store sets s3fs's
        `retries` to 1), so the run store's RetryPolicy is the only retry layer. Data files keep the clients'
        own retries: they are read once, outside that layer."""
        opts = self.fsspec_options()
        if self.uri.startswith(("s3://", "s3a://")):
            opts["config_kwargs"] = {"retries": {"total_max_attempts": 1, "mode": "standard"},
                                     "connect_timeout": self.timeout_s, "read_timeout": self.timeout_s}
        return opts


class WeightSyncConfig(Section):
    transport: Literal["ray", "store", "disk", "distributed", "cuda_ipc", "nccl", "adapter"] = Field(
        "ray",
        description="ray: tensors go actor to actor through Ray's object store, bucket by bucket. store: rank 0 "
        "writes safetensors under the run store and rollout workers read them (works wherever the store does). "
        "disk: rank 0 writes safetensors into a folder per version under disk_dir and every rollout worker loads "
        "it (SGLang's /update_weights_from_disk). "
        "distributed: every rollout server joins a process group with train rank 0 and receives its broadcasts "
        "(SGLang's /init_weights_update_group and /update_weights_from_distributed; gloo on CPU, NCCL on GPUs). "
        "cuda_ipc (colocated GPUs): rollout workers copy straight from their train worker's parameters; with "
        "train.num_workers > 1 (FSDP2 shards) each rollout worker shares its weights with its GPU's rank, which "
        "all-gathers every weight straight into them (bucket_mb does not apply). "
        "nccl (separate GPUs, embedded engine): train rank 0 broadcasts buckets to the rollout workers over NCCL "
        "(over gloo when both sides are on the CPU). "
        "adapter (train.lora): rank 0 writes the LoRA adapter in PEFT's format into a folder per version under "
        "disk_dir and every rollout worker loads it (SGLang's /load_lora_adapter); the base weights never move.",
    )
    disk_dir: str = Field(
        default_factory=lambda: str(Path(tempfile.gettempdir()) / "rlflow-weights"),
        description="transports disk and adapter: a local folder that train rank 0 and every rollout worker see "
        "(one node, or a shared file system); versions go to <disk_dir>/<run>/weights/v<version>/ (adapters/ for "
        "adapter) and are removed once the next is loaded.",
    )
    bucket_mb: float = Field(64, gt=0, description="Size of one weight bucket, MiB.")


class StageTimeouts(Section):
    """Seconds a stage of one step may take before its Prefect task fails (0: no limit). A hung reward function,
    a stuck worker or a lost node then fails the step instead of holding the run forever; the run resumes from
    its last checkpoint. Enforced by Prefect's task timeout, which interrupts the flow's own thread (where the
    stages run) but not a one-step-off rollout running in a worker thread until its blocking call returns."""

    rollout: float = Field(7200, ge=0, description="Generating the step's samples (rollout.fn).")
    reward: float = Field(1800, ge=0, description="Scoring them (reward.fn).")
    teacher: float = Field(1800, ge=0, description="The distillation teacher scoring the samples (distill).")
    advantages: float = Field(1800, ge=0, description="Advantages (reference, critic and train logprobs).")
    train: float = Field(7200, ge=0, description="The optimizer steps of the step.")
    sync_weights: float = Field(1800, ge=0, description="Sending the weights to the rollout workers.")
    checkpoint: float = Field(7200, ge=0, description="Saving and committing a checkpoint.")
    evaluate: float = Field(7200, ge=0, description="The held-out evaluation.")


class OrchestrationConfig(Section):
    flow_retries: int = Field(0, ge=0, description="Prefect retries of a failed flow run; each resumes from the store.")
    task_retries: int = Field(0, ge=0, description="Retries of rollout, reward, checkpoint and eval (safe to rerun).")
    retry_delay_s: float = Field(10.0, ge=0)
    stage_timeout_s: StageTimeouts = Field(default_factory=StageTimeouts,
                                           description="Per-stage time limits, seconds (0: none).")


class DebugConfig(Section):
    """Debug modes (as slime's --debug-rollout-only / --debug-train-only), replay and the trace timeline
    (docs/debugging.md)."""

    mode: Literal["rollout_only", "train_only"] | None = Field(
        None,
        description="rollout_only: generate and score, no train workers, no training (throughput and rewards). "
        "train_only: train on replay_run's stored rollout batches, no rollout workers. Empty: a normal run.",
    )
    replay_run: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+$",
        description="Take each step's rollout batch from this run's store instead of generating (exact "
        "reproduction). That run must have kept its batches (checkpoint.keep_rollouts: true, or rollout_only).",
    )
    replay_store: str | None = Field(
        None, description="Run store root of replay_run (local path, file:// or s3://); empty: storage.uri, "
        "with storage's endpoint and credentials.",
    )
    trace_every: int = Field(
        0, ge=0, description="Write a Chrome-trace timeline (stage spans, per-request rollout events) every N steps "
        "and log it to MLflow as traces/step_<step>.json; 0: off (nothing is recorded).",
    )

    @property
    def trains(self) -> bool:
        return self.mode != "rollout_only"

    def traced(self, step: int) -> bool:
        return self.trace_every > 0 and (step + 1) % self.trace_every == 0

    @property
    def generates(self) -> bool:
        """Rollout workers run (and weights are synced to them)."""
        return self.mode != "train_only"


class RLConfig(Section):
    """A whole post-training run."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$", description="Run name: its folder in the run store.")
    seed: int = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)

    @model_validator(mode="after")
    def _consistent(self) -> RLConfig:
        mp = self.megatron.model_parallel
        if self.train.backend == "megatron" and self.train.num_workers % mp:
            raise ValueError(f"train.num_workers ({self.train.num_workers}) must be a multiple of "
                             f"megatron.tensor_parallel x megatron.pipeline_parallel ({mp})")
        ep = self.megatron.expert_parallel
        if self.train.backend == "megatron" and (self.train.num_workers // mp) % ep:
            raise ValueError(f"megatron.expert_parallel ({ep}) must divide the data-parallel size, train.num_workers "
                             f"/ (tensor_parallel x pipeline_parallel) = {self.train.num_workers // mp}")
        if self.algorithm.advantage in GROUP_ESTIMATORS and self.rollout.samples_per_prompt < 2:
            raise ValueError(f"rollout.samples_per_prompt: algorithm.advantage {self.algorithm.advantage} compares "
                             "the samples of one prompt, and 1 sample per prompt gives every sample advantage 0 "
                             "(no policy gradient): sample 2 or more per prompt, or use advantage reinforce_pp "
                             "(batch baseline) or gae (a critic)")
        if self.algorithm.advantage == "passk" and self.algorithm.passk_k > self.rollout.samples_per_prompt:
            raise ValueError(f"algorithm.passk_k ({self.algorithm.passk_k}) must be at most "
                             f"rollout.samples_per_prompt ({self.rollout.samples_per_prompt}): pass@k draws k of a "
                             "prompt's samples")
        if self.algorithm.advantage == "remax":
            if self.rollout.temperature == 0:
                raise ValueError("algorithm.advantage: remax compares sampled responses with the greedy one; with "
                                 "rollout.temperature 0 they are the same (every advantage 0): sample at > 0")
            if self.rollout.dynamic_sampling.enabled:
                raise ValueError("algorithm.advantage: remax adds a greedy sample to every group; dynamic sampling "
                                 "(rollout.dynamic_sampling) does not generate it: use one or the other")
        if self.checkpoint.async_save and self.train.backend != "torch":
            raise ValueError("checkpoint.async_save: the torch backend writes checkpoints in the background; "
                             f"train.backend {self.train.backend} saves synchronously (set async_save false)")
        if self.checkpoint.async_save and self.train.lora is not None:
            raise ValueError("checkpoint.async_save: a LoRA run's checkpoints (the adapters) are small and saved "
                             "synchronously; set async_save false or leave train.lora out")
        batch = self.step_samples
        if batch % (self.data_parallel_size * self.train.mini_batches) != 0:
            raise ValueError(
                f"train: the step's samples, {self._step_samples_text} = {batch}, must divide evenly "
                f"into {self.data_parallel_size} data-parallel workers x train.mini_batches "
                f"({self.train.mini_batches})"
            )
        self._check_critic(batch)
        self._check_distill(batch)
        if self.rollout.max_staleness >= 2 and not self.algorithm.corrects_rollout:
            warnings.warn(
                f"rollout.max_staleness {self.rollout.max_staleness} with algorithm.is_correction 'none': samples up "
                "to that many updates old are clipped against a policy as old as they are, which holds updates "
                "back (the CPU demo reaches 0.947 instead of 0.965 in 100 steps at k = 2); set "
                "algorithm.is_correction: tis (decoupled PPO, docs/algorithms.md)", UserWarning, stacklevel=2)
        if self.rollout.max_staleness and not self.checkpoint.save_rollouts:
            raise ValueError(
                "checkpoint.save_rollouts: must be true with rollout.max_staleness > 0 (a resumed run needs the "
                "batches the last checkpoint's weights did not generate)"
            )
        if self.algorithm.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({self.algorithm.overlong_buffer}) must not exceed "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens})"
            )
        self._check_placement()
        self._check_debug()
        self._check_sft()
        ds = self.rollout.dynamic_sampling
        if ds.partial_rollout and ds.enabled and self.rollout.fn != "rlflow.engines.rollout.functions:single_turn":
            raise ValueError("rollout.dynamic_sampling.partial_rollout: continues cut-short generations of the "
                             f"default rollout.fn only (rlflow.engines.rollout.functions:single_turn), "
                             f"not {self.rollout.fn!r}")
        if self.model.hidden_size % self.model.num_heads or self.model.num_heads % self.model.num_kv_heads:
            raise ValueError("model: hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        return self

    def _check_critic(self, batch: int) -> None:
        if self.algorithm.advantage == "gae" and self.critic.enabled is False:
            raise ValueError("critic.enabled: algorithm.advantage gae needs a critic (true, or leave it empty)")
        if not self.use_critic:
            return
        if self.train.backend != "torch":
            raise ValueError("critic: the critic runs on train.backend 'torch' only (megatron has no value head yet)")
        if batch % (self.critic.num_workers * self.train.mini_batches) != 0:
            raise ValueError(
                f"critic.num_workers: the step's samples, {self._step_samples_text} = {batch}, must divide "
                f"evenly into {self.critic.num_workers} critic workers x train.mini_batches ({self.train.mini_batches})"
            )
        if self.critic.freeze_policy_steps >= self.train.steps:
            raise ValueError(f"critic.freeze_policy_steps ({self.critic.freeze_policy_steps}) must be below "
                             f"train.steps ({self.train.steps}): the policy would never train")

    def _check_distill(self, batch: int) -> None:
        d = self.distill
        fields = type(d).model_fields
        changed = [k for k in fields if k != "teacher_path" and getattr(d, k) != fields[k].default]
        if not d.enabled:
            if changed:
                raise ValueError(f"distill.teacher_path: distill.{', distill.'.join(changed)} set without a teacher "
                                 "(set distill.teacher_path to the teacher's HF directory)")
            return
        for keys, applies in ((("estimator", "policy_gradient"), not d.uses_top_k), (("top_k",), d.uses_top_k),
                              (("beta",), d.loss == "jsd")):
            wrong = [k for k in keys if k in changed and not applies]
            if wrong:
                raise ValueError(f"distill.{', distill.'.join(wrong)}: does not apply to distill.loss {d.loss!r}")
        if d.uses_top_k and self.train.backend != "torch":
            raise ValueError(f"distill.loss: {d.loss} takes the student's logprobs of the teacher's top-k tokens "
                             "inside the torch backend's LM head; train.backend megatron offers reverse_kl only")
        if batch % d.num_workers:
            raise ValueError(f"distill.num_workers: the step's samples, {self._step_samples_text} = {batch}, must "
                             f"divide evenly into {d.num_workers} teacher workers")
        if d.mode == "alone" and self.use_critic:
            raise ValueError("distill.mode: alone drops the RL loss, so a critic (critic.enabled, advantage gae) "
                             "would train for nothing: use mode added, or no critic")

    @property
    def use_critic(self) -> bool:
        """Whether the run has a value model (critic.enabled, by default: advantage gae)."""
        return self.critic.enabled if self.critic.enabled is not None else self.algorithm.advantage == "gae"

    def _check_sft(self) -> None:
        if self.sft.batch_size % self.data_parallel_size:
            raise ValueError(f"sft.batch_size ({self.sft.batch_size}) must divide evenly into "
                             f"{self.data_parallel_size} data-parallel workers")
        a, b = self.data.generate, self.sft.generate
        if a is not None and b is not None and (a.task, a.num_digits, a.num_eval, a.seed) != (
                b.task, b.num_digits, b.num_eval, b.seed):
            raise ValueError("sft.generate: task, num_digits, num_eval and seed must equal data.generate's, or the "
                             "SFT pairs may contain the held-out prompts")
        if b is not None and not self.sft.train_path:
            raise ValueError("sft.generate: needs sft.train_path (the file to write)")

    def _check_placement(self) -> None:
        transport, on_gpu = self.weight_sync.transport, self.train.device == "cuda" and self.rollout_device == "cuda"
        if self.train.cpu_offload and (self.train.device != "cuda" or self.train.backend != "torch"):
            raise ValueError("train.cpu_offload: moves the torch backend's state from the GPU to the host; it needs "
                             "train.device 'cuda' and train.backend 'torch'")
        if self.train.kernels == "liger" and (self.train.device != "cuda" or self.train.backend != "torch"):
            raise ValueError("train.kernels: liger runs Triton kernels in the torch backend's model; it needs "
                             "train.device 'cuda' and train.backend 'torch'")
        if self.train.kernels == "liger" and self.train.compile:
            raise ValueError("train.kernels: liger's kernels are autograd functions torch.compile cannot trace (the "
                             "compile fails in the first forward); use train.compile (it fuses the same norms, rotary "
                             "and SwiGLU, and was faster: docs/benchmarks.md) or liger, not both")
        if transport in ("cuda_ipc", "nccl"):
            # nccl's channel is gloo when both sides are on the CPU (engines/sync/nccl.py); cuda_ipc maps GPU memory
            same_device = self.train.device == self.rollout_device
            if not (on_gpu or (transport == "nccl" and same_device)) or not self.cluster.use_ray:
                needs = "'cuda'" if transport == "cuda_ipc" else "alike ('cuda': NCCL; 'cpu': gloo)"
                raise ValueError(f"weight_sync.transport: {transport} needs train.device and rollout.device {needs} "
                                 "and cluster.use_ray: true (train and rollout in separate processes)")
            if self.train.backend != "torch":
                raise ValueError(f"weight_sync.transport: {transport} works with train.backend 'torch'; "
                                 "use 'ray' or 'store' with megatron")
            if self.train.cpu_offload:
                raise ValueError(f"weight_sync.transport: {transport} reads the trainer's weights on its GPU; with "
                                 "train.cpu_offload they live on the host: use 'distributed' (NCCL broadcast of "
                                 "gathered buckets) instead")
            if transport == "nccl" and self.train.num_workers > 1:
                raise ValueError("weight_sync.transport: nccl sends train rank 0's whole parameters; with "
                                 "train.num_workers > 1 (FSDP2 shards them) use 'distributed' (NCCL broadcast of "
                                 "gathered buckets) instead")
        if transport == "distributed":
            if self.rollout_device == "cuda" and self.train.device != "cuda":
                raise ValueError("weight_sync.transport: distributed with rollout.device 'cuda' broadcasts over "
                                 "NCCL, which needs train.device 'cuda' too")
            if self.rollout.backend == "torch" and not self.cluster.use_ray:
                raise ValueError("weight_sync.transport: distributed with the embedded engine needs cluster.use_ray: "
                                 "true (its server and train rank 0 join one process group from two processes)")
            if self.rollout.backend == "sglang":
                weight_update_ranks(self.rollout.sglang.args)  # refuses ranks that would collide (pipeline stages)
        if (transport == "adapter") != (self.train.lora is not None):
            raise ValueError("weight_sync.transport: adapter moves LoRA adapters alone; it goes with train.lora, "
                             "and train.lora needs it (the rollout engines keep the base and load each adapter)"
                             if transport == "adapter" else "train.lora: needs weight_sync.transport: adapter (only "
                             "the adapter moves; the rollout engines keep the base weights)")
        if self.train.lora is not None and self.train.backend != "torch":
            raise ValueError("train.lora: LoRA is built on the torch backend (peft); train.backend is "
                             f"{self.train.backend!r}")
        if transport == "cuda_ipc" and not self.cluster.colocate:
            raise ValueError("weight_sync.transport: cuda_ipc needs cluster.colocate: true (a shared GPU)")
        for name, section in (("train", self.train), ("rollout", self.rollout), ("critic", self.critic)):
            if section.num_workers % section.nodes:
                raise ValueError(f"{name}.nodes: {name}.num_workers ({section.num_workers}) must split evenly over "
                                 f"{section.nodes} nodes")
        if self.train.offload_during_rollout and not self.cluster.colocate:
            raise ValueError("train.offload_during_rollout: parks the trainer's state while a rollout engine uses "
                             "its GPU; it needs cluster.colocate: true (separate GPUs keep it where it is)")
        if self.cluster.colocate:
            if self.rollout.nodes != self.train.nodes:
                raise ValueError(f"cluster.colocate: rollout.nodes ({self.rollout.nodes}) must equal train.nodes "
                                 f"({self.train.nodes}): rollout worker i shares train worker i's GPU")
            if not on_gpu:
                raise ValueError("cluster.colocate: needs train.device and rollout.device 'cuda'")
            if self.rollout.num_workers != self.train.num_workers:
                raise ValueError(f"cluster.colocate: rollout.num_workers ({self.rollout.num_workers}) must equal "
                                 f"train.num_workers ({self.train.num_workers}): one pair per GPU")
            if self.rollout.max_staleness:
                raise ValueError(f"cluster.colocate: asynchronous training (rollout.max_staleness: "
                                 f"{self.rollout.max_staleness}) needs separate GPUs for rollout and training "
                                 "(colocate: false)")

    def _check_debug(self) -> None:
        d = self.debug
        if d.mode == "train_only" and not d.replay_run:
            raise ValueError("debug.replay_run: train_only needs a run whose stored rollout batches it trains on")
        if d.mode == "rollout_only" and d.replay_run:
            raise ValueError("debug.replay_run: rollout_only generates its batches; it cannot also replay them")
        if d.mode == "rollout_only" and self.rollout.max_staleness:
            raise ValueError("debug.mode: rollout_only trains nothing, so it runs synchronously "
                             "(rollout.max_staleness: 0)")
        if d.replay_run == self.name and (d.replay_store or self.storage.uri) == self.storage.uri:
            raise ValueError(f"debug.replay_run: {d.replay_run!r} is this run; name another run (or another store)")
        if d.mode and self.cluster.colocate:
            raise ValueError(f"debug.mode: {d.mode} starts one kind of worker; cluster.colocate pairs train and "
                             "rollout workers (set it to false)")

    @property
    def step_samples(self) -> int:
        """Samples in a step's batch: prompts x samples per prompt, plus one greedy baseline per prompt (remax)."""
        extra = 1 if self.algorithm.advantage == "remax" else 0
        return self.rollout.prompts_per_step * (self.rollout.samples_per_prompt + extra)

    @property
    def _step_samples_text(self) -> str:
        if self.algorithm.advantage == "remax":
            return "rollout.prompts_per_step * (rollout.samples_per_prompt + 1 greedy baseline)"
        return "rollout.prompts_per_step * rollout.samples_per_prompt"

    @property
    def rollout_device(self) -> str:
        return self.rollout.device or self.train.device

    @property
    def offloads_trainer(self) -> bool:
        """Whether the train workers park their state in host memory while their colocated rollout engine runs
        (train.offload_during_rollout; empty: whenever colocated)."""
        return self.cluster.colocate and self.train.offload_during_rollout is not False

    @property
    def data_parallel_size(self) -> int:
        if self.train.backend == "megatron":
            return self.train.num_workers // self.megatron.model_parallel
        return self.train.num_workers


class EvalDatasetConfig(Section):
    path: str = Field(..., description="Held-out prompt file: .jsonl or .parquet.")
    name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+$", description="Name in metric keys (<name>/accuracy); empty: the file's stem."
    )
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    label_key: str = Field("label", description="Column holding what the reward checks against.")

    @property
    def key(self) -> str:
        return self.name or Path(self.path).stem


class EvalSamplingConfig(Section):
    """How a checkpoint is evaluated: samples per prompt, decoding, size. Shared by the evaluate and pipeline flows."""

    datasets: list[EvalDatasetConfig] = Field(
        default_factory=list, description="Held-out datasets. In the pipeline, empty: the training recipe's eval_path."
    )
    max_prompts: int = Field(256, gt=0, description="Prompts evaluated per dataset (the first ones).")
    samples_per_prompt: int = Field(4, gt=0, description="n: responses sampled per prompt (pass@k needs k <= n).")
    pass_k: list[int] = Field(default_factory=lambda: [1], description="k values of pass@k, each at most n.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 means greedy (then use n = 1).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int | None = Field(None, gt=0, description="Response length limit; empty: 8, or in the pipeline "
                                       "the training recipe's rollout.max_new_tokens.")
    chat_template: bool | None = Field(
        None, description="Render each prompt as training did (data.chat_template): true: one user message in the "
        "tokenizer's chat template with the generation prompt; false: the text as it is. Empty: the training recipe's "
        "data.chat_template (a run-store checkpoint's config.json; in the pipeline, train_recipe), false for a "
        "Hugging Face directory.",
    )
    batch_size: int = Field(512, gt=0, description="Sequences generated together.")
    threads: int = Field(2, gt=0, description="torch threads.")
    device: Literal["cpu", "cuda"] = "cpu"
    seed: int = 0
    samples_logged: int = Field(8, ge=0, description="Sample responses per dataset in the report and MLflow table.")
    shards: int = Field(
        1, gt=0, description="Prefect tasks each dataset's prompts are split into (contiguous, near-equal; at most one "
        "per prompt). Each shard generates and rewards its prompts; the flow scores the merged samples, so the "
        "metrics equal an unsharded evaluation's.",
    )
    shard_runner: Literal["thread", "ray"] = Field(
        "thread", description="Where shard tasks run. thread: threads of the flow process, sharing one rollout "
        "engine (no Ray). ray: each shard a Ray task through prefect-ray's RayTaskRunner, reserving `threads` "
        "CPUs (and a GPU on cuda); each Ray worker process loads the checkpoint once. The cluster: `ray_address`, "
        "else RAY_ADDRESS, else a private local Ray of shards x threads CPUs.",
    )
    ray_address: str | None = Field(
        None, description="shard_runner ray: address of the Ray cluster to join ('auto': the running one); empty: "
        "RAY_ADDRESS if set, else a private local Ray for this evaluation.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> EvalSamplingConfig:
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples_per_prompt]
        if bad:
            raise ValueError(f"pass_k: {bad} must be between 1 and samples_per_prompt ({self.samples_per_prompt})")
        names = [d.key for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"datasets: names must be unique, got {names}")
        return self


class EvaluationConfig(Section):
    """One evaluation of one checkpoint (flows/evaluate.py): metrics to MLflow and Prefect artifacts."""

    name: str = Field("eval", pattern=r"^[A-Za-z0-9_.-]+$", description="Name of the evaluation's MLflow run.")
    checkpoint: str = Field(
        ...,
        description="What to evaluate: a run-store checkpoint (<store>/<run>/checkpoints/<step>, file:// or s3://), "
        "a run (<store>/<run>: its newest committed checkpoint), or a local Hugging Face model directory.",
    )
    training_run_id: str | None = Field(
        None, description="MLflow run id of the training run to link to; empty: the one in the checkpoint's meta.json."
    )
    eval: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="Credentials and endpoint for an s3:// checkpoint (uri unused)."
    )

    @model_validator(mode="after")
    def _has_data(self) -> EvaluationConfig:
        if not self.eval.datasets:
            raise ValueError("eval.datasets: at least one dataset is required")
        return self


class RegisterConfig(Section):
    """When the pipeline registers an evaluated checkpoint in the MLflow model registry."""

    model_name: str = Field("rlflow-model", description="Registered model name in MLflow.")
    metric: str = Field(
        "accuracy", description="Eval metric that decides: accuracy, reward_mean, pass_at_<k>, response_len_mean."
    )
    dataset: str | None = Field(None, description="Dataset whose metric decides; empty: the first one.")
    threshold: float | None = Field(None, description="Register only if the metric is at least this; empty: no bar.")
    beat_best: bool = Field(True, description="Register only if the metric beats every registered version's.")


class PipelineConfig(Section):
    """post-train -> evaluate -> register (flows/pipeline.py); each stage is its own flow run."""

    train_recipe: str = Field(..., description="The training recipe (YAML, relative to the working directory).")
    train_overrides: list[str] = Field(default_factory=list, description="KEY.PATH=VALUE overrides of the recipe.")
    eval: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    registry: RegisterConfig = Field(default_factory=RegisterConfig)
    train_deployment: str = Field("post-train/post-train", description="Deployment that runs the training stage.")
    eval_deployment: str = Field("evaluate/evaluate", description="Deployment that runs the evaluation stage.")


M = TypeVar("M", bound=BaseModel)


class RecipeError(ValueError):
    """A recipe that cannot run; the message lists every problem, one per line, each naming its field."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))


def _format_errors(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<recipe>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and e["type"] not in ("value_error",):
            msg = f"{msg} (got {e['input']!r})"
        out.append(f"{field}: {msg}")
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=c' -> (['a', 'b'], value), the value parsed as YAML so numbers and lists keep their types."""
    if "=" not in text:
        raise RecipeError("--set", [f"{text!r}: expected KEY.PATH=VALUE"])
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError("--set", [f"{text!r}: {part} is not a section"])
        node[path[-1]] = value
    return raw


def load_recipe(path: str | Path, overrides: list[str] | None = None, model: type[M] | None = None) -> M:
    """Read a YAML recipe, apply `--set` overrides, validate. Raises RecipeError naming every bad field.

    `model` is the tree the recipe is for: RLConfig (the default), EvaluationConfig or PipelineConfig."""
    return config_from_dict(read_recipe(path, overrides), source=str(path), model=model)


def read_recipe(path: str | Path, overrides: list[str] | None = None) -> dict:
    """A YAML recipe as a dict with `--set` overrides applied, not yet validated (`rlflow validate` checks the
    valid sections of an invalid one too). Raises RecipeError for a missing file or bad YAML."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(str(path), ["recipe file not found"])
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(str(path), [f"not valid YAML: {e}"]) from None
    if not isinstance(raw, dict):
        raise RecipeError(str(path), ["top level must be a mapping of sections"])
    return apply_overrides(raw, overrides or [])


def valid_sections(raw: dict) -> tuple[RLConfig, set[str]]:
    """An RLConfig of the sections of `raw` that are valid on their own (defaults where a section is absent), not
    checked as a whole, and the names of the invalid or missing required sections: checks that need only valid
    sections can run on a recipe that fails validation."""
    good: dict[str, BaseModel] = {}
    bad: set[str] = set()
    for name, field in RLConfig.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue
        if name not in raw:
            if field.is_required():
                bad.add(name)
            continue
        try:
            good[name] = section.model_validate(raw[name])
        except ValidationError:
            bad.add(name)
    return RLConfig.model_construct(**good), bad


def config_from_dict(raw: dict, source: str = "<config>", model: type[M] | None = None) -> M:
    try:
        return (model or RLConfig).model_validate(raw)
    except ValidationError as e:
        raise RecipeError(source, _format_errors(e)) from None


def resolve_config(model: type[M], config: M | dict | None, recipe: str | None, overrides: list[str] | None) -> M:
    """A flow's configuration from its parameters, by the merge rule of docs/deployments.md: the recipe file
    (`recipe`, relative to the working directory, read with the CLI's loader) is the base; a given `config` (the
    whole tree, as the UI's run form sends it, or any part of it, as an API call may) is deep-merged over it:
    mappings key by key, any other value (a list too) replacing the recipe's; `overrides` ('a.b=value', as
    `--set`) apply last. The flows take their parameters unvalidated (a part of the tree is not a valid tree),
    so each parameter's type is checked here."""
    if recipe is not None and not isinstance(recipe, str):
        raise RecipeError("parameters", [f"recipe: expected a recipe file path (a string), got {recipe!r}"])
    if overrides is not None and not (isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)):
        raise RecipeError("parameters", [f"overrides: expected a list of KEY.PATH=VALUE strings, got {overrides!r}"])
    if isinstance(config, model) and not recipe and not overrides:
        return config
    if config is None and not recipe:
        raise RecipeError("parameters", ["config or recipe: one of them is required"])
    raw = read_recipe(recipe) if recipe else {}
    if config is not None:
        raw = deep_merge(raw, _tree(config))
    source = " + ".join(filter(None, [recipe, None if config is None else "config"]))
    return config_from_dict(apply_overrides(raw, overrides or []), source=source, model=model)


def deep_merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`: where both hold a mapping, key by key; otherwise `over`'s value."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _tree(config: BaseModel | dict) -> dict:
    """A `config` parameter as a plain tree: a model dumped whole, its credentials kept (model_dump masks them)."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, BaseModel):
        raise RecipeError("parameters", [f"config: expected a mapping of sections (the configuration tree), "
                                         f"got {type(config).__name__} {config!r}"])
    raw = config.model_dump(mode="json", exclude_unset=False, round_trip=True)
    for section, secret_fields in _secrets(config).items():
        raw[section].update(secret_fields)
    return raw


def public_tree(config: BaseModel) -> dict:
    """A config as JSON without credentials: what is stored, logged, and given as a flow's `config` parameter
    (a deployment's default, a pipeline's stage run); the worker's environment gives the credentials."""
    return config.model_dump(mode="json", exclude={"storage": {"key", "secret"}})


def _secrets(config: BaseModel) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name in type(config).model_fields:
        section = getattr(config, name)
        if isinstance(section, BaseModel):
            found = {k: v.get_secret_value() for k, v in section if isinstance(v, SecretStr)}
            if found:
                out[name] = found
    return out
