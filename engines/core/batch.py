"""The two batches of an iteration.

`RolloutBatch`: a step's samples as the rollout stage made them, in flat numpy arrays (one Ray/parquet-friendly
object instead of N Python objects). It flows from rollout through reward, advantages and training, and
`ROLLOUT_SCHEMA` is the one Arrow schema it is persisted and replayed with (`<run>/steps/<step>/rollout.parquet`,
rejection sampling's rounds).

`TrainBatch`: the samples packed into right-padded tensors for the train workers. Logprob tensors are aligned
with tokens: column t holds log p(x_t | x_<t) (column 0 is 0), so a loss mask over response tokens selects
exactly the logprobs the policy is trained on. `to_train_batch` makes input_ids, attention_mask, loss_mask,
old_logprobs and advantages; the stages add the columns they compute over the whole step, in the same [N, L]
layout: ref_logprobs, rollout_logprobs (the train engine's become old_logprobs), is_weights, and
`teacher_logprobs` (on-policy distillation: the teacher's log-probabilities of the student's sampled tokens, from
the teacher stage; TEACHER_LOGPROBS), or for the top-k losses `teacher_topk_ids` and `teacher_topk_logprobs`
([N, L, k]: a trailing dimension that micro-batching keeps). They are recomputed from the persisted samples on
resume, never stored. A vision-language batch's `image_ids` ([N, max images, 32] uint8, IMAGE_IDS) are the raw
sha256 digests of each sample's images (the run store's keys), all zero where a sample has fewer: the train
workers read the images by digest, so no pixels travel with the batch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch

TrainBatch = dict[str, torch.Tensor]
TEACHER_LOGPROBS = "teacher_logprobs"  # the distillation teacher's column of a TrainBatch
# ... and with distill.loss forward_kl / jsd its top-k at each position, [N, L, k] each
TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS = "teacher_topk_ids", "teacher_topk_logprobs"
IMAGE_IDS = "image_ids"  # vision-language: each sample's image digests, uint8 [N, max images, 32]
DIGEST_BYTES = 32  # a sha256 digest

# one row per sample; `response` and `reward` are null until the reward stage has run
ROLLOUT_SCHEMA = pa.schema([
    ("prompt", pa.string()),
    ("label", pa.string()),  # JSON of the data row's label
    ("group", pa.int64()),  # index of the sample's prompt in the step: samples of one group share a prompt
    ("prompt_ids", pa.list_(pa.int64())),
    ("output_ids", pa.list_(pa.int64())),  # the response: model tokens and, multi-turn, tool tokens
    ("output_logprobs", pa.list_(pa.float32())),  # behaviour policy's, per response token
    ("loss_mask", pa.list_(pa.float32())),  # 1: trained on; 0: a tool/environment token
    ("has_logprobs", pa.bool_()),  # false: the rollout function gave none (the trainer computes them)
    ("fn_reward", pa.float64()),  # a reward the rollout function gave; null: reward.fn scores the sample
    ("text", pa.string()),  # the response text the rollout function gave; null: decoded from output_ids
    ("stopped", pa.bool_()),  # finished by a stop condition, not by length or abort
    ("weight_version", pa.int64()),  # weights that generated it (the first, if it spanned updates); -1: not known
    ("last_weight_version", pa.int64()),  # the newest weights that generated a token of it; -1: not known
    ("carried", pa.bool_()),  # dynamic sampling: the group was carried over from an earlier step
    ("baseline", pa.bool_()),  # ReMax: the group's greedy sample, rewarded as its baseline, never trained on
    ("response", pa.string()),  # the text the reward saw
    ("reward", pa.float64()),
    # routing replay r3: the experts of each token fed to the rollout model, [tokens, routing_width] flat (the
    # width, MoE layers x k, in the schema metadata); null: not recorded
    ("routed_experts", pa.list_(pa.int16())),
    ("images", pa.list_(pa.string())),  # vision-language: the prompt's image digests (sha256 hex); empty for text
])
ROUTED_EXPERTS = "routed_experts"  # the TrainBatch column: [N, L, MoE layers x k] int16, -1 where not recorded
ROUTING_WIDTH = "routing_width"  # RolloutBatch.metadata: ids a token's record holds
_TOKEN_FIELDS = ("output_ids", "output_logprobs", "loss_mask")  # flat over all samples, cut by `lengths`


class PromptLike(Protocol):
    """What `RolloutBatch.from_samples` reads of a prompt (rollout.functions.PromptSample is one); also, when the
    prompt has them, `images`: its image digests (read with getattr, so a prompt without the field is text)."""

    prompt: str
    label: Any
    prompt_ids: list[int]


class SampleLike(Protocol):
    """What `RolloutBatch.from_samples` reads of a generated sample (rollout.functions.Sample is one)."""

    response_ids: list[int]
    logprobs: list[float] | None
    loss_mask: list[int] | None
    reward: float | None
    response: str | None
    finish_reason: str
    weight_version: int | None
    last_weight_version: int | None
    prompt_ids: list[int] | None
    metadata: dict


@dataclass
class RolloutBatch:
    """A step's samples: per-sample fields, and the response tokens of all samples in flat arrays (`lengths`
    cut them per sample)."""

    prompt: list[str]
    label: list[Any]
    group: np.ndarray  # int64 [N]: index of the sample's prompt in the step
    prompt_ids: list[list[int]]
    output_ids: np.ndarray  # int64 [sum(lengths)]
    output_logprobs: np.ndarray  # float32 [sum(lengths)]
    loss_mask: np.ndarray  # float32 [sum(lengths)]
    lengths: np.ndarray  # int64 [N]
    has_logprobs: np.ndarray  # bool [N]
    fn_reward: np.ndarray  # float64 [N], NaN where the rollout function gave none
    text: list[str | None]
    stopped: np.ndarray  # bool [N]
    weight_version: np.ndarray  # int64 [N]: the first weights that generated each sample, -1 where not known
    carried: np.ndarray  # bool [N]
    baseline: np.ndarray  # bool [N]: a ReMax greedy baseline sample (its loss mask is all 0)
    response: list[str] | None = None  # set by the reward stage
    reward: np.ndarray | None = None  # float64 [N], set by the reward stage
    metadata: dict[str, str] = field(default_factory=dict)  # persisted in the table's schema metadata
    # int64 [N]: the last weights (a partial rollout continues across updates); None: the first's
    last_weight_version: np.ndarray | None = None
    # routing replay r3: per sample, int16 [tokens, metadata routing_width] (tokens: those fed to the rollout model,
    # prompt first; at most prompt + response), or None where not recorded; None: nothing recorded
    routed_experts: list[np.ndarray | None] | None = None
    # vision-language: per sample, its prompt's image digests (sha256 hex) in prompt order, [] for a text sample;
    # None: a batch without images
    images: list[list[str]] | None = None

    def __post_init__(self) -> None:
        if self.last_weight_version is None:
            self.last_weight_version = self.weight_version.copy()

    @classmethod
    def from_samples(cls, prompts: Sequence[PromptLike], groups: Sequence[Sequence[SampleLike]],
                     routing_width: int | None = None) -> RolloutBatch:
        """What the rollout functions returned, one group of samples per prompt (group g belongs to prompts[g]).
        `routing_width`: ids per token in the samples' routed_experts (MoE layers x k), kept when any has one."""
        pairs = [(g, p, s) for g, (p, samples) in enumerate(zip(prompts, groups, strict=True)) for s in samples]
        samples = [s for _, _, s in pairs]
        lengths = np.array([len(s.response_ids) for s in samples], dtype=np.int64)
        total = int(lengths.sum())
        prompt_ids = [list(s.prompt_ids if s.prompt_ids is not None else p.prompt_ids) for _, p, s in pairs]
        routed = _routing_records([getattr(s, "routed_experts", None) for s in samples], prompt_ids, lengths,
                                  routing_width)
        return cls(
            prompt=[p.prompt for _, p, _ in pairs],
            label=[p.label for _, p, _ in pairs],
            group=np.array([g for g, _, _ in pairs], dtype=np.int64),
            prompt_ids=prompt_ids,
            output_ids=np.fromiter((t for s in samples for t in s.response_ids), dtype=np.int64, count=total),
            output_logprobs=np.fromiter((x for s in samples for x in (s.logprobs or [0.0] * len(s.response_ids))),
                                        dtype=np.float32, count=total),
            loss_mask=np.fromiter((m for s in samples for m in (s.loss_mask or [1] * len(s.response_ids))),
                                  dtype=np.float32, count=total),
            lengths=lengths,
            has_logprobs=np.array([s.logprobs is not None for s in samples], dtype=bool),
            fn_reward=np.array([np.nan if s.reward is None else s.reward for s in samples], dtype=np.float64),
            text=[s.response for s in samples],
            stopped=np.array([s.finish_reason == "stop" for s in samples], dtype=bool),
            weight_version=np.array([-1 if s.weight_version is None else s.weight_version for s in samples],
                                    dtype=np.int64),  # -1: not known (a rollout function that gives no logprobs)
            last_weight_version=np.array([_last_version(s) for s in samples], dtype=np.int64),
            carried=np.array([bool(s.metadata.get("carried")) for s in samples], dtype=bool),
            baseline=np.array([bool(s.metadata.get("remax_baseline")) for s in samples], dtype=bool),
            routed_experts=routed,
            metadata={ROUTING_WIDTH: str(routing_width)} if routed is not None else {},
            images=_image_lists([list(getattr(p, "images", None) or []) for _, p, _ in pairs]),
        )

    # ---- views -------------------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def offsets(self) -> np.ndarray:
        """int64 [N + 1]: sample i's response tokens are [offsets[i], offsets[i + 1]) of the flat fields."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    def responses(self, i: int, name: str = "output_ids") -> np.ndarray:
        """Sample i's part of a flat field ('output_ids', 'output_logprobs' or 'loss_mask'): a view."""
        lo = int(self.lengths[:i].sum())
        return getattr(self, name)[lo : lo + int(self.lengths[i])]

    def split(self, name: str) -> list[np.ndarray]:
        """Per-sample views of a flat field: 'output_ids', 'output_logprobs' or 'loss_mask'."""
        return np.split(getattr(self, name), np.cumsum(self.lengths)[:-1])

    def group_starts(self) -> np.ndarray:
        """Index of each group's first sample, in batch order."""
        return np.flatnonzero(np.r_[True, self.group[1:] != self.group[:-1]]) if len(self) else np.zeros(0, int)

    def group_size(self) -> int:
        """The samples per group, checked to be the layout group-wise algorithms assume: groups 0, 1, 2, ... of
        one size each, their samples consecutive."""
        n, g = len(self), len(self.group_starts())
        size = n // g if g else 0
        if not g or n % g or not np.array_equal(self.group, np.arange(n) // size):
            raise ValueError(f"RolloutBatch: groups {self.group.tolist()} are not consecutive groups of one size")
        return size

    def select(self, idx: Sequence[int] | np.ndarray) -> RolloutBatch:
        """The samples at `idx` (indices or a boolean mask), in that order; group ids and metadata kept."""
        idx = np.asarray(idx)
        idx = np.flatnonzero(idx) if idx.dtype == bool else idx.astype(np.int64)
        starts = self.offsets[idx]
        tokens = np.repeat(starts - np.cumsum(self.lengths[idx]) + self.lengths[idx], self.lengths[idx])
        tokens = tokens + np.arange(len(tokens))  # the flat positions of the chosen samples' tokens, in order
        pick = [int(i) for i in idx]
        return replace(
            self,
            prompt=[self.prompt[i] for i in pick], label=[self.label[i] for i in pick], group=self.group[idx],
            prompt_ids=[self.prompt_ids[i] for i in pick],
            **{name: getattr(self, name)[tokens] for name in _TOKEN_FIELDS},
            lengths=self.lengths[idx], has_logprobs=self.has_logprobs[idx], fn_reward=self.fn_reward[idx],
            text=[self.text[i] for i in pick], stopped=self.stopped[idx], weight_version=self.weight_version[idx],
            last_weight_version=self.last_weight_version[idx],
            carried=self.carried[idx], baseline=self.baseline[idx],
            response=None if self.response is None else [self.response[i] for i in pick],
            reward=None if self.reward is None else self.reward[idx],
            metadata=dict(self.metadata),
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in pick],
            images=None if self.images is None else [self.images[i] for i in pick],
        )

    # ---- stages ------------------------------------------------------------------------------------------
    def with_rewards(self, response: list[str], reward: Sequence[float]) -> RolloutBatch:
        """The batch scored: the text the reward saw and the reward of every sample (the reward stage's output)."""
        if len(response) != len(self) or len(reward) != len(self):
            raise ValueError(f"with_rewards: {len(response)} responses and {len(reward)} rewards for "
                             f"{len(self)} samples")
        return replace(self, response=list(response), reward=np.asarray(reward, dtype=np.float64))

    def to_train_batch(self, pad_id: int, advantages: torch.Tensor) -> TrainBatch:
        """The samples packed for the train workers (the one place a RolloutBatch becomes a TrainBatch); with
        recorded routing, its ROUTED_EXPERTS column too; with images, IMAGE_IDS."""
        batch = pack_samples(self.prompt_ids, self.split("output_ids"), self.split("output_logprobs"), advantages,
                             pad_id, self.split("loss_mask"))
        if self.routed_experts is not None:
            n, width = batch["input_ids"].shape
            routed = torch.full((n, width, int(self.metadata[ROUTING_WIDTH])), -1, dtype=torch.int16)
            for i, rec in enumerate(self.routed_experts):
                if rec is not None:
                    routed[i, :len(rec)] = torch.tensor(rec)  # (an Arrow-backed record is read-only)
            batch[ROUTED_EXPERTS] = routed
        if self.images is not None:
            batch[IMAGE_IDS] = image_ids(self.images)
        return batch

    def metrics(self) -> dict[str, float]:
        n_tokens = int(self.lengths.sum())
        return {
            "rollout/response_len_mean": n_tokens / len(self),
            "rollout/tokens": float(n_tokens),
            "rollout/truncated": float(1 - self.stopped.mean()),
            "rollout/weight_version": float(self.weight_version.min()),  # -1: a rollout function did not say
            "rollout/weight_version_last": float(self.last_weight_version.max()),
            # samples that spanned a weight update (asynchronous training with max_staleness >= 2)
            "rollout/spanning_frac": float((self.last_weight_version != self.weight_version).mean()),
        }

    # ---- persistence -------------------------------------------------------------------------------------
    def to_arrow(self, metadata: Mapping[str, str] | None = None) -> pa.Table:
        """The batch as a table of ROLLOUT_SCHEMA (a row per sample); `metadata` is added to the batch's own
        in the schema metadata. Token lists are built from the flat arrays without copying them to Python."""
        scored = self.reward is not None
        offsets = pa.array(self.offsets.astype(np.int32))
        meta = dict(self.metadata) | dict(metadata or {})
        return pa.table({
            "prompt": pa.array(self.prompt, type=pa.string()),
            "label": pa.array([json.dumps(x) for x in self.label], type=pa.string()),
            "group": self.group,
            "prompt_ids": pa.array(self.prompt_ids, type=pa.list_(pa.int64())),
            "output_ids": pa.ListArray.from_arrays(offsets, pa.array(self.output_ids, type=pa.int64())),
            "output_logprobs": pa.ListArray.from_arrays(offsets, pa.array(self.output_logprobs, type=pa.float32())),
            "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(self.loss_mask, type=pa.float32())),
            "has_logprobs": self.has_logprobs,
            "fn_reward": pa.array(self.fn_reward, type=pa.float64(), from_pandas=True),  # NaN -> null
            "text": pa.array(self.text, type=pa.string()),
            "stopped": self.stopped,
            "weight_version": self.weight_version,
            "last_weight_version": self.last_weight_version,
            "carried": self.carried,
            "baseline": self.baseline,
            "response": pa.array(self.response if scored else [None] * len(self), type=pa.string()),
            "reward": pa.array(self.reward if scored else [None] * len(self), type=pa.float64()),
            "routed_experts": pa.array([None if r is None else r.reshape(-1) for r in (
                self.routed_experts or [None] * len(self))], type=pa.list_(pa.int16())),
            "images": pa.array(self.images or [[] for _ in range(len(self))], type=pa.list_(pa.string())),
        }, schema=ROLLOUT_SCHEMA.with_metadata(meta or None))

    @classmethod
    def from_arrow(cls, table: pa.Table, samples_per_prompt: int = 1) -> RolloutBatch:
        """A persisted batch (columns beyond ROLLOUT_SCHEMA's are ignored). Tables written before some columns
        existed read as: every token trained on, rollout logprobs, reward.fn scores, decoded texts, consecutive
        groups of `samples_per_prompt`, not scored yet."""
        cols, n = set(table.column_names), table.num_rows

        def column(name: str, default: Any) -> list:
            return table.column(name).to_pylist() if name in cols else default

        lengths, output_ids = _list_column(table, "output_ids", np.int64)
        _, output_logprobs = _list_column(table, "output_logprobs", np.float32)
        loss_mask = _list_column(table, "loss_mask", np.float32)[1] if "loss_mask" in cols else np.ones(
            len(output_ids), dtype=np.float32)
        reward = column("reward", None)
        scored = reward is not None and all(r is not None for r in reward)
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()
                if not k.startswith(b"ARROW:")}
        return cls(
            prompt=table.column("prompt").to_pylist(),
            label=[json.loads(x) for x in table.column("label").to_pylist()],
            group=np.array(column("group", [i // samples_per_prompt for i in range(n)]), dtype=np.int64),
            prompt_ids=table.column("prompt_ids").to_pylist(),
            output_ids=output_ids,
            output_logprobs=output_logprobs,
            loss_mask=loss_mask,
            lengths=lengths,
            has_logprobs=np.array(column("has_logprobs", [True] * n), dtype=bool),
            fn_reward=np.array([np.nan if r is None else r for r in column("fn_reward", [None] * n)], dtype=np.float64),
            text=column("text", [None] * n),
            stopped=np.array(table.column("stopped").to_pylist(), dtype=bool),
            weight_version=np.array(table.column("weight_version").to_pylist(), dtype=np.int64),
            last_weight_version=np.array(column("last_weight_version", table.column("weight_version").to_pylist()),
                                         dtype=np.int64),
            carried=np.array(column("carried", [False] * n), dtype=bool),
            baseline=np.array(column("baseline", [False] * n), dtype=bool),
            response=column("response", None) if scored else None,
            reward=np.array(reward, dtype=np.float64) if scored else None,
            metadata=meta,
            routed_experts=_routing_column(table, meta),
            images=_image_lists([d or [] for d in column("images", [[]] * n)]),
        )


def _image_lists(images: list[list[str]]) -> list[list[str]] | None:
    """Per-sample image digests, each checked to be a sha256 hex digest; None when no sample has an image."""
    if not any(images):
        return None
    for i, digests in enumerate(images):
        for d in digests:
            if len(d) != 2 * DIGEST_BYTES or any(c not in "0123456789abcdef" for c in d):
                raise ValueError(f"images of sample {i}: {d!r} is not a sha256 hex digest (64 lowercase hex "
                                 "characters, the run store's image key)")
    return [list(d) for d in images]


def image_ids(images: Sequence[Sequence[str]]) -> torch.Tensor:
    """The IMAGE_IDS column: uint8 [N, max images, 32], sample i's j-th digest at [i, j], zero rows after its last."""
    width = max((len(d) for d in images), default=0)
    out = np.zeros((len(images), width, DIGEST_BYTES), dtype=np.uint8)
    for i, digests in enumerate(images):
        for j, d in enumerate(digests):
            out[i, j] = np.frombuffer(bytes.fromhex(d), dtype=np.uint8)
    return torch.from_numpy(out)


def image_digests(ids: torch.Tensor) -> list[list[str]]:
    """IMAGE_IDS rows back to hex digests, all-zero rows (no image) left out: what a train worker reads images by."""
    rows = ids.to(torch.uint8).cpu().numpy()
    return [[bytes(d).hex() for d in row if d.any()] for row in rows]


def _routing_records(records: list[np.ndarray | None], prompt_ids: list[list[int]], lengths: np.ndarray,
                     width: int | None) -> list[np.ndarray | None] | None:
    """The samples' flat routed_experts as [tokens, width] int16, each checked to cover at most the sample's
    tokens; None when no sample has one."""
    if all(r is None for r in records):
        return None
    if not width:
        raise ValueError("routed_experts: samples carry expert routing, but the model's routing width (MoE layers x "
                         "experts per token) is not known: is the model a mixture of experts?")
    out: list[np.ndarray | None] = []
    for i, (rec, prompt, n) in enumerate(zip(records, prompt_ids, lengths.tolist(), strict=True)):
        if rec is None:
            out.append(None)
            continue
        rec = np.asarray(rec, dtype=np.int16).reshape(-1)
        if rec.size % width or rec.size // width > len(prompt) + n:
            raise ValueError(f"routed_experts of sample {i}: {rec.size} expert ids are not whole tokens of {width} "
                             f"(MoE layers x k) for at most its {len(prompt) + n} prompt and response tokens")
        out.append(rec.reshape(-1, width))
    return out


def _routing_column(table: pa.Table, meta: dict[str, str]) -> list[np.ndarray | None] | None:
    if ROUTED_EXPERTS not in table.column_names or ROUTING_WIDTH not in meta:
        return None
    width = int(meta[ROUTING_WIDTH])
    arr = table.column(ROUTED_EXPERTS).combine_chunks()  # flat numpy slices, not Python lists: records are large
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False).astype(np.int16, copy=False)
    missing = arr.is_null().to_numpy(zero_copy_only=False)
    return [None if missing[i] else values[offsets[i]:offsets[i + 1]].reshape(-1, width)
            for i in range(len(arr))]


def _last_version(s: SampleLike) -> int:
    """A sample's newest weight version: its own, else its first one's, else -1 (not known)."""
    last = getattr(s, "last_weight_version", None)
    if last is None:
        last = s.weight_version
    return -1 if last is None else last


def _list_column(table: pa.Table, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (lengths [N], flat values), without going through Python lists."""
    arr = table.column(name).combine_chunks()
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return np.diff(offsets), values

def pack_samples(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    response_logprobs: Sequence[Sequence[float]],
    advantages: torch.Tensor,
    pad_id: int,
    response_masks: Sequence[Sequence[int]] | None = None,
) -> TrainBatch:
    """Pack N samples into input_ids/attention_mask/loss_mask/old_logprobs [N, L] and advantages.

    advantages are [N] (one per sample) or [N, L] (per token, aligned with input_ids like the logprobs: what
    token-level estimators produce from a batch packed the same way).
    """
    n = len(prompt_ids)
    p_len = np.fromiter(map(len, prompt_ids), dtype=np.int64, count=n)
    r_len = np.fromiter(map(len, response_ids), dtype=np.int64, count=n)
    _check_lengths(response_logprobs, r_len, "response_logprobs")
    if response_masks is not None:
        _check_lengths(response_masks, r_len, "response_masks")
    total = p_len + r_len
    width = int(total.max())
    if advantages.shape not in ((n,), (n, width)):
        raise ValueError(f"pack_samples: advantages of shape {tuple(advantages.shape)}; expected ({n},) or "
                         f"({n}, {width})")
    # one scatter per tensor instead of a few small tensor writes per sample: (row, column) of every token,
    # prompt then response, row after row; the response positions in that order match the flat responses
    rows = np.repeat(np.arange(n), total)
    cols = np.arange(int(total.sum())) - np.repeat(np.cumsum(total) - total, total)
    in_response = cols >= np.repeat(p_len, total)
    tokens = _flat((x for p, r in zip(prompt_ids, response_ids, strict=True) for x in (p, r)), np.int64)
    resp_rows, resp_cols = torch.from_numpy(rows[in_response]), torch.from_numpy(cols[in_response])
    rows, cols = torch.from_numpy(rows), torch.from_numpy(cols)

    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    input_ids[rows, cols] = torch.from_numpy(tokens)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    attention_mask[rows, cols] = 1
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    loss_mask[resp_rows, resp_cols] = 1.0 if response_masks is None else torch.from_numpy(
        _flat(response_masks, np.float32))
    old_logprobs = torch.zeros((n, width), dtype=torch.float32)
    old_logprobs[resp_rows, resp_cols] = torch.from_numpy(_flat(response_logprobs, np.float32))
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "advantages": advantages.float(),
    }


def _flat(seqs: Iterable[Sequence], dtype) -> np.ndarray:
    parts = [np.asarray(x, dtype=dtype) for x in seqs]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _check_lengths(seqs: Sequence[Sequence], expected: np.ndarray, name: str) -> None:
    if len(seqs) != len(expected):
        raise ValueError(f"pack_samples: {name} has {len(seqs)} rows for {len(expected)} samples")
    for i, (x, n) in enumerate(zip(seqs, expected.tolist(), strict=True)):
        if len(x) != n:
            raise ValueError(f"pack_samples: {name}[{i}] has {len(x)} values for {n} response tokens")


def select(batch: TrainBatch, idx: slice | torch.Tensor) -> TrainBatch:
    return {k: v[idx] for k, v in batch.items()}


def batch_size(batch: TrainBatch) -> int:
    return int(batch["input_ids"].shape[0])


def shard_for_workers(batch: TrainBatch, num_workers: int, mini_batches: int) -> list[TrainBatch]:
    """Split a global batch so that worker w's shard holds its part of every mini-batch, in order.

    With this layout, W workers that each split their shard into `mini_batches` chunks take the same
    optimizer steps on the same samples as one worker on the whole batch. Within a mini-batch every worker
    gets the same number of samples and about the same number of tokens (longest first, each to the
    worker with the fewest tokens so far), so no worker waits long for the others at the gradient
    reduction.
    """
    n = batch_size(batch)
    mb = n // mini_batches
    per = mb // num_workers
    lengths = batch["attention_mask"].sum(-1).tolist()
    parts: list[list[int]] = [[] for _ in range(num_workers)]
    for m in range(mini_batches):
        rows = sorted(range(m * mb, m * mb + per * num_workers), key=lambda i: (-lengths[i], i))
        shards: list[list[int]] = [[] for _ in range(num_workers)]
        tokens = [0] * num_workers
        for i in rows:
            w = min((w for w in range(num_workers) if len(shards[w]) < per), key=lambda w: (tokens[w], w))
            shards[w].append(i)
            tokens[w] += lengths[i]
        for w in range(num_workers):
            parts[w] += sorted(shards[w])
    return [select(batch, torch.tensor(p, dtype=torch.long)) for p in parts]
