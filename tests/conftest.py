"""Shared fixtures: a tiny model on disk, small recipes, and quiet, offline Prefect/Ray settings."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # a loaded 2-core CI machine
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Each pytest process its own Prefect database. pytest-xdist's workers inherit the controller's environment, so a
# home the controller made here is replaced in each worker; one the user set is kept.
if "PREFECT_HOME" not in os.environ or os.environ.get("RLFLOW_TEST_PREFECT_HOME") == os.environ["PREFECT_HOME"]:
    os.environ["PREFECT_HOME"] = os.environ["RLFLOW_TEST_PREFECT_HOME"] = tempfile.mkdtemp(prefix="rlflow-prefect-")

from rlflow.engines.core.config import ModelConfig, config_from_dict  # noqa: E402
from rlflow.engines.models.hf import build_tiny_model  # noqa: E402
from rlflow.flows.serve import use_prefect_server_defaults  # noqa: E402

use_prefect_server_defaults()  # the temporary Prefect server the tests' flows start, as `rlflow run` starts it

def assert_same_update(start: dict, single: list, parallel: list) -> None:
    """Data-parallel workers took the same optimizer steps as one worker on the whole batch, up to float
    summation order. Adam divides each gradient by its own running magnitude, so an element whose gradient is
    ~0 moves by an amount that depends on that order (shards + all-reduce vs one batch): each tensor's
    difference is compared with its own update, to 1% of the update's largest element."""
    for (name, a), (_, b) in zip(single, parallel, strict=True):
        step = (a - start[name]).abs().max()
        assert (a - b).abs().max() <= 1e-2 * step + 1e-7, name


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny_model")
    build_tiny_model(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                 max_seq_len=32), out, seed=0)
    return str(out)


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory) -> str:
    """A tiny Qwen2-VL (2-block vision tower, 2-layer language model) with the demo's char tokenizer and an image
    processor for 56-112-pixel pictures."""
    out = tmp_path_factory.mktemp("tiny_vl")
    build_tiny_model(ModelConfig(arch="qwen2_vl", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                 num_kv_heads=2, max_seq_len=256), out, seed=0)
    return str(out)


def step_metrics(run: Callable[[], Any], listeners: Iterable[Callable[[int, dict], None]] = ()
                 ) -> tuple[dict[int, dict], Any]:
    """Call `run` (a flow) with `listeners` and a collector on every finished step: (each step's metrics, what
    `run` returned). A retried attempt's step replaces the failed attempt's."""
    from rlflow.tasks.run_context import STEP_LISTENERS  # Prefect's import cost, for the tests that run flows

    seen: dict[int, dict] = {}
    STEP_LISTENERS.extend([*listeners, lambda step, m: seen.__setitem__(step, m)])
    try:
        result = run()
    finally:
        STEP_LISTENERS.clear()
    return seen, result


def resume_one_rank_and_export(model_dir: str, out: str, rank: int, world: int, url: str) -> None:
    """One rank of a fresh torch train backend loads the checkpoint `out`/ckpt (saved by another layout: CP, EP);
    rank 0 writes the weights it then holds to `out`/resumed.safetensors (the parallel tests' spawned ranks)."""
    from safetensors.torch import save_file  # the spawned ranks import this module; keep its top light

    from rlflow.engines.core.config import AlgorithmConfig, TrainConfig
    from rlflow.engines.train.torch_backend import TorchTrainBackend
    from tests.spawned_ranks import end_ranks

    resumed = TorchTrainBackend(model_dir, TrainConfig(threads=1, mini_batches=1), AlgorithmConfig(), rank=rank,
                                world_size=world, dist_url=url)
    resumed.load(f"{out}/ckpt")
    weights = dict(resumed.named_tensors())
    if rank == 0:
        save_file({n: t.contiguous() for n, t in weights.items()}, f"{out}/resumed.safetensors")
    end_ranks()


def small_recipe(tmp_path, **sections) -> dict:
    """A fast sort recipe writing everything under tmp_path; sections override (shallowly merged)."""
    raw = {
        "name": "t",
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "max_seq_len": 16},
        "data": {"train_path": str(tmp_path / "data/train.jsonl"), "eval_path": str(tmp_path / "data/eval.jsonl"),
                 "generate": {"task": "sort", "num_digits": 3, "num_train": 2000, "num_eval": 32}},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 4},
        "train": {"steps": 3, "threads": 1},
        "eval": {"every": 2, "max_prompts": 16},
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"},
        "storage": {"uri": str(tmp_path / "runs")},
    }
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return raw


@pytest.fixture
def recipe(tmp_path):
    def make(**sections):
        return config_from_dict(small_recipe(tmp_path, **sections))

    return make


# The longest files first, so that pytest-xdist's two workers (README: `-n 2 --dist loadfile --no-loadscope-reorder`;
# without the last flag xdist orders files by their number of tests) end together, instead of one starting
# test_resume.py as the other runs out of files: longest-processing-time-first. Seconds per file on the 2-core CI
# machine, run serially; the other files follow in their usual order.
LONGEST_FILES = {
    "test_serve.py": 400, "test_resume.py": 336, "test_fsdp.py": 216, "test_e2e.py": 197, "test_multinode.py": 105,
    "test_weight_sync_bench.py": 102, "test_rollout_fn.py": 98, "test_rollout_sglang.py": 98, "test_megatron.py": 82,
}


def pytest_collection_modifyitems(config, items):
    first = {item.path.name: i for i, item in reversed(list(enumerate(items)))}  # each file's first position
    items.sort(key=lambda item: (-LONGEST_FILES.get(item.path.name, 0), first[item.path.name]))


# Threads a test process may hold after a test file. A process runs many files (all of them, or an xdist worker's
# share): threads a file leaves behind stay for every later file. Megatron's backends once left 800 gloo groups
# (three threads each, 2,400 threads polling: a core's worth of CPU) and every file after test_megatron.py ran on
# what was left of 2 cores.
THREAD_LIMIT = 400


@pytest.fixture(autouse=True, scope="module")
def no_thread_build_up():
    """After each test file, the process holds fewer than THREAD_LIMIT threads (Linux: /proc names them)."""
    yield
    tasks = Path(f"/proc/{os.getpid()}/task")
    if not tasks.is_dir():
        return
    names: Counter[str] = Counter()
    for task in tasks.iterdir():
        with contextlib.suppress(FileNotFoundError):  # the thread ended meanwhile
            names[(task / "comm").read_text().strip()] += 1
    assert sum(names.values()) < THREAD_LIMIT, f"{sum(names.values())} threads left, by name: {names.most_common(5)}"


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server on loopback (moto's server mode, as s3fs's own tests use)."""
    from moto.server import ThreadedMotoServer

    from rlflow.engines.cluster.addresses import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield f"http://127.0.0.1:{port}"
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket; returns (root URI, endpoint)."""
    import uuid

    import s3fs

    name = f"b{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}).mkdir(name)
    return f"s3://{name}/runs", s3_server


@pytest.fixture(params=["file", "s3"])
def storage(request, tmp_path):
    """A StorageConfig for each kind of store the tests cover."""
    from rlflow.engines.core.config import StorageConfig

    if request.param == "file":
        return StorageConfig(uri=str(tmp_path / "store"))
    root, endpoint = request.getfixturevalue("s3_bucket")
    return StorageConfig(uri=root, endpoint_url=endpoint)


@pytest.fixture(scope="module")
def mcore():
    """megatron-core with a 1-rank gloo group; torch.distributed is taken down after the module that uses it."""
    pytest.importorskip("megatron.core")
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE: 2 layers of 4 experts (top 2), vocabulary 96, weights as its checkpoint names them."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    out = tmp_path_factory.mktemp("tiny-moe")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        max_position_embeddings=64)).save_pretrained(out)
    return str(out)
