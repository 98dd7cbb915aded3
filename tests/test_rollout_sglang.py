"""The SGLang rollout backend (engines/rollout/sglang_backend.py): launching, stopping and driving a server process.

SGLang cannot be installed where these tests run (no GPU here, and no SGLang wheel for the device machine
either), so the embedded server stands in for it: `rollout.sglang.launch_module: rlflow.engines.rollout.launch`
makes each worker run `python -m rlflow.engines.rollout.launch`, which takes SGLang's launch_server flags (a subset,
same names) and serves SGLang's routes. Everything else is the code path a real SGLang gets: the command line
built from the recipe's args, the child's process group, the /health wait, the HTTP weight and memory routes,
and the disk weight transport through an RLSession. What only a real SGLang can show (GPU memory release
with --enable-memory-saver, its own weight loader, tensor parallelism) is not tested here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.config import ModelConfig
from rlflow.engines.core.protocols import TrainBackend
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.core.sglang_args import gpus_per_server
from rlflow.engines.models.hf import build_tiny_model
from rlflow.engines.rollout.sglang_backend import SGLangRolloutBackend, server_args
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.sync.distributed import (
    broadcast_weights,
    destroy_weights_update_group,
    dtype_names,
    join_weights_update_group,
)

EMBEDDED = "rlflow.engines.rollout.launch"  # the stand-in for sglang.launch_server
ARGS = {"max-running-requests": 3, "context-length": 48, "random-seed": 7, "dtype": "float32", "page-size": 8,
        "max-total-tokens": 96}
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 4, 5, 6], [1, 9, 8]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("sglang_model")
    build_tiny_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64),
        out,
        seed=0,
    )
    return str(out)


def _launch(model_dir: str, args: dict | None = None, **kwargs) -> SGLangRolloutBackend:
    sglang = {"launch_module": EMBEDDED, "args": ARGS if args is None else args, "startup_timeout_s": 120}
    return SGLangRolloutBackend(model_dir, sglang, threads=1, **kwargs)


@pytest.fixture(scope="module")
def weight_dir(tmp_path_factory) -> Path:
    """A folder the worker's server may load weights from (as a run's weight-sync folder)."""
    return tmp_path_factory.mktemp("sglang_weights")


@pytest.fixture(scope="module")
def worker(model_dir, weight_dir):
    backend = _launch(model_dir, weight_dirs=[str(weight_dir)])
    yield backend
    backend.close()


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _running(pid)


def _port_free(port: int) -> bool:
    """Nothing listens on the port: a new server can bind it (with SO_REUSEADDR, as servers do, since the
    closed connections may linger in TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


# ---- launching -----------------------------------------------------------------------------------------
def test_recipe_args_become_launch_server_flags_untouched():
    args = {
        "mem-fraction-static": 0.8,
        "enable-memory-saver": True,
        "disable-radix-cache": False,
        "chunked-prefill-size": None,
        "lora-target-modules": ["q_proj", "v_proj"],
        "tp-size": 2,
        "json-model-override-args": {"rope_scaling": None},
        "--log-level": "info",
    }
    assert server_args(args) == [
        "--mem-fraction-static",
        "0.8",
        "--enable-memory-saver",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
        "--tp-size",
        "2",
        "--json-model-override-args",
        '{"rope_scaling": null}',
        "--log-level",
        "info",
    ]
    assert gpus_per_server({"tensor-parallel-size": 2}) == 2 and gpus_per_server({}) == 1
    assert gpus_per_server({"tensor-parallel-size": 2, "pipeline-parallel-size": 2}) == 4
    assert gpus_per_server({"tensor-parallel-size": 2, "data-parallel-size": 2}) == 4
    assert gpus_per_server({"tensor-parallel-size": 2, "data-parallel-size": 2, "enable-dp-attention": True}) == 2


def test_launch_waits_for_health_and_passes_the_args(worker, model_dir):
    pid = worker.server_pid()
    assert pid != os.getpid() and os.getpgid(pid) == pid, "the server leads its own process group"
    assert httpx.get(worker.server_url() + "/health").status_code == 200
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    assert [a.decode() for a in cmdline][1:] == [
        "-m",
        EMBEDDED,
        "--model-path",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        worker.server_url().rsplit(":", 1)[1],
        *server_args(ARGS),
        "--enable-deterministic-inference",  # SGLang honours sampling_seed only with it (rollout.sglang.deterministic)
        "--insecure-no-token",  # a worker made without a token: the embedded server is told its routes are open
    ]
    info = worker.server_info()
    assert (info["max_running_requests"], info["context_length"], info["dtype"]) == (3, 48, "float32")
    assert (info["page_size"], info["max_total_num_tokens"]) == (8, 96)
    assert info["internal_states"][0]["num_preemptions"] == 0
    assert worker.start_server() == worker.server_url(), "a running server is not launched twice"


def test_a_refused_option_fails_with_the_servers_log(model_dir, tmp_path):
    with pytest.raises(RuntimeError) as err:
        _launch(model_dir, {"mem-fraction-static": 0.8}, log_dir=str(tmp_path))
    message = str(err.value)
    assert "exited with code 2 before answering /health" in message
    assert "does not support --mem-fraction-static" in message, "the end of the child's log is in the error"
    assert "--mem-fraction-static 0.8" in (tmp_path / "server.log").read_text()


def test_close_stops_the_server_and_frees_its_port(model_dir):
    backend = _launch(model_dir, {})
    pid, guard = backend.server_pid(), backend._guard.pid
    port = int(backend.server_url().rsplit(":", 1)[1])
    backend.close()
    assert not _running(pid) and _wait_gone(guard, 20), "close stops the server and its guard"
    assert _port_free(port)
    assert backend.server_url() is None


def test_a_killed_owner_leaves_no_server_behind(model_dir):
    """A killed Ray actor runs no exit handlers: the guard process still stops the server."""
    script = (
        "import sys, time\n"
        "from rlflow.engines.rollout.sglang_backend import SGLangRolloutBackend\n"
        f"b = SGLangRolloutBackend(sys.argv[1], {{'launch_module': {EMBEDDED!r}, 'startup_timeout_s': 120}}, "
        "threads=1)\n"
        "print(b.server_pid(), b.server_url(), flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script, model_dir], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1]
    )
    try:
        pid, url = owner.stdout.readline().split()
        assert httpx.get(url + "/health").status_code == 200
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert _wait_gone(int(pid)), "the server outlived its owner"
    finally:
        owner.kill()
        owner.wait()


# ---- weights and memory --------------------------------------------------------------------------------
def _greedy(worker) -> dict:
    return worker.generate_packed(PROMPTS, GREEDY, seed=0)


def test_pause_generation_holds_requests_until_continue(worker):
    """What a sync under generation (rollout.max_staleness >= 2) does around the update: /pause_generation holds
    the requests (they wait, nothing is lost), /continue_generation lets them finish."""
    before = _greedy(worker)
    worker.pause_generation()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_greedy, worker)
        time.sleep(1.0)
        assert not pending.done()
        worker.continue_generation()
        assert pending.result(timeout=60)["output_ids"].tolist() == before["output_ids"].tolist()


def test_update_weights_from_disk_changes_generations_and_weight_version(worker, model_dir, weight_dir, tmp_path):
    assert worker.model_info()["weight_version"] == "default", "a fresh server answers as SGLang's does"
    before = _greedy(worker)
    assert before["weight_version"].tolist() == [0, 0], "'default' is rlflow's version 0"
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    negated = {"lm_head.weight": -weights["lm_head.weight"]}
    save_file(negated, str(tmp_path / "bucket-0000.safetensors"))
    with pytest.raises(RuntimeError, match="answered 403.*outside the folders"):  # not one of the run's folders
        worker.update_weights_from_disk(tmp_path, 5)
    (weight_dir / "v5").mkdir()
    save_file(negated, str(weight_dir / "v5" / "bucket-0000.safetensors"))
    assert worker.update_weights_from_disk(weight_dir / "v5", 5) == 5  # a folder with some of the weights
    after = _greedy(worker)
    assert not (after["output_ids"] == before["output_ids"]).all(), "negated logits pick other tokens"
    assert after["weight_version"].tolist() == [5, 5]
    assert worker.server_info()["weight_version"] == "5"
    assert worker.model_info()["model_path"] == str(weight_dir / "v5"), "SGLang's model_path: the folder loaded"
    worker.update_weights_from_disk(model_dir, 6)  # the original model folder
    restored = _greedy(worker)
    assert restored["output_ids"].tolist() == before["output_ids"].tolist()
    assert restored["weight_version"].tolist() == [6, 6]


def test_tensors_reach_the_server_through_a_folder_of_the_worker(worker, model_dir):
    """The `ray` / `store` transports and a checkpoint's weights hand tensors to the worker."""
    before = _greedy(worker)
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    worker.update_weights([("lm_head.weight", -weights["lm_head.weight"])], 8)
    assert not (_greedy(worker)["output_ids"] == before["output_ids"]).all()
    first = worker.model_info()["model_path"]
    worker.update_weights(weights.items(), 9)
    assert _greedy(worker)["output_ids"].tolist() == before["output_ids"].tolist()
    # the folder the server loaded last is its model_path and stays; the one before goes
    assert [str(p) for p in worker._dir.glob("weights-*")] == [worker.model_info()["model_path"]] != [first]


def test_release_and_resume_memory_occupation(worker, model_dir):
    before = _greedy(worker)
    sent = []
    worker._http.event_hooks["request"].append(lambda r: sent.append((r.url.path, json.loads(r.content or b"{}"))))
    worker.release_memory_occupation()
    # slime's order: drain and flush, release every tag; the weights back before the update, the rest after it
    release = ("/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]})
    assert sent == [("/flush_cache", {}), release]
    assert worker.server_info()["internal_states"][0]["memory_released"] is True
    with pytest.raises(RuntimeError, match="released"):
        _greedy(worker)
    sent.clear()
    worker.update_weights_from_disk(model_dir, 10)  # resumes the weights first, as a colocated sync does
    worker.end_weight_update()
    assert [path for path, _ in sent] == ["/resume_memory_occupation", "/update_weights_from_disk", "/flush_cache"]
    assert sent[0][1] == {"tags": ["weights"]}
    assert sent[1][1]["flush_cache"] is False, "one flush per update, after its last bucket"
    worker._http.event_hooks["request"].clear()
    assert worker.server_info()["internal_states"][0]["memory_released"] is False
    assert worker._released == {"kv_cache", "cuda_graph"}  # ... the rest once the trainer has parked its state
    worker.resume_memory_occupation(["kv_cache", "cuda_graph"])
    assert worker._released == set()
    assert _greedy(worker)["output_ids"].tolist() == before["output_ids"].tolist()
    worker.release_memory_occupation()
    worker.resume_memory_occupation()  # the explicit pair works too (weights are refilled by the next update)
    worker.update_weights_from_disk(model_dir, 11)
    assert _greedy(worker)["output_ids"].tolist() == before["output_ids"].tolist()


def test_release_waits_until_running_requests_finish(worker, model_dir):
    """SGLang releases memory only on an idle server (it asserts it): the worker drains first, so a release that
    meets a running request waits for it instead of failing."""
    long = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(worker.generate, [[1, 4, 5]], long, 0)
        deadline = time.monotonic() + 30
        while not running.done() and time.monotonic() < deadline:
            if worker.server_info()["internal_states"][0]["num_requests"]:
                break
            time.sleep(0.005)
        worker.release_memory_occupation()
        assert len(running.result(timeout=60)[0].output_ids) == 40, "the request ran to its end"
    assert worker.server_info()["internal_states"][0]["memory_released"] is True
    worker.update_weights_from_disk(model_dir, 12)
    worker.end_weight_update()


def test_distributed_weight_update_over_gloo(worker, model_dir):
    """SGLang's /init_weights_update_group + /update_weights_from_distributed, with this process as the
    trainer's rank 0 and the launched server as rank 1 of a gloo group (nccl on GPUs)."""
    before = _greedy(worker)
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    port, name = free_port(), "test_weight_update_group"
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(worker.init_weights_update_group, "127.0.0.1", port, 1, 2, name, "gloo")
        group = join_weights_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=60)
        joined.result(timeout=60)
        try:
            for version, sign in ((12, -1), (13, 1)):  # two updates over the same group
                named = {
                    "lm_head.weight": sign * weights["lm_head.weight"],
                    "model.norm.weight": weights["model.norm.weight"],
                }
                shapes = [list(t.shape) for t in named.values()]
                done = pool.submit(
                    worker.update_weights_from_distributed,
                    list(named),
                    dtype_names(named.values()),
                    shapes,
                    version,
                    name,
                )
                assert broadcast_weights(group, named.values()) == sum(t.numel() * 4 for t in named.values())
                assert done.result(timeout=60) == version
                out = _greedy(worker)
                assert out["weight_version"].tolist() == [version, version]
                assert (out["output_ids"].tolist() == before["output_ids"].tolist()) == (sign == 1)
        finally:
            worker.destroy_weights_update_group(name)
            destroy_weights_update_group(group)


# ---- SGLang's weight transports through a session: disk, the distributed pair, and delta (the worker's mirror) ------
TRANSPORTS = ["disk", "distributed", "delta"]


@contextmanager
def _session_run(recipe, tmp_path, name: str, transport: str, use_ray: bool = False, **sections):
    """A session of the small recipe after two RL steps whose weights went by `transport`, in several buckets:
    (session, trainer's weights, every stage's metrics)."""
    from rlflow.engines.session.rl import RLSession
    from rlflow.engines.session.workers import prepare_data, prepare_model

    cfg = recipe(
        name=name,
        train={"steps": 2, "threads": 1},
        cluster={"use_ray": use_ray, "num_cpus": 2},
        weight_sync={"transport": transport, "disk_dir": str(tmp_path / "weights"), "bucket_mb": 1 / 64},
        **sections,
    )
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path / name))
    try:
        metrics = []
        for step in range(2):
            for stage in ("rollout", "reward", "advantages", "train", "sync_weights"):
                metrics.append(getattr(session, stage)(step))
        trained = dict(session.train_group.call_rank0(TrainBackend.named_tensors))
        versions = tmp_path / "weights" / name / "weights"
        if transport == "disk":  # the version the servers loaded last stays (SGLang's model_path), older ones go
            assert (versions / "v00000002").is_dir() and not (versions / "v00000001").exists()
        if transport == "distributed":  # nothing went through the disk
            assert not (tmp_path / "weights").exists()
        yield session, trained, metrics
    finally:
        session.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transport_gives_the_embedded_engine_the_trainers_weights(recipe, tmp_path, transport):
    # the embedded engine's server joins the group from its own process: a Ray actor (the config refuses less)
    use_ray = transport == "distributed"
    with _session_run(recipe, tmp_path, f"{transport}-torch", transport, use_ray) as (session, trained, metrics):
        rollout = dict(session.rollout_group.call_rank0(TorchRolloutBackend.named_tensors))
        assert trained.keys() == rollout.keys()
        for name in trained:
            assert torch.equal(trained[name], rollout[name]), name
        assert metrics[-1]["sync/weight_version"] == 2.0 and metrics[-1]["sync/bytes"] > 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sglang_backend_runs_rl_steps(recipe, tmp_path, transport):
    """Two RL steps whose rollouts come from the launched server (the worker's /generate) and whose weights
    reach it through /update_weights_from_disk, or a weight-update group and /update_weights_from_distributed;
    the server then generates what the trainer's weights give. The server holds bfloat16 weights (the trainer
    float32): the distributed transport broadcasts the server's dtype. sglang-router fronts it (installed here)."""
    args = {"random-seed": 0, "dtype": "bfloat16"}
    rollout = {"backend": "sglang", "sglang": {"launch_module": EMBEDDED, "args": args}}
    with _session_run(recipe, tmp_path, f"{transport}-sglang", transport, rollout=rollout) as (session, trained,
                                                                                                metrics):
        worker = session.rollout_group.workers[0]
        pid = worker.server_pid()
        assert isinstance(worker, SGLangRolloutBackend)
        assert session.server_urls == [worker.server_url()] and session.router.kind == "sglang-router"
        if transport == "distributed":
            assert metrics[-1]["sync/bytes"] == sum(t.numel() * 2 for t in trained.values()), "bfloat16, not fp32"
        assert metrics[0]["rollout/tokens"] > 0 and metrics[-1]["sync/weight_version"] == 2.0
        assert worker.server_info()["weight_version"] == "2"
        served = worker.generate_packed(PROMPTS, GREEDY, seed=0)
        reference = TorchRolloutBackend(session.model_path, threads=1, batch_size=4, dtype=torch.bfloat16)
        try:
            reference.update_weights(trained.items(), 2)
            expected = reference.generate_packed(PROMPTS, GREEDY, seed=0)
        finally:
            reference.close()
        assert served["output_ids"].tolist() == expected["output_ids"].tolist()
        assert served["weight_version"].tolist() == [2, 2]
        torch.testing.assert_close(
            torch.as_tensor(served["output_logprobs"]), torch.as_tensor(expected["output_logprobs"]), rtol=0, atol=1e-5
        )
    assert not _running(pid), "session.shutdown closes the worker's server"


def test_a_token_that_starts_with_a_dash_reaches_the_server_as_its_api_key(model_dir, tmp_path):
    """secrets.token_urlsafe may start with "-": passed as one `--api-key=...` argument, never as a flag; the
    worker's own requests carry it, others get 401, and the launch line in the log masks it."""
    token = "-dash-token_xyz"
    backend = _launch(model_dir, log_dir=str(tmp_path), token=token)
    try:
        assert httpx.post(backend.url + "/flush_cache").status_code == 401
        backend._post("/flush_cache")  # the worker's client sends the token
        assert token not in backend.log_path.read_text() and "--api-key=***" in backend.log_path.read_text()
    finally:
        backend.close()
