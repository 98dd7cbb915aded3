"""RolloutBatch: built from what rollout functions return, persisted and replayed through one Arrow schema,
packed once into the train batch."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from rlflow.engines.core.batch import ROLLOUT_SCHEMA, RolloutBatch, pack_samples
from rlflow.engines.rollout.functions import PromptSample, Sample
from rlflow.engines.session.sft import ROUND_SCHEMA, read_round, round_table
from rlflow.engines.store.run_store import RunStore


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
    return RolloutBatch.from_samples(prompts, groups)


def test_from_samples() -> None:
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
                 "weight_version", "carried", "baseline"):
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
    assert b.output_logprobs.dtype == np.float32 and b.output_logprobs.tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0,
                                                                                     -6.0, -7.0]
    assert b.group.tolist() == [0, 0, 1, 1] and b.label == [1, 1, 2, 2]
    assert b.loss_mask.tolist() == [1.0] * 7 and b.has_logprobs.all() and not b.carried.any() and not b.baseline.any()
    assert np.isnan(b.fn_reward).all() and b.text == [None] * 4 and b.reward is None and b.response is None


def test_to_train_batch_is_pack_samples_of_the_same_samples() -> None:
    b = make_batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    got = b.to_train_batch(0, adv)
    want = pack_samples(b.prompt_ids, [[5, 6, 2], [7], [8, 9], [4, 4, 4, 4]],
                        [[-0.5, -0.25, -1.0], [-2.0], [-0.1, 0.0], [0.0] * 4], adv, 0,
                        [[1, 1, 1], [1], [1, 0], [1, 1, 1, 1]])
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k


def test_group_ids_views_and_select() -> None:
    b = make_batch()
    assert b.num_samples == 4 and b.offsets.tolist() == [0, 3, 4, 6, 10]
    assert b.group_starts().tolist() == [0, 2] and b.group_size() == 2
    assert b.responses(2).tolist() == [8, 9] and b.responses(2, "loss_mask").tolist() == [1.0, 0.0]
    sub = b.select([3, 0])
    assert sub.group.tolist() == [1, 0] and sub.prompt == ["p1", "p0"] and sub.lengths.tolist() == [4, 3]
    assert sub.output_ids.tolist() == [4, 4, 4, 4, 5, 6, 2] and sub.has_logprobs.tolist() == [False, True]
    assert sub.output_logprobs.tolist() == [0.0] * 4 + [-0.5, -0.25, -1.0]
    masked = b.select(np.array([False, True, True, False]))
    assert masked.group.tolist() == [0, 1] and masked.split("output_ids")[1].tolist() == [8, 9]
    assert masked.text == [None, "given text"] and masked.carried.tolist() == [False, True]
    assert len(b.select([])) == 0 and b.select([]).output_ids.size == 0
    with pytest.raises(ValueError, match="not consecutive groups of one size"):
        sub.group_size()
    with pytest.raises(ValueError, match="not consecutive groups of one size"):
        b.select([0, 1, 2]).group_size()


def test_to_arrow_metadata_and_chunked_tables() -> None:
    b = make_batch()
    b.metadata = {"rlflow.cursor": "{}"}
    table = b.to_arrow({"extra": "1"})
    assert table.schema.metadata == {b"rlflow.cursor": b"{}", b"extra": b"1"}
    assert b.metadata == {"rlflow.cursor": "{}"}  # the batch itself is unchanged
    # a table read back from parquet can arrive in several chunks, sliced
    two = pa.concat_tables([table.slice(0, 1), table.slice(1)])
    assert two.column("output_ids").num_chunks == 2
    back = RolloutBatch.from_arrow(two)
    assert back.output_ids.tolist() == b.output_ids.tolist() and back.lengths.tolist() == [3, 1, 2, 4]
    assert RolloutBatch.from_arrow(table.slice(2)).split("output_ids")[0].tolist() == [8, 9]
    empty = RolloutBatch.from_arrow(table.slice(0, 0))
    assert len(empty) == 0 and empty.output_ids.dtype == np.int64


def test_a_rejection_sampling_round_is_a_scored_rollout_table_and_its_accepted_mask() -> None:
    b = make_batch()
    with pytest.raises(ValueError, match="no rewards yet"):
        round_table(b, [True] * 4)
    scored = b.with_rewards(["a", "b", "c", "d"], [1.0, 0.0, 1.0, 0.0])
    table = round_table(scored, [True, False, True, False])
    assert table.schema.remove_metadata() == ROUND_SCHEMA
    assert ROUND_SCHEMA.remove(ROUND_SCHEMA.get_field_index("accepted")) == ROLLOUT_SCHEMA
    back, accepted = read_round(table, 2)
    assert_same(back, scored)
    assert accepted.tolist() == [True, False, True, False]


def test_parquet_round_trip_through_the_run_store(tmp_path) -> None:
    store = RunStore(str(tmp_path / "store"), "run")
    b = make_batch().with_rewards(["a", "b", "c", "d"], [1.0, 0.0, 0.5, 0.25])
    b.metadata = {"rlflow.carry": "[]"}
    store.save_rollout(3, b.to_arrow())
    assert_same(RolloutBatch.from_arrow(store.load_rollout(3)), b)
