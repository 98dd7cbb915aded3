"""The GSM8K verifier (math-verify underneath) on real GSM8K-style strings, and the GSM8K file converter."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("math_verify")  # the `math` extra

from rlflow.engines.data.math_reward import convert_gsm8k, final_answer_text, gold_answer, gsm8k_reward, is_correct
from rlflow.engines.session.preflight import find_problems

# a GSM8K training row, as the dataset stores it
NATALIA_Q = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?")
NATALIA_A = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
             "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize("response, label, ok", [
    (NATALIA_A, "72", True),                                           # the reference solution itself
    (NATALIA_A, NATALIA_A, True),                                      # label given as the full GSM8K answer
    ("In May she sold 24, so 48 + 24 = 72.\n#### 72 clips", "72", True),  # unit after the number
    ("#### 72 apples\nFirst she had 5", "72", True),                   # only the line after #### counts
    ("18 #### 20", "18", False),                                       # the number after #### is the answer
    ("She spends 9 * 2 = $18 a day. So the answer is \\boxed{18}.", "18", True),
    ("The total cost is $1,234.", "1234", True),                       # thousands separator in the response
    ("#### 1,000", "1,000", True),                                     # ... and in the label
    ("The answer is 3/4", "0.75", True),                               # fraction vs decimal
    ("Half of it: 0.5", "1/2", True),
    ("The answer is $18.00.", "18", True),
    ("The temperature drops to -5.", "-5", True),
    ("I think 18, no wait, 20", "18", False),                          # no anchor: the last number
    ("There are 12 eggs and she uses 3, so the answer is 9 eggs.", "9", True),
    ("no number here", "3", False),
    ("", "7", False),
])
def test_gsm8k_answers(response, label, ok):
    assert is_correct(response, label) is ok


def test_extraction_helpers():
    assert final_answer_text("a 1\n#### 2\nb 3") == "2"
    assert final_answer_text("no marker 5") == "no marker 5"
    assert final_answer_text("ends with ####") == ""
    assert gold_answer(NATALIA_A) == "72" and gold_answer(1000) == "1000" and gold_answer("1,234") == "1234"


def test_reward_batch_format_weight_and_threads():
    responses = [NATALIA_A, "#### 71", "The answer is 72"]
    assert gsm8k_reward([""] * 3, responses, ["72"] * 3) == [1.0, 0.0, 1.0]
    assert gsm8k_reward([""] * 3, responses, ["72"] * 3, format_weight=0.1) == [1.1, 0.1, 1.0]
    out = []  # the reward stage runs in worker threads, where math-verify's signal-based timeouts cannot
    t = threading.Thread(target=lambda: out.append(gsm8k_reward([""], [NATALIA_A], ["72"])))
    t.start()
    t.join()
    assert out == [[1.0]]
    with pytest.raises(ValueError, match="cannot read a number"):
        is_correct("#### 3", "no answer in this label")


def test_convert_gsm8k_and_the_recipe_reward_validates(tmp_path):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text(json.dumps({"question": NATALIA_Q, "answer": NATALIA_A}) + "\n")
    out = tmp_path / "train.jsonl"
    assert convert_gsm8k(str(src), str(out)) == 1
    row = json.loads(out.read_text())
    assert row["label"] == "72" and row["prompt"].startswith(NATALIA_Q) and "####" in row["prompt"]
    assert row["response"] == ("Natalia sold 48/2 = 24 clips in May.\n"
                               "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72")
    assert is_correct(row["response"], row["label"])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="without '####"):
        convert_gsm8k(str(tmp_path / "bad.jsonl"), str(tmp_path / "x.jsonl"))

    from rlflow.flows.cli import main as cli_main

    assert cli_main(["data", "gsm8k", "--input", str(src), "--out", str(tmp_path / "cli.parquet")]) == 0
    from rlflow.engines.data.prompts import load_prompts

    assert load_prompts(str(tmp_path / "cli.parquet"))[0]["label"] == "72"

    from rlflow.engines.core.config import load_recipe

    cfg = load_recipe("deployments/gsm8k-qwen.yaml", [f"data.train_path={out}", f"data.eval_path={out}",
                                                      f"sft.train_path={out}"])
    problems = find_problems(cfg)  # no local Qwen here: only the model path may be reported, never the reward
    assert problems == [f"model.path: no Hugging Face model (config.json) in {cfg.model.path}"], problems
    cfg.sft.response_key = "solution"  # a column the file does not have
    assert any(p.startswith('sft.train_path:') and 'missing key "solution"' in p for p in find_problems(cfg))
