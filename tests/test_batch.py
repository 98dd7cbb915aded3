"""RolloutBatch: built from what rollout functions return, persisted and replayed through one Arrow schema,
packed once into the train batch."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import torch

from rlflow.engines.core.batch import ROLLOUT_SCHEMA, RolloutBatch, pack_samples
from rlflow.engines.rollout.functions import PromptSample, Sample, batch_from_groups


def make_batch() -> RolloutBatch:
    prompts = [PromptSample(index=i, prompt=f"p{i}", label={"answer": [i, i + 1]}, prompt_ids=[1, 10 + i], n=2, seed=i)
               for i in range(2)]
    groups = [
        [Sample([5, 6, 2], logprobs=[-0.5, -0.25, -1.0], weight_version=3),
         Sample([7], logprobs=[-2.0], finish_reason="length", weight_version=3, reward=0.5)],
        [Sample([8, 9], loss_mask=[1, 0], logprobs=[-0.1, 0.0], response="given text", weight_version=2,
                metadata={"carried": True}),
         Sample([4, 4, 4, 4], prompt_ids=[1, 11, 3])],  # no logprobs: the trainer computes them
    ]
    return batch_from_groups(prompts, groups)


def test_from_groups() -> None:
    b = make_batch()
    assert len(b) == 4 and b.group.tolist() == [0, 0, 1, 1]
    assert b.prompt == ["p0", "p0", "p1", "p1"] and b.label[2] == {"answer": [1, 2]}
    assert b.prompt_ids == [[1, 10], [1, 10], [1, 11], [1, 11, 3]]
    assert [x.tolist() for x in b.split("output_ids")] == [[5, 6, 2], [7], [8, 9], [4, 4, 4, 4]]
    assert b.split("loss_mask")[2].tolist() == [1.0, 0.0] and b.split("loss_mask")[3].tolist() == [1.0] * 4
    assert b.has_logprobs.tolist() == [True, True, True, False]
    assert b.weight_version.tolist() == [3, 3, 2, -1] and b.carried.tolist() == [False, False, True, False]
    assert b.stopped.tolist() == [True, False, True, True]
    assert np.isnan(b.fn_reward[0]) and b.fn_reward[1] == 0.5 and b.text == [None, None, "given text", None]
    assert b.metrics() == {"rollout/response_len_mean": 2.5, "rollout/tokens": 10.0, "rollout/truncated": 0.25,
                           "rollout/weight_version": -1.0}


def assert_same(a: RolloutBatch, b: RolloutBatch) -> None:
    for name in ("prompt", "label", "prompt_ids", "text", "response", "metadata"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("group", "output_ids", "output_logprobs", "loss_mask", "lengths", "has_logprobs", "stopped",
                 "weight_version", "carried"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert np.array_equal(a.fn_reward, b.fn_reward, equal_nan=True)
    assert (a.reward is None) == (b.reward is None)
    if a.reward is not None:
        assert np.array_equal(a.reward, b.reward)


def test_arrow_round_trip_before_and_after_scoring() -> None:
    b = make_batch()
    b.metadata = {"rlflow.cursor": json.dumps({"epoch": 1})}
    table = b.to_arrow()
    assert table.schema.remove_metadata() == ROLLOUT_SCHEMA
    assert table.column("reward").null_count == 4
    assert_same(RolloutBatch.from_arrow(table), b)
    scored = b.with_rewards(["a", "b", "c", "d"], [1.0, 0.0, 0.5, 0.25])
    assert_same(RolloutBatch.from_arrow(scored.to_arrow()), scored)


def test_tables_written_before_the_later_columns_read_with_their_defaults() -> None:
    """The layout of the first stored batches: no group, loss_mask, has_logprobs, fn_reward, text, carried,
    response or reward columns."""
    old = pa.table({"prompt": ["p", "p", "q", "q"], "label": ["1", "1", "2", "2"],
                    "prompt_ids": [[1], [1], [2], [2]], "output_ids": [[3, 4], [5], [6], [7, 8, 9]],
                    "output_logprobs": [[-1.0, -2.0], [-3.0], [-4.0], [-5.0, -6.0, -7.0]],
                    "stopped": [True, False, True, True], "weight_version": [4, 4, 4, 4]})
    b = RolloutBatch.from_arrow(old, samples_per_prompt=2)
    assert b.group.tolist() == [0, 0, 1, 1] and b.label == [1, 1, 2, 2]
    assert b.loss_mask.tolist() == [1.0] * 7 and b.has_logprobs.all() and not b.carried.any()
    assert np.isnan(b.fn_reward).all() and b.text == [None] * 4 and b.reward is None and b.response is None


def test_to_train_batch_is_pack_samples_of_the_same_samples() -> None:
    b = make_batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    got = b.to_train_batch(adv, pad_id=0)
    want = pack_samples(b.prompt_ids, [[5, 6, 2], [7], [8, 9], [4, 4, 4, 4]],
                        [[-0.5, -0.25, -1.0], [-2.0], [-0.1, 0.0], [0.0] * 4], adv, 0,
                        [[1, 1, 1], [1], [1, 0], [1, 1, 1, 1]])
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k
