"""Built-in task generation, prompt file loading and the resumable prompt cursor."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlflow.engines.core.config import BuiltinTaskConfig
from rlflow.engines.data.builtin_tasks import make_examples, write_task_files
from rlflow.engines.data.prompts import DataError, PromptCursor, load_prompts

VOCAB = set("0123456789+=SR")


@pytest.mark.parametrize("task", ["sort", "reverse", "add"])
def test_make_examples_deterministic_and_correct(task: str) -> None:
    a = make_examples(task, 4, 200, seed=7)
    assert a == make_examples(task, 4, 200, seed=7)
    assert a != make_examples(task, 4, 200, seed=8)
    for ex in a:
        assert set(ex["prompt"] + ex["label"]) <= VOCAB
        body = ex["prompt"][:-1]
        assert ex["prompt"].endswith("=")
        if task == "sort":
            assert body[0] == "S"
            assert len(body) == 5
            assert ex["label"] == "".join(sorted(body[1:]))
        elif task == "reverse":
            assert body[0] == "R"
            assert len(body) == 5
            assert ex["label"] == body[1:][::-1]
        else:
            x, y = body.split("+")
            assert len(x) <= 4
            assert len(y) <= 4
            assert ex["label"] == str(int(x) + int(y))


def test_unknown_task() -> None:
    with pytest.raises(ValueError, match="unknown built-in task"):
        make_examples("div", 4, 1, 0)


def test_mul_task_and_its_tool_transcripts_for_sft(tmp_path: Path) -> None:
    """mul: two numbers of exactly num_digits digits; its SFT pairs are the two model turns of the python tool's
    transcript (engines/env/python_tool.py), each with the conversation before it as its prompt."""
    for ex in make_examples("mul", 2, 200, 0):
        a, b = ex["prompt"].removesuffix("=").split("*")
        assert len(a) == len(b) == 2 and ex["label"] == str(int(a) * int(b))
    cfg = BuiltinTaskConfig(task="mul", num_digits=2, num_train=50, num_eval=10, seed=3)
    write_task_files(cfg, str(tmp_path / "t.jsonl"), None, sft_path=str(tmp_path / "sft.jsonl"))
    train = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert len(pairs) == 2 * len(train)
    for row, call, answer in zip(train, pairs[::2], pairs[1::2], strict=True):
        assert call == {"prompt": row["prompt"], "response": row["prompt"]}
        assert answer == {"prompt": row["prompt"] * 2 + row["label"] + "R", "response": row["label"]}


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_write_task_files_disjoint_and_round_trip(tmp_path: Path, ext: str) -> None:
    cfg = BuiltinTaskConfig(task="sort", num_digits=3, num_train=2000, num_eval=100, seed=3)
    train_path, eval_path = tmp_path / "a" / f"train.{ext}", tmp_path / "b" / f"eval.{ext}"
    write_task_files(cfg, str(train_path), str(eval_path))
    train, held_out = load_prompts(str(train_path)), load_prompts(str(eval_path))
    assert len(train) == 2000
    assert len(held_out) == 100
    eval_prompts = {r["prompt"] for r in held_out}
    assert len(eval_prompts) == 100
    assert not eval_prompts & {r["prompt"] for r in train}
    assert all(r["label"] == "".join(sorted(r["prompt"][1:-1])) and r["meta"] == {} for r in train)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", f"eval.{ext}", f"train.{ext}"]  # no temp files

    again = tmp_path / "again"
    write_task_files(cfg, str(again / f"train.{ext}"), None)
    assert load_prompts(str(again / f"train.{ext}")) == train
    assert not (again / f"eval.{ext}").exists()


def test_write_task_files_refuses_too_small_space(tmp_path: Path) -> None:
    cfg = BuiltinTaskConfig(task="reverse", num_digits=1, num_train=10, num_eval=8)
    with pytest.raises(ValueError, match="num_eval=8"):
        write_task_files(cfg, str(tmp_path / "t.jsonl"), str(tmp_path / "e.jsonl"))
    assert not list(tmp_path.iterdir())


def test_load_jsonl_keeps_extra_columns_as_meta(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"q": "S21=", "a": "12", "src": "x"}\n\n{"q": "S31=", "a": "13"}\n')
    rows = load_prompts(str(p), prompt_key="q", label_key="a")
    assert rows == [
        {"prompt": "S21=", "label": "12", "meta": {"src": "x"}},
        {"prompt": "S31=", "label": "13", "meta": {}},
    ]


def test_load_parquet(tmp_path: Path) -> None:
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+2=", "3+4="], "label": ["3", "7"], "id": [1, 2]}), str(p))
    assert load_prompts(str(p)) == [
        {"prompt": "1+2=", "label": "3", "meta": {"id": 1}},
        {"prompt": "3+4=", "label": "7", "meta": {"id": 2}},
    ]


def _jsonl(tmp_path: Path, lines: list[str]) -> str:
    p = tmp_path / "d.jsonl"
    p.write_text("".join(line + "\n" for line in lines))
    return str(p)


def test_load_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=f"data file not found: {missing}"):
        load_prompts(missing)

    csv = tmp_path / "d.csv"
    csv.write_text("prompt,label\n")
    with pytest.raises(DataError, match=r"d\.csv: unknown extension '\.csv'"):
        load_prompts(str(csv))

    ok = json.dumps({"prompt": "S1=", "label": "1"})
    with pytest.raises(DataError, match=r"d\.jsonl: bad JSON on line 2"):
        load_prompts(_jsonl(tmp_path, [ok, "{not json", ok]))

    with pytest.raises(
        DataError, match=r'd\.jsonl: missing key "label" in row 2 \(line 3\); keys present: "prompt", "x"'
    ):
        load_prompts(_jsonl(tmp_path, [ok, "", json.dumps({"prompt": "S1=", "x": 1})]))

    with pytest.raises(DataError, match=r'missing key "question" in row 1.*"prompt", "label"'):
        load_prompts(_jsonl(tmp_path, [ok]), prompt_key="question")

    with pytest.raises(DataError, match=r"d\.jsonl: row 1 \(line 1\): expected a JSON object, got list"):
        load_prompts(_jsonl(tmp_path, ["[1, 2]"]))

    with pytest.raises(DataError, match=r'row 1 \(line 1\): "prompt" must be a string or a list of chat messages, '
                       "got int"):
        load_prompts(_jsonl(tmp_path, [json.dumps({"prompt": 5, "label": "1"})]))

    with pytest.raises(DataError, match=r"d\.jsonl: data file is empty"):
        load_prompts(_jsonl(tmp_path, ["", "  "]))


def test_non_utf8_data_names_the_file_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    first = json.dumps({"prompt": "a", "label": "1"}).encode() + b"\n"
    path.write_bytes(first + '{"prompt": "café", "label": "2"}\n'.encode("latin-1"))
    offset = len(first) + len(b'{"prompt": "caf')
    with pytest.raises(DataError, match=rf"latin1\.jsonl: line 2 is not UTF-8: byte 0xe9 at offset {offset} of"):
        load_prompts(str(path))


def test_load_parquet_errors(tmp_path: Path) -> None:
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["S1="], "answer": ["1"]}), str(p))
    with pytest.raises(DataError, match=r'd\.parquet: missing key "label" in row 1; keys present: "prompt", "answer"'):
        load_prompts(str(p))

    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "label": pa.array([], pa.string())}), str(p))
    with pytest.raises(DataError, match=r"d\.parquet: data file is empty"):
        load_prompts(str(p))

    p.write_text("not parquet")
    with pytest.raises(DataError, match=r"d\.parquet: not a readable parquet file"):
        load_prompts(str(p))


@pytest.mark.parametrize("shuffle", [True, False])
def test_cursor_resume_gives_identical_batches(shuffle: bool) -> None:
    a = PromptCursor(num_prompts=23, batch_size=5, seed=11, shuffle=shuffle)
    for _ in range(7):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b = PromptCursor(num_prompts=23, batch_size=5, seed=0, shuffle=shuffle)
    b.load_state_dict(state)
    assert [a.next_batch() for _ in range(5)] == [b.next_batch() for _ in range(5)]


def test_cursor_epochs_are_permutations_and_wrap_mid_batch() -> None:
    c = PromptCursor(num_prompts=10, batch_size=4, seed=1)
    flat = [i for _ in range(5) for i in c.next_batch()]  # 20 indices = exactly two epochs
    assert sorted(flat[:10]) == list(range(10))
    assert sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # each epoch has its own permutation
    assert c.state_dict()["epoch"] == 2
    assert c.state_dict()["offset"] == 0

    big = PromptCursor(num_prompts=3, batch_size=7, seed=0, shuffle=False)
    assert big.next_batch() == [0, 1, 2, 0, 1, 2, 0]
    assert big.state_dict()["epoch"] == 2
    assert big.state_dict()["offset"] == 1


def test_cursor_same_seed_same_walk_and_refuses_other_size() -> None:
    a, b = PromptCursor(50, 8, seed=4), PromptCursor(50, 8, seed=4)
    assert [a.next_batch() for _ in range(9)] == [b.next_batch() for _ in range(9)]
    assert PromptCursor(50, 8, seed=5).next_batch() != PromptCursor(50, 8, seed=4).next_batch()
    with pytest.raises(ValueError, match="saved over 50 prompts"):
        PromptCursor(49, 8, seed=4).load_state_dict(a.state_dict())


def _verl_rows() -> list[dict]:
    """Rows as verl's data preprocessing writes them (e.g. its gsm8k.py)."""
    return [
        {"data_source": "openai/gsm8k", "ability": "math",
         "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1=?"}],
         "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
         "extra_info": {"split": "train", "index": i}}
        for i in range(3)
    ]


def test_verl_parquet_rows(tmp_path: Path) -> None:
    p = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), str(p))
    rows = load_prompts(str(p))
    assert len(rows) == 3 and rows[2]["label"] == "3" and rows[2]["prompt"] == "2+1=?"
    assert rows[0]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "0+1=?"}]
    assert rows[1]["meta"] == {"data_source": "openai/gsm8k", "ability": "math", "extra_info": {"split": "train",
                               "index": 1}, "reward_model": {"style": "rule", "ground_truth": "2"}}
    # a dotted label_key reaches into a nested column
    assert load_prompts(str(p), label_key="extra_info.index")[2]["label"] == 2


def test_trl_rows(tmp_path: Path) -> None:
    """TRL's prompt-completion (text or conversational) and conversational `messages` rows."""
    text = _jsonl(tmp_path, [json.dumps({"prompt": "S21=", "completion": "12", "id": 7})])
    assert list(load_prompts(text)) == [{"prompt": "S21=", "label": "12", "meta": {"id": 7}}]
    conv = tmp_path / "conv.jsonl"
    conv.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}],
                                "completion": [{"role": "assistant", "content": "hello"}]}) + "\n")
    assert load_prompts(str(conv))[0] == {"prompt": "hi", "label": "hello", "meta": {},
                                          "messages": [{"role": "user", "content": "hi"}]}
    msgs = tmp_path / "msgs.parquet"
    turns = [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2"},
             {"role": "assistant", "content": "4"}]
    pq.write_table(pa.Table.from_pylist([{"messages": turns}]), str(msgs))
    row = load_prompts(str(msgs))[0]
    assert row["label"] == "4" and row["messages"] == [{"role": "system", "content": "s"},
                                                       {"role": "user", "content": "2+2"}]
    from rlflow.engines.data.prompts import load_pairs

    assert load_pairs(str(msgs))[0]["response"] == "4"  # SFT reads the same rows

    bad = _jsonl(tmp_path, [json.dumps({"prompt": [{"role": "user"}], "label": "1"})])
    with pytest.raises(DataError, match=r'row 1 \(line 1\): "prompt" item 0 must be a chat message'):
        load_prompts(bad)


def test_chat_prompts_render_through_the_template(tmp_path: Path, tiny_model_dir: str) -> None:
    from rlflow.engines.models.hf import encode_prompt, load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    p = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), str(p))
    row = load_prompts(str(p))[0]
    ids = encode_prompt(tok, row["messages"])
    assert ids == tok(tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
    assert ids != encode_prompt(tok, row["prompt"])  # the system message is in, the template applied


def test_prompt_file_on_object_storage(s3_bucket, tmp_path: Path) -> None:
    import s3fs

    from rlflow.engines.core.config import StorageConfig

    root, endpoint = s3_bucket
    url = f"{root}/data/train.parquet"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    with fs.open(url, "wb") as f:
        pq.write_table(pa.Table.from_pylist(_verl_rows()), f)
    options = StorageConfig(uri=str(tmp_path), endpoint_url=endpoint).fsspec_options(url)  # a local store, s3 data
    rows = load_prompts(url, storage_options=options)
    assert [r["label"] for r in rows] == ["1", "2", "3"]
    with pytest.raises(DataError, match=f"data file not found: {root}/data/missing.parquet"):
        load_prompts(f"{root}/data/missing.parquet", storage_options=options)


def test_rows_are_read_when_taken(tmp_path: Path) -> None:
    """The file stays a memory-mapped table: rows are Python objects only once taken (large files)."""
    p = tmp_path / "big.parquet"
    pq.write_table(pa.table({"prompt": [f"S{i}=" for i in range(20_000)], "label": ["x"] * 20_000}), str(p))
    rows = load_prompts(str(p))
    assert len(rows) == 20_000 and rows[19_999]["prompt"] == "S19999=" and not isinstance(rows, list)
    assert [r["prompt"] for r in rows[5:7]] == ["S5=", "S6="]


def test_a_prompt_longer_than_the_context_names_its_data_row(recipe, tmp_path: Path) -> None:
    """model.max_seq_len 16 (small_recipe): row 6's 31-character prompt (one token a character) does not fit."""
    from rlflow.engines.session.rl import RLSession
    from rlflow.engines.session.workers import prepare_model

    train = tmp_path / "train.jsonl"
    rows = [{"prompt": "S" + "1" * (30 if i == 6 else 3) + "=", "label": "111"} for i in range(1, 9)]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = recipe(data={"train_path": str(train), "eval_path": None, "generate": None, "shuffle": False},
                 cluster={"use_ray": False})
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    try:
        with pytest.raises(DataError, match=rf"^{train}: row 6: the prompt is 33 tokens; a rollout sequence holds "
                                            r"16 \(model\.max_seq_len\)"):
            session.rollout(0)
    finally:
        session.shutdown()
