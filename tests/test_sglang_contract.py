"""rlflow's SGLang clients against SGLang's own answers and flags: the recorded responses of tests/fixtures/sglang/
(shapes read from sglang 0.5.10.post1's source: see the README there), served by a stand-in process, and the
launch_server flag table checked in from that release (engines/core/sglang_flags.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import httpx
import pytest

from bench.rollout import sglang_server_flags
from rlflow.engines.core import sglang_flags
from rlflow.engines.core.config import SGLangConfig
from rlflow.engines.core.sglang_args import gpus_per_server, normalise_args, server_dtype, weight_update_ranks
from rlflow.engines.rollout.functions import sample_from_item
from rlflow.engines.rollout.http_api import parse_weight_version, weight_version_text
from rlflow.engines.rollout.sglang_backend import SGLangRolloutBackend, generation_from_item

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"


def _fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


# ---- answers -------------------------------------------------------------------------------------------------
def test_weight_version_default_is_version_zero_everywhere():
    assert parse_weight_version("default") == 0 and parse_weight_version("7") == 7 and parse_weight_version(None) == 0
    assert weight_version_text(0) == "default" and weight_version_text(3) == "3"
    with pytest.raises(ValueError, match="meta_info.weight_version: 'v2-hotfix' is not a weight version"):
        parse_weight_version("v2-hotfix", "meta_info.weight_version")


def test_clients_read_a_fresh_servers_generate_items():
    """A fresh server's items say weight_version "default" and carry a null (-inf) logprob: both clients (the rollout
    functions' and the SGLang worker's own) read them, where int("default") and float(None) used to raise."""
    first, second = _fixture("generate_batch.json")
    sample = sample_from_item(first)
    assert sample.weight_version == 0 and sample.finish_reason == "length" and sample.response_ids == [7, 12, 9]
    assert sample.logprobs[1] == -math.inf and sample.logprobs[0] == pytest.approx(-math.log(2))
    gen = generation_from_item([1, 4, 5, 6], first)
    assert gen.weight_version == 0 and gen.output_logprobs[1] == -math.inf and gen.output_ids == [7, 12, 9]
    assert sample_from_item(second).finish_reason == "stop"


@pytest.mark.parametrize("legacy", [False, True], ids=["server_info", "get_server_info"])
def test_the_sglang_worker_against_recorded_answers(tiny_model_dir, tmp_path, legacy):
    """The SGLang worker launched in front of a process answering with SGLang's recorded shapes: generation,
    /server_info and /model_info (or the deprecated /get_* names on an older server), the server's dtype resolved
    from `auto` as SGLang does (a float32 checkpoint is served in float16), a disk update and its model_path."""
    python = tmp_path / "sglang-env-python"  # rollout.sglang.python: the interpreter of SGLang's own environment
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    sglang = {"python": str(python), "launch_module": "tests.sglang_fixture_server", "args": {"legacy-info": legacy},
              "startup_timeout_s": 60}
    worker = SGLangRolloutBackend(tiny_model_dir, sglang, threads=1, log_dir=str(tmp_path))
    try:
        assert worker.command[:3] == [str(python), "-m", "tests.sglang_fixture_server"]
        from rlflow.engines.core.sampling import SamplingParams

        gens = worker.generate([[1, 4, 5, 6], [1, 9, 8]], SamplingParams(max_new_tokens=3), seed=0)
        assert [g.weight_version for g in gens] == [0, 0] and gens[0].output_logprobs[1] == -math.inf
        assert worker.server_info()["version"] == "0.5.10.post1" and worker.model_info()["weight_version"] == "default"
        assert worker.weight_dtype() == "float16"
        folder = tmp_path / "v5"
        folder.mkdir()
        assert worker.update_weights_from_disk(folder, 5) == 5
        assert worker.model_info()["model_path"] == str(folder) and worker.model_info()["weight_version"] == "5"
        with pytest.raises(RuntimeError, match="answered 400.*Failed to get weights iterator"):
            worker.update_weights_from_disk(tmp_path / "gone", 6)
        # LoRA (train.lora): a loaded name is unloaded before it is loaded again, as SGLang refuses it twice
        adapter = tmp_path / "adapter"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text("{}")
        flushes = httpx.get(worker.server_url() + "/get_flushes").json()["flushes"]
        worker.load_lora_adapter("policy", str(adapter))
        worker.load_lora_adapter("policy", str(adapter))
        assert httpx.get(worker.server_url() + "/get_flushes").json()["flushes"] == flushes + 2, "stale prefixes go"
        with pytest.raises(RuntimeError, match=r"/load_lora_adapter 'other' failed \(400\): Can't find"):
            worker.load_lora_adapter("other", str(tmp_path / "gone"))
        worker.update_weight_version(7)
        assert worker.model_info()["weight_version"] == "7"
        worker.unload_lora_adapter("policy")
        with pytest.raises(RuntimeError, match="LoRA with name policy does not exist"):
            worker.unload_lora_adapter("policy")
    finally:
        worker.close()


def test_server_dtype_follows_sglangs_auto_rule(tmp_path):
    def model(**config) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    assert server_dtype("auto", model(torch_dtype="float32", model_type="llama")) == "float16"
    assert server_dtype("auto", model(torch_dtype="float32", model_type="gemma2")) == "bfloat16"
    assert server_dtype(None, model(dtype="bfloat16", model_type="qwen2")) == "bfloat16"
    assert server_dtype("half", tmp_path) == "float16" and server_dtype("torch.float32", tmp_path) == "float32"
    with pytest.raises(ValueError, match="'int8' is none of"):
        server_dtype("int8", tmp_path)


# ---- flags -----------------------------------------------------------------------------------------------------
def test_args_are_spelled_as_sglangs_parser_takes_them():
    args = SGLangConfig.model_validate({"args": {"tp_size": 2, "--mem_fraction_static": 0.8, "dp": 1}}).args
    assert args == {
        "tensor-parallel-size": 2,
        "mem-fraction-static": 0.8,
        "data-parallel-size": 1,
        "enable-deterministic-inference": True,
    }
    assert SGLangConfig.model_validate({"args": args}).args == args, "normalising twice changes nothing"
    assert "enable-deterministic-inference" not in normalise_args({"tp-size": 1})
    assert SGLangConfig.model_validate({"deterministic": False}).args == {"enable-deterministic-inference": False}
    custom = SGLangConfig.model_validate({"launch_module": "my.launcher", "args": {"my_flag": 1}})
    assert custom.args == {"my-flag": 1}, "a custom launcher's flags are re-spelled, not checked"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"pp": 2}, r"args\.pp: --pp is ambiguous in SGLang's parser \(it could be --pipeline-parallel-size, "),
        ({"tp-sizee": 2}, r"args\.tp-sizee: --tp-sizee is not a launch_server flag of sglang 0\.5\.10\.post1"),
        ({"enable-memory-saver": "yes"}, r"--enable-memory-saver is a switch: true or false"),
        ({"tp-size": 1, "tensor_parallel_size": 2}, r"'tp-size' and 'tensor_parallel_size' are the same flag"),
        ({"model": "/elsewhere"}, r"args\.model: --model-path is set by the rollout worker"),
        ({"enable-deterministic-inference": False}, r"contradicts rollout\.sglang\.deterministic: True"),
        # deprecated in 0.5.10.post1 (DeprecatedAction, nargs=0): SGLang's parser takes no value after them
        ({"hybrid-kvcache-ratio": 0.5}, r"args\.hybrid-kvcache-ratio: --hybrid-kvcache-ratio is a switch"),
        ({"prefill_round_robin_balance": 2}, r"--prefill-round-robin-balance is a switch"),
        ({"enable-piecewise-cuda-graph": "yes"}, r"--enable-piecewise-cuda-graph is a switch"),
        # rlflow numbers the weights it sends; a server launched as "v1" fails the first generation's version parse
        ({"weight-version": "v1"}, r"args\.weight-version: --weight-version is rlflow's to set"),
        ({"weight_version": "default"}, r"args\.weight_version: --weight-version is rlflow's to set"),
    ],
)
def test_args_sglang_would_refuse_are_refused_at_validation(args, message):
    with pytest.raises(ValueError, match=message):
        SGLangConfig.model_validate({"args": args})


def test_flag_table_reads_actions_that_take_no_value():
    """The table generator (bench/rollout/sglang_server_flags.py) reads a flag as a switch when argparse consumes
    nothing after it: argparse's own switch actions, an explicit nargs=0, and the file's own Action classes whose
    __init__ defaults nargs to 0, as 0.5.10.post1 declares DeprecatedAction (the checked-in table's three deprecated
    flags are switches). The source here has that release's declarations, cut down."""
    source = "\n".join([
        "import argparse",
        "class DeprecatedAction(argparse.Action):",
        "    def __init__(self, option_strings, dest, nargs=0, **kwargs):",
        "        super().__init__(option_strings, dest, nargs=nargs, **kwargs)",
        "class LoRAPathAction(argparse.Action):",
        "    def __call__(self, parser, namespace, values, option_string=None): ...",
        "def add_cli_args(parser):",
        "    parser.add_argument('--hybrid-kvcache-ratio', action=DeprecatedAction, help='deprecated')",
        "    parser.add_argument('--lora-paths', nargs='*', action=LoRAPathAction)",
        "    parser.add_argument('--page-size', type=int)",
        "    parser.add_argument('--enable-x', action='store_true')",
        "    parser.add_argument('--quiet', action='count')",
        "    parser.add_argument('--marker', nargs=0, action=LoRAPathAction)",
        "    parser.add_argument('--flag', action=argparse.BooleanOptionalAction)",
    ] + [f"    parser.add_argument('--pad-{i}', type=int)" for i in range(sglang_server_flags.MIN_FLAGS)])
    flags = sglang_server_flags.flags_from_source(source)
    kinds = {name: flags[name][1] for name in ("--hybrid-kvcache-ratio", "--lora-paths", "--page-size", "--enable-x",
                                                "--quiet", "--marker", "--flag", "--no-flag")}
    assert kinds == {"--hybrid-kvcache-ratio": "switch", "--lora-paths": "value", "--page-size": "value",
                     "--enable-x": "switch", "--quiet": "switch", "--marker": "switch", "--flag": "switch",
                     "--no-flag": "switch"}
    for deprecated in ("--hybrid-kvcache-ratio", "--prefill-round-robin-balance", "--enable-piecewise-cuda-graph"):
        assert sglang_flags.FLAGS[deprecated] == (deprecated, "switch")
    assert normalise_args({"hybrid-kvcache-ratio": True}) == {"hybrid-kvcache-ratio": True}


def test_pipeline_stages_cannot_join_one_weight_update_group(recipe):
    """SGLang joins the group as rank_offset + tp_rank from every pipeline stage: with pp > 1 the ranks collide."""
    assert gpus_per_server({"tensor-parallel-size": 2, "pipeline-parallel-size": 2}) == 4
    assert weight_update_ranks({"tensor-parallel-size": 2}) == 2
    rollout = {"backend": "sglang", "sglang": {"args": {"tp-size": 2, "pp-size": 2}}}
    with pytest.raises(ValueError, match="pipeline-parallel-size > 1 cannot take weights over"):
        recipe(rollout=rollout, weight_sync={"transport": "distributed"})
    assert (
        recipe(rollout=rollout, weight_sync={"transport": "disk", "disk_dir": "/tmp/w"}).rollout.sglang.args[
            "pipeline-parallel-size"
        ]
        == 2
    )
    with pytest.raises(ValueError, match="data-parallel-size > 1 cannot take weights"):
        weight_update_ranks({"data-parallel-size": 2})
