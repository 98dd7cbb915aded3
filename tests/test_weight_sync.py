"""Weight-sync transports: the registry matches the config, a transport added from outside the package runs a
real session's sync, and the store fallback and the in-memory path give the rollout workers the same bits."""

from __future__ import annotations

import typing

import pytest
import torch

from rlflow.engines.cluster.groups import check_implements
from rlflow.engines.core.config import WeightSyncConfig
from rlflow.engines.core.protocols import RolloutBackend, TrainBackend
from rlflow.engines.rollout.sglang_backend import SGLangRolloutBackend
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.base import WeightTransport
from rlflow.engines.sync.transports import TRANSPORTS
from rlflow.engines.train.torch_backend import TorchTrainBackend


def test_registry_names_exactly_the_configs_transports():
    """The config (engines/core, below sync) keeps its own Literal of transport names: the two must agree."""
    allowed = set(typing.get_args(WeightSyncConfig.model_fields["transport"].annotation))
    assert set(TRANSPORTS) == allowed
    assert all(cls.name == name for name, cls in TRANSPORTS.items())


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_the_backends_serve_what_each_transport_needs(name):
    """A transport names the endpoint protocols it calls on each side; the backends that take it implement them
    (the SGLang backend takes every transport but the embedded engine's GPU ones)."""
    transport = TRANSPORTS[name]
    check_implements(TorchTrainBackend, transport.sender)
    check_implements(TorchRolloutBackend, transport.receiver)
    if name not in ("cuda_ipc", "nccl"):
        check_implements(SGLangRolloutBackend, transport.receiver)


class ToyTransport(WeightTransport):
    """A transport defined outside the package: rank 0's whole model, through the driver, in one call per
    worker. It counts what the driver asked of it."""

    name = "toy"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple] = []

    def connect(self) -> None:
        self.calls.append(("connect",))

    def push(self, version: int) -> None:
        weights = self.source.call(TrainBackend.named_tensors, None)
        self.rollout.call(RolloutBackend.update_weights, weights, version)
        self.calls.append(("push", version))

    def close(self) -> None:
        self.calls.append(("close",))
        super().close()


def test_a_transport_added_from_outside_runs_a_sessions_sync(recipe, tmp_path, monkeypatch):
    monkeypatch.setitem(TRANSPORTS, "toy", ToyTransport)  # the registry entry: all a new transport needs here
    cfg = recipe(name="toy", train={"steps": 2, "threads": 1})
    object.__setattr__(cfg.weight_sync, "transport", "toy")  # the config's Literal names the built-in ones only
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path / cfg.name), use_ray=False)
    toy = session.weight_transport
    assert isinstance(toy, ToyTransport)
    try:
        for step in range(2):
            for stage in ("rollout", "reward", "advantages", "train"):
                getattr(session, stage)(step)
            metrics = session.sync_weights(step)
            trained = dict(session.train_group.call_rank0(TrainBackend.named_tensors, None))
            served = dict(session.rollout_group.call_rank0(TorchRolloutBackend.named_tensors))
            assert trained.keys() == served.keys()
            for name, t in trained.items():
                assert torch.equal(served[name], t.to(served[name].dtype)), name
            assert session.rollout_group.workers[0].weight_version == step + 1 == session.weight_version
            assert metrics["sync/weight_version"] == step + 1
            assert metrics["sync/bytes"] == session.rollout_group.call_rank0(RolloutBackend.weight_bytes) > 0
        toy.reconnect()  # what replacing a dead rollout worker does: the next update connects again
        session.sync_weights(2)
        assert toy.calls == [("connect",), ("push", 1), ("push", 2), ("connect",), ("push", 3)]
    finally:
        session.shutdown()
    assert toy.calls[-1] == ("close",)


def _rollout_weights_after(cfg, tmp_path, steps: int) -> dict[str, torch.Tensor]:
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path / cfg.name), use_ray=False)
    try:
        for step in range(steps):
            for stage in ("rollout", "reward", "advantages", "train", "sync_weights"):
                getattr(session, stage)(step)
        return dict(session.rollout_group.call_rank0(TorchRolloutBackend.named_tensors))
    finally:
        session.shutdown()


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_store_transport_matches_in_memory(backend, recipe, tmp_path):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    train = {"backend": backend, "steps": 2, "threads": 1}
    # 16 KiB buckets: the tiny model's weights travel in several
    in_memory = _rollout_weights_after(recipe(name="mem", train=train, weight_sync={"bucket_mb": 1 / 64}), tmp_path, 2)
    cfg = recipe(name="store", train=train, weight_sync={"transport": "store", "bucket_mb": 1 / 64})
    via_store = _rollout_weights_after(cfg, tmp_path, 2)
    assert in_memory.keys() == via_store.keys()
    for name in in_memory:
        assert torch.equal(in_memory[name], via_store[name]), name
    assert not RunStore(cfg.storage, cfg.name).exists("weights", "v00000002"), "a delivered version is removed"



def test_flat_weights_copy_as_one_slice():
    """GPU transports lay weights out flat (flatten_) so a whole run of them is one slice (flat_span); the
    copy through that slice must give the same weights as the per-tensor path. Checked here on CPU tensors;
    the CUDA IPC and NCCL paths that use it run on the device machine (bench/e2e/rl.py)."""
    from rlflow.engines.models.flat_weights import flat_span, flatten_
    from rlflow.engines.sync.cuda_ipc import copy_plan

    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}
    src = {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in shapes.items()}
    values = {n: p.detach().clone() for n, p in src.items()}
    flat = flatten_(src)
    assert flat.numel() == 12 + 5 + 8
    for n, p in src.items():  # same Parameter objects, same values, now views of one buffer
        assert torch.equal(p, values[n]) and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    span = flat_span([src["b"], src["c"]])
    assert span is not None and torch.equal(span, torch.cat([values["b"], values["c"].flatten()]))
    assert flat_span([src["c"], src["b"]]) is None, "out of order is not one slice"
    assert flat_span([src["a"], src["c"]]) is None, "a gap is not one slice"

    dst = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    flatten_(dst)
    per_tensor = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    copy_plan(dst, list(src.items()))()  # flat -> flat: one cast copy
    copy_plan(per_tensor, list(src.items()))()  # separate tensors: the foreach path
    for n in shapes:
        assert torch.equal(dst[n], values[n].to(torch.bfloat16)) and torch.equal(dst[n], per_tensor[n])

    released = flatten_(dst, shapes={n: torch.Size(s) for n, s in shapes.items()})  # re-allocation
    assert released.numel() == flat.numel() and flat_span(list(dst.values())) is not None


def test_sync_order_puts_each_fused_projection_in_one_slice():
    """The flat order (fusable_order) that the GPU rollout worker's buffer and the sync's bucket plan share: HF's
    order, except that each layer's q/k/v weights follow one another, then their biases (Qwen2 interleaves them),
    so the decoder's fused GEMMs and a bucket are each one slice of the buffer. The sync plans the trainer's layout
    (reported in HF's order) in the same order."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlflow.engines.models.flat_weights import flat_span, flatten_, fusable_order
    from rlflow.engines.sync.base import WeightSource

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    hf_names = [n for n, _ in AutoModelForCausalLM.from_config(cfg).named_parameters()]
    order = fusable_order(hf_names)
    assert sorted(order) == sorted(hf_names) and len(order) == len(hf_names)
    attn = "model.layers.0.self_attn."
    i = order.index(attn + "q_proj.weight")
    assert order[i : i + 6] == [attn + f"{p}_proj.{k}" for k in ("weight", "bias") for p in "qkv"]
    rest = [n for n in hf_names if "_proj.bias" not in n and not n.endswith(("k_proj.weight", "v_proj.weight"))]
    assert [n for n in order if n in rest] == rest, "everything else keeps HF's order"

    class Trainer:  # the one call WeightSource makes of its train group, answered in HF's order
        def call_rank0(self, method):
            return [(n, 8) for n in hf_names] if method.__name__ == "weight_layout" else None

    source = WeightSource(Trainer(), bucket_bytes=8 * 5)
    assert [n for n, _ in source.layout()] == order
    tensors = {n: torch.zeros(2) for n in order}
    flatten_(tensors)
    assert all(flat_span([tensors[n] for n in bucket]) is not None for bucket in source.buckets())


def test_rollout_named_tensors_gives_the_named_ones_and_names_an_unknown_one(tiny_model_dir):
    """The weight-sync benchmark compares a few weights with the trainer's without copying the whole model."""
    rollout = TorchRolloutBackend(tiny_model_dir, threads=1)
    try:
        everything = dict(rollout.named_tensors())
        names = list(everything)[-1:] + list(everything)[:1]
        some = rollout.named_tensors(names)
        assert [n for n, _ in some] == names and all(torch.equal(t, everything[n]) for n, t in some)
        with pytest.raises(KeyError, match=r"named_tensors: unknown parameter\(s\) \['no.such.weight'\]"):
            rollout.named_tensors(["no.such.weight"])
    finally:
        rollout.close()


def test_shared_weights_map_by_name_and_a_view_outside_the_buffer_fails(tmp_path):
    """cuda_ipc with a sharded trainer: a rollout worker's flat weights, shared through a file on the CPU, come out
    on the other side as views of the same memory under the same names, strided views (an MoE expert's) included;
    writing through them changes the worker's weights. A weight outside the buffer is refused by name, and the file
    is removed once mapped."""
    from rlflow.engines.models.flat_weights import flatten_
    from rlflow.engines.sync.cuda_ipc import open_shared_weights, share_flat

    path = str(tmp_path / "weights")
    params = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    flat = flatten_(params, into=torch.from_file(path, shared=True, size=17, dtype=torch.float32))
    targets = params | {"a.col1": params["a"][:, 1]}
    handle = share_flat(flat, targets, path)
    views, numel = open_shared_weights(handle, torch.device("cpu"))
    assert numel == 17 and views.keys() == targets.keys() and not (tmp_path / "weights").exists()
    assert all(torch.equal(views[n], t) for n, t in targets.items())
    views["a.col1"].fill_(7.0)
    views["b"].copy_(torch.arange(5.0))
    assert torch.equal(params["a"][:, 1], torch.full((3,), 7.0)) and torch.equal(params["b"], torch.arange(5.0))
    with pytest.raises(ValueError, match="'c' is not inside the shared flat buffer"):
        share_flat(flat, {"c": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="the weights need 17"):
        flatten_({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, into=torch.zeros(16))


def test_a_sharded_ranks_writer_checks_every_shape_before_it_writes_and_keeps_a_cpu_mapping(tmp_path):
    """cuda_ipc's trainer end (SharedWeightsWriter): the rank's gather writes through the mapped views into the
    rollout worker's memory and the bytes written come back; a CPU file is mapped once, so the next write with
    the same handle reuses the mapping. A weight the worker lacks, or a shape that differs, is refused by name
    before anything is written."""
    from rlflow.engines.models.flat_weights import flatten_
    from rlflow.engines.sync.cuda_ipc import SharedWeightsWriter, share_flat

    path = str(tmp_path / "weights")
    engine = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    handle = share_flat(flatten_(engine, into=torch.from_file(path, shared=True, size=17, dtype=torch.float32)),
                        engine, path)
    shapes = {n: torch.empty(t.shape, device="meta") for n, t in engine.items()}
    gathers: list[list[str]] = []

    def gather_into(value: float):
        def write(views: dict[str, torch.Tensor]) -> None:
            gathers.append(sorted(views))
            for t in views.values():
                t.fill_(value)
        return write

    writer = SharedWeightsWriter()
    assert writer.write(handle, torch.device("cpu"), shapes, gather_into(1.0)) == 17 * 4
    assert all(torch.equal(t, torch.ones_like(t)) for t in engine.values())
    assert writer.write(handle, torch.device("cpu"), shapes, gather_into(2.0)) == 17 * 4  # the file is gone: kept
    assert all(torch.equal(t, torch.full_like(t, 2.0)) for t in engine.values())
    with pytest.raises(KeyError, match=r"has no weight \['c'\]"):
        writer.write(handle, torch.device("cpu"), shapes | {"c": torch.empty(1, device="meta")}, gather_into(3.0))
    with pytest.raises(ValueError, match=r"a: \(4, 3\) here, \(3, 4\) there"):
        writer.write(handle, torch.device("cpu"), shapes | {"a": torch.empty(4, 3, device="meta")}, gather_into(3.0))
    with pytest.raises(ValueError, match="12 elements sent, 17 held there"):
        writer.write(handle, torch.device("cpu"), {"a": shapes["a"]}, gather_into(3.0))
    assert len(gathers) == 2 and all(torch.equal(t, torch.full_like(t, 2.0)) for t in engine.values())


def test_the_distributed_senders_other_ranks_join_only_the_gather():
    """distributed's trainer end (DistributedWeightSender): every rank runs the backend's gather (a collective),
    in the dtype named, onto the CPU for gloo; only rank 0 is in the weight-update group and broadcasts, and it
    refuses to broadcast before it joined."""
    from rlflow.engines.sync.distributed import DistributedWeightSender

    asked = []

    def gather(names, dtype, device):
        asked.append((names, dtype, device))
        return [(n, torch.zeros(2, dtype=dtype)) for n in names]

    other = DistributedWeightSender(rank=1)
    other.join("127.0.0.1", 1, 3)  # no rendezvous is served or joined: a wrong port cannot fail it
    assert other.group is None and other.broadcast(gather, ["w"], "bfloat16") == 0
    with pytest.raises(RuntimeError, match="join_weights_update_group first"):
        DistributedWeightSender(rank=0).broadcast(gather, ["w"], "float32")
    assert asked == [(["w"], torch.bfloat16, "cpu"), (["w"], torch.float32, "cpu")]


def test_released_weights_are_let_go_and_a_write_into_them_is_refused(tiny_model_dir):
    """A colocated engine's weights in one flat buffer (as on a GPU) are freed by a release, even after a decode step
    made fused views of them (they kept 15 GB alive through training at 7B). A write that a sharded trainer began
    holds generation until it is done, and is refused if the weights were released after they were shared."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from rlflow.engines.core.sampling import SamplingParams
    from rlflow.engines.models.flat_weights import flatten_
    from rlflow.engines.rollout.torch_backend import TorchRolloutBackend

    rollout = TorchRolloutBackend(tiny_model_dir, threads=1)
    try:
        flat = StorageWeakRef(flatten_(rollout.params).untyped_storage())
        rollout.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), 0)
        assert rollout.engine.lm.fused_groups > 0 and not flat.expired()
        rollout.release_memory_occupation()
        assert flat.expired()

        rollout.share_weights()
        with pytest.raises(RuntimeError, match="a cuda_ipc update began and has not finished"):
            rollout.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), 0)
        rollout.release_memory_occupation()
        with pytest.raises(RuntimeError, match="released after share_weights"):
            rollout.weights_written(1)
        rollout.share_weights()
        assert rollout.weights_written(1) == 1
        assert rollout.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), 0)[0].weight_version == 1
    finally:
        rollout.close()


def test_together_returns_in_order_and_a_member_left_in_a_collective_does_not_hold_the_exit():
    """A lost GPU leaves a member of a weight-sync collective waiting for good: `together` raises the first error
    at once, and its threads are daemons, so the process still exits (bench/e2e/fault.py's killed run)."""
    import subprocess
    import sys
    import time

    from rlflow.engines.sync.base import together

    assert together(lambda: 1, lambda: 2) == [1, 2]
    script = ("import threading\nfrom rlflow.engines.sync.base import together\n"
              "def lost(): raise RuntimeError('peer died')\n"
              "try:\n    together(threading.Event().wait, lost)\nexcept RuntimeError as e:\n    print(e)\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "peer died" in done.stdout, done.stderr
    assert time.monotonic() - t0 < 30
