"""SFT and rejection sampling through their Prefect flows (workers in the flow process), with the run store
and MLflow, on the 3-digit sort task with a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from rlflow.engines.core.batch import pack_samples
from rlflow.engines.core.config import config_from_dict
from rlflow.engines.data.prompts import load_pairs
from rlflow.engines.models.hf import build_char_tokenizer, encode_prompt
from rlflow.engines.session.sft import SFTSession, accept_samples, tokenize_pairs
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.store.run_store import RunStore
from rlflow.flows.cli import main as cli_main
from rlflow.flows.rejection_sampling import rejection_sampling
from rlflow.flows.sft import sft
from tests.conftest import small_recipe, step_metrics

SORT3 = {"task": "sort", "num_digits": 3, "num_train": 2000, "num_eval": 32}


def _cfg(tmp_path, **sections):
    raw = small_recipe(tmp_path, cluster={"use_ray": False}, **sections)
    raw["sft"] = {"train_path": str(tmp_path / "data/sft.jsonl"), "generate": {**SORT3, "num_train": 256},
                  "batch_size": 32, "lr": 3e-3, **raw.get("sft", {})}
    return config_from_dict(raw)


def _run(flow_fn, cfg) -> dict[int, dict]:
    return step_metrics(lambda: flow_fn(cfg))[0]


def test_accept_samples_by_hand():
    # two prompts x 3 samples; threshold 0.5, at most 1 (then 2) distinct accepted responses per prompt
    rewards = [1.0, 1.0, 0.4, 0.5, 1.0, 0.9]
    stopped = [True, True, True, False, True, True]
    ids = [[1, 2], [1, 2], [3], [4], [5], [6]]
    assert accept_samples(rewards, stopped, ids, 3, 0.5, 1) == [True, False, False, False, True, False]
    # sample 1 repeats sample 0; sample 3 passed the threshold but was truncated (not stopped)
    assert accept_samples(rewards, stopped, ids, 3, 0.5, 2) == [True, False, False, False, True, True]
    assert accept_samples(rewards, stopped, ids, 3, 1.5, 2) == [False] * 6


def test_sft_examples_mask_the_prompt_and_end_with_eos():
    tok = build_char_tokenizer()  # <pad>=0 <bos>=1 <eos>=2 <unk>=3, then "0123456789+=SR" from 4
    [ex] = tokenize_pairs(tok, [{"prompt": "S31=", "response": "13"}], chat_template=False, add_eos=True)
    assert ex.prompt_ids == [1, 16, 7, 5, 15] and ex.response_ids == [5, 7, 2]
    batch = pack_samples([ex.prompt_ids, [1, 4]], [ex.response_ids, [2]], [[0.0] * 3, [0.0]], torch.zeros(2), 0)
    # the loss covers the response and its EOS, never the prompt or the padding
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 0, 0, 0, 0, 0]]
    # chat template: the prompt is a user message ending with the generation prompt; no second BOS
    tok.chat_template = "{% for m in messages %}{{ bos_token }}S{{ m['content'] }}{% endfor %}" \
                        "{% if add_generation_prompt %}={% endif %}"
    [chat] = tokenize_pairs(tok, [{"prompt": "31", "response": "13"}], chat_template=True, add_eos=False)
    assert chat.prompt_ids == ex.prompt_ids and chat.response_ids == [5, 7]
    assert encode_prompt(tok, "31", True) == ex.prompt_ids
    bare = build_char_tokenizer()
    bare.chat_template = None  # the demo tokenizer has one (engines/models/hf.py); a tokenizer without it is refused
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(bare, "31", True)


def test_data_make_writes_sft_pairs(tmp_path):
    sft_path = tmp_path / "sft.jsonl"
    assert cli_main(["data", "make", "--task", "reverse", "--num-digits", "3", "--num-train", "20", "--num-eval",
                     "5", "--sft", str(sft_path)]) == 0
    rows = load_pairs(str(sft_path))
    assert len(rows) == 20 and all(r["response"] == r["prompt"][1:4][::-1] for r in rows)
    assert cli_main(["data", "make", "--task", "sort", "--eval", str(tmp_path / "e.jsonl")]) == 2


def test_sft_flow_learns_tracks_and_resumes(tmp_path):
    cfg = _cfg(tmp_path, sft={"steps": 12}, checkpoint={"every": 6}, eval={"every": 6, "max_prompts": 16})
    seen = _run(sft, cfg)
    assert sorted(seen) == list(range(12))
    losses = [seen[s]["train/loss"] for s in range(12)]
    assert sum(losses[-3:]) < 0.85 * sum(losses[:3]), losses  # the NLL of the answers falls (2.9 -> 2.2)
    assert "eval/reward_mean" in seen[5] and "eval/reward_mean" in seen[11]
    assert all(seen[s]["train/response_tokens"] == 32 * 4 for s in range(12))  # 3 digits + EOS, prompt excluded
    rows = [json.loads(line) for line in Path(cfg.sft.train_path).read_text().splitlines()]
    assert len(rows) == 256 and rows[0]["response"] == "".join(sorted(rows[0]["prompt"][1:4]))

    store = RunStore(cfg.storage, cfg.name)
    assert store.committed_steps() == [5, 11]
    meta = store.read_json("checkpoints", 11, "meta.json")
    assert meta["sft_cursor"]["offset"] == (12 * 32) % 256 and meta["sft_cursor"]["epoch"] == 1

    resumed = _run(sft, cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"steps": 14})}))
    assert sorted(resumed) == [12, 13]  # continued from the committed step 11
    client = MlflowClient(cfg.tracking.uri)
    runs = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # one MLflow run, continued
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")] == list(range(14))
    mlflow.set_tracking_uri(None)


def test_sft_needs_a_file(tmp_path, tiny_model_dir):
    cfg = config_from_dict(small_recipe(tmp_path, cluster={"use_ray": False}))
    prepare_data(cfg)
    with pytest.raises(ValueError, match="sft.train_path"):
        SFTSession.create(cfg, tiny_model_dir)


def _warm_model(tmp_path) -> str:
    """A model that has seen 15 SFT steps (no Prefect): a random one almost never ends an answer on its own."""
    cfg = _cfg(tmp_path, sft={"lr": 1e-2, "steps": 15})
    prepare_data(cfg)
    session = SFTSession.create(cfg, prepare_model(cfg, tmp_path / "base"))
    for step in range(15):
        session.train(step)
    session.save(tmp_path / "warm", 14)
    session.shutdown()
    return str(tmp_path / "warm" / "model")


def test_rejection_sampling_keeps_verified_samples_and_learns_from_them(tmp_path):
    rs = {"rounds": 2, "threshold": 0.6, "steps_per_round": 6, "max_per_prompt": 2}
    cfg = _cfg(tmp_path, model={"path": _warm_model(tmp_path)}, sft={"rejection": rs, "batch_size": 16},
               rollout={"prompts_per_step": 32, "samples_per_prompt": 8, "max_new_tokens": 4})
    seen = _run(rejection_sampling, cfg)
    assert sorted(seen) == list(range(12))
    store = RunStore(cfg.storage, cfg.name)
    pools = []
    for rnd, last in ((0, 5), (1, 11)):
        table = store.load_round(rnd).to_pylist()
        assert len(table) == 32 * 8
        passed = [r["reward"] >= 0.6 and r["stopped"] for r in table]
        kept = [r for r in table if r["accepted"]]
        m = seen[last]
        assert m["rs/accept_frac"] == pytest.approx(sum(passed) / len(table))
        assert m["rs/kept"] == len(kept) > 0
        assert all(r["reward"] >= 0.6 and r["stopped"] for r in kept)
        for g in range(32):  # at most max_per_prompt distinct responses of a prompt
            group = [tuple(r["output_ids"]) for r in table[g * 8 : (g + 1) * 8] if r["accepted"]]
            assert len(group) == len(set(group)) <= 2
        pools.append(m["rs/pool"])
        losses = [seen[s]["train/loss"] for s in range(last - 5, last + 1)]
        assert losses[-1] < losses[0], losses  # SFT on the kept samples lowers their NLL
    assert pools[1] > pools[0]  # round 1 trains on both rounds' samples (accumulate)
    assert seen[11]["rs/accept_frac"] > seen[5]["rs/accept_frac"]  # trained on its own verified samples
    assert store.committed_steps()[-1] == 11 and "eval/reward_mean" in seen[11]

    # one more round: the run resumes after round 1 and trains on rounds 0 and 1 from the store, and round 2
    more = cfg.sft.rejection.model_copy(update={"rounds": 3})
    resumed = _run(rejection_sampling, cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"rejection": more})}))
    assert sorted(resumed) == list(range(12, 18))
    assert resumed[17]["rs/pool"] >= pools[1] and store.load_round(2).num_rows == 32 * 8
    mlflow.set_tracking_uri(None)
