"""LoRA RL on the native trainer (train.lora, engines/train/lora.py): only adapters train, the reference policy is
the base with adapters off, checkpoints resume and export PEFT adapters and merged weights, and the recipe
refuses combinations that cannot work, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from bench.e2e.bare_loop import run_bare, run_sft_bare
from rlflow.engines.core.config import (
    LORA_TARGETS,
    AlgorithmConfig,
    LoraConfig,
    StorageConfig,
    TrainConfig,
    config_from_dict,
    load_recipe,
)
from rlflow.engines.models.peft_adapter import CONFIG_FILE, WEIGHTS_FILE
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.preflight import find_problems
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.train import lora
from rlflow.engines.train.torch_backend import TorchTrainBackend
from tests.conftest import assert_same_update, small_recipe
from tests.test_engines import _toy_batch
from tests.test_fsdp import ALGO, _ranks, _step, ray_cluster  # noqa: F401 - ray_cluster is a fixture

LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
TRAIN = TrainConfig(threads=1, lr=5e-2, lora=LORA)


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    return _toy_batch(tiny_model_dir, n=8)


def _params(trainer: TorchTrainBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_only_the_adapters_train_and_the_reference_is_the_base(tiny_model_dir, batch):
    """A step moves every lora_B (zero at the start) and nothing of the base; Adam holds state for adapters only;
    the reference logprobs (adapters off) stay the base model's after training, while the policy's move."""
    trainer = TorchTrainBackend(tiny_model_dir, TRAIN, AlgorithmConfig(kl_coef=0.1))
    base = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig())
    assert trainer.ref_model is None  # no second copy of the model
    before = _params(trainer)
    assert all(t.abs().max() == 0 for n, t in before.items() if ".lora_B." in n)
    assert torch.allclose(trainer.forward_logprobs(batch), base.forward_logprobs(batch), atol=1e-6)
    trainer.train_step(batch)
    after = _params(trainer)
    adapters = [n for n in after if lora.is_adapter(n)]
    assert len(adapters) == 2 * len(LORA.target_modules) * 2  # A and B per target, 2 layers
    assert all(not torch.equal(before[n], after[n]) for n in adapters if ".lora_B." in n)
    assert all(torch.equal(before[n], after[n]) for n in after if not lora.is_adapter(n))
    state = trainer.optimizer.state
    assert len(state) == len(adapters) and all(p.requires_grad for p in state)
    reference = trainer.forward_logprobs(batch, reference=True)
    assert torch.allclose(reference, base.forward_logprobs(batch), atol=1e-6)
    assert not torch.allclose(trainer.forward_logprobs(batch), reference, atol=1e-3)


def test_checkpoint_resumes_and_exports_peft_and_merged(tiny_model_dir, batch, tmp_path):
    """save() writes the adapters' shards (lora/), Adam's state, a PEFT folder that peft loads onto the base, and
    merged HF weights equal to that PEFT model; load() into a fresh trainer continues bit for bit."""
    trainer = TorchTrainBackend(tiny_model_dir, TRAIN, AlgorithmConfig())
    trainer.train_step(batch)
    trainer.save(tmp_path / "ckpt")
    files = {p.relative_to(tmp_path / "ckpt").parts[0] for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    assert {"lora", "optimizer", "adapter", "model"} <= files
    shard_bytes = sum(f.stat().st_size for f in (tmp_path / "ckpt" / "lora").glob("*.safetensors"))
    assert shard_bytes < sum(f.stat().st_size for f in (tmp_path / "ckpt" / "model").glob("*.safetensors"))

    config = json.loads((tmp_path / "ckpt" / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    ids = batch["input_ids"][:2]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                           str(tmp_path / "ckpt" / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        expected = peft_model(ids).logits
        assert torch.allclose(merged(ids).logits, expected, atol=1e-5)
        assert not torch.allclose(base(ids).logits, expected, atol=1e-4)  # the adapter is not a no-op

    resumed = TorchTrainBackend(tiny_model_dir, TRAIN, AlgorithmConfig())
    resumed.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(_params(trainer).items(), _params(resumed).items(),
                                                             strict=True))
    m1, m2 = trainer.train_step(batch), resumed.train_step(batch)
    assert m1["loss"] == m2["loss"]
    assert all(torch.equal(a, b) for a, b in zip(_params(trainer).values(), _params(resumed).values(), strict=True))


def test_a_full_checkpoint_is_not_a_lora_one(tiny_model_dir, tmp_path):
    TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig()).save(tmp_path / "full")
    with pytest.raises(FileNotFoundError, match=r"no model shards .*/full/lora \(train.lora: a LoRA run resumes"):
        TorchTrainBackend(tiny_model_dir, TRAIN, AlgorithmConfig()).load(tmp_path / "full")


def test_save_adapter_is_the_sync_payload(tiny_model_dir, tmp_path):
    """The adapter transport's payload: a PEFT folder of fp32 adapters (a small share of the model's bytes)."""
    trainer = TorchTrainBackend(tiny_model_dir, TRAIN, AlgorithmConfig())
    nbytes = trainer.save_adapter(str(tmp_path / "a"))
    config, weights = _read(tmp_path / "a")
    assert nbytes == sum(t.numel() * 4 for t in weights.values())
    assert all(k.startswith("base_model.model.model.layers.") for k in weights)
    assert set(config["target_modules"]) == set(LORA.target_modules)
    with pytest.raises(ValueError, match="train.lora is empty"):
        TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig()).save_adapter(str(tmp_path / "b"))


def test_merge_names_a_weight_the_base_lacks(tiny_model_dir, tmp_path):
    trainer = TorchTrainBackend(tiny_model_dir, TRAIN, AlgorithmConfig())
    trainer.save_adapter(str(tmp_path / "a"))
    _, weights = _read(tmp_path / "a")
    renamed = {k.replace("layers.0.", "layers.9."): v for k, v in weights.items()}
    save_file(renamed, str(tmp_path / "a" / WEIGHTS_FILE))
    with pytest.raises(ValueError, match=r"names 'model\.layers\.9\.[a-z_.]+', not a linear module of the model"):
        lora.merge_into_checkpoint(Path(tiny_model_dir), tmp_path / "a", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()  # refused before anything is written


def test_recipe_pairs_lora_with_the_adapter_transport(tmp_path):
    def cfg(**sections):
        return config_from_dict(small_recipe(tmp_path, **sections))

    with pytest.raises(ValueError, match="train.lora: needs weight_sync.transport: adapter"):
        cfg(train={"lora": {"rank": 4}})
    with pytest.raises(ValueError, match="weight_sync.transport: adapter moves LoRA adapters alone"):
        cfg(weight_sync={"transport": "adapter"})
    with pytest.raises(ValueError, match=r"target_modules.*unknown module\(s\) \['qkv'\]"):
        cfg(train={"lora": {"target_modules": ["qkv"]}}, weight_sync={"transport": "adapter"})
    with pytest.raises(ValueError, match="train.lora: LoRA is built on the torch backend"):
        cfg(train={"backend": "megatron", "lora": {}}, weight_sync={"transport": "adapter"})
    ok = cfg(train={"lora": {"rank": 8, "alpha": 16}}, weight_sync={"transport": "adapter"})
    assert ok.train.lora.peft_config()["r"] == 8


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_ranks_train_the_adapters_one_rank_does(tiny_model_dir, batch, ray_cluster, tmp_path, precision):  # noqa: F811
    """FSDP2 over two ranks (Ray actors, gloo): the same adapter update as one rank on the whole batch (bf16: the
    frozen base in bf16 beside fp32 adapters in one FSDP unit), save_adapter gathers the adapters' shards, and
    their checkpoint resumes on one rank."""
    train = TRAIN.model_copy(update={"precision": precision})
    one, two = _ranks(tiny_model_dir, train, 1, "lora-one"), _ranks(tiny_model_dir, train, 2, f"lora-two-{precision}")
    try:
        start = _read(_saved(one, tmp_path / "start"))[1]
        _step(one, batch, 1)
        _step(two, batch, 2)
        single, parallel = (_read(_saved(g, tmp_path / name))[1] for g, name in ((one, "one"), (two, "two")))
        # a checkpoint of the two ranks resumes on one: the adapters' and Adam's shards are read back whole
        two.call(TorchTrainBackend.save, str(tmp_path / "ckpt"))
        resumed = TorchTrainBackend(tiny_model_dir, train, ALGO)
        resumed.load(tmp_path / "ckpt")
        assert resumed.save_adapter(str(tmp_path / "resumed")) > 0
        assert all(torch.equal(a, b) for a, b in zip(_read(tmp_path / "resumed")[1].values(), parallel.values(),
                                                     strict=True))
        assert len(resumed.optimizer.state) == len(parallel)
    finally:
        two.shutdown()  # its actors and placement group: the session test below needs the CPUs
    if precision == "fp32":
        assert_same_update(start, list(single.items()), list(parallel.items()))
    else:  # bf16: an adapter element whose gradient is ~0 gets its sign from bf16 rounding, which the split into
        # shards changes, and Adam's first step moves it by +-lr either way; every other element must agree
        for name, a in single.items():
            off = ((a - parallel[name]).abs() > 1e-2 * (a - start[name]).abs().max() + 1e-7).float().mean()
            assert off <= 0.01, (name, float(off))
    assert any(not torch.equal(start[k], single[k]) for k in single)


def _read(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((folder / CONFIG_FILE).read_text()), load_file(str(folder / WEIGHTS_FILE))


def _saved(group, path: Path) -> Path:
    assert group.call(TorchTrainBackend.save_adapter, str(path))[0] > 0  # rank 0 writes; the others gather
    return path


def _steps(session: RLSession, steps: range) -> list[dict]:
    out = []
    for step in steps:
        m = {}
        for stage in (session.rollout, session.reward, session.advantages, session.train, session.sync_weights):
            m |= stage(step)
        out.append({k: v for k, v in m.items() if not (k.startswith("time/") or k.endswith("per_s"))})  # clocks
    return out


def test_a_lora_run_moves_only_the_adapter_and_resumes_exactly(tmp_path, monkeypatch):
    """A LoRA run with Ray workers (train rank and embedded rollout worker in their own actors): each sync moves
    the adapter alone (a small share of the weights' bytes) and stamps its version on the next samples; the
    rollout engine's weights are then the base with that adapter merged, the same numbers as the checkpoint's
    merged model/; a session resumed from the checkpoint pushes that checkpoint's adapter, not fresh ones
    first, and runs the next step exactly as the uninterrupted one."""
    raw = small_recipe(tmp_path, train={"steps": 3, "threads": 1, "lr": 5e-2, "lora": {"rank": 4, "alpha": 8}},
                       weight_sync={"transport": "adapter", "disk_dir": str(tmp_path / "sync")}, eval={"every": 0},
                       cluster={"use_ray": True, "num_cpus": 2, "cpus_per_worker": 0.5})
    cfg = config_from_dict(raw)
    prepare_data(cfg)
    model = prepare_model(cfg, tmp_path)
    session = RLSession.create(cfg, model, use_ray=True)
    try:
        first = _steps(session, range(2))
        assert [m["sync/weight_version"] for m in first] == [1.0, 2.0]
        assert list(session.rollout_batch(1).weight_version) == [1] * 32  # generated with the adapter of step 0
        full = sum(t.numel() * 4 for _, t in session.train_group.call_rank0(TorchTrainBackend.named_tensors))
        assert 0 < first[1]["sync/bytes"] < full / 5
        state = session.save(tmp_path / "ckpt", 1)
        served = dict(session.rollout_group.call_rank0(TorchRolloutBackend.named_tensors))
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model").state_dict()
        assert all(torch.equal(served[n], merged[n]) for n in served)
        assert not torch.equal(served["model.layers.0.self_attn.q_proj.weight"],
                               AutoModelForCausalLM.from_pretrained(model).state_dict()[
                                   "model.layers.0.self_attn.q_proj.weight"])
        uninterrupted = _steps(session, range(2, 3))
    finally:
        session.shutdown()
    pushed = []  # versions the adapter transport pushes from here on
    transport = type(session.weight_transport)
    real_push = transport.push
    monkeypatch.setattr(transport, "push", lambda self, version: pushed.append(version) or real_push(self, version))
    resumed = RLSession.create(cfg, model, use_ray=True)
    try:
        resumed.load(tmp_path / "ckpt", state)
        assert _steps(resumed, range(2, 3)) == uninterrupted
        assert pushed == [2, 3]  # the checkpoint's adapter, then step 2's sync
    finally:
        resumed.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_lora_reaches_the_demo_bar(tmp_path):
    """deployments/sort-tiny-lora.yaml: from sort-tiny's model after 30 SFT steps (held-out reward 0.81), GRPO on
    rank-16 adapters alone reaches the demo's bar, held-out reward >= 0.95, within 40 steps. Measured (seed 0,
    2 cores): 0.82 / 0.91 / 0.97 / 0.98 at steps 10 / 20 / 30 / 40, 1.0 at step 100; ~50 s."""
    data = [f"data.train_path={tmp_path}/data/train.jsonl", f"data.eval_path={tmp_path}/data/eval.jsonl"]
    sft = load_recipe("deployments/sort-tiny-sft.yaml", [*data, f"sft.train_path={tmp_path}/data/sft.jsonl",
                                                         "sft.steps=30", "cluster.use_ray=false"])
    run_sft_bare(sft, tmp_path / "random", tmp_path / "sft")
    cfg = load_recipe("deployments/sort-tiny-lora.yaml", [
        *data, f"model.path={tmp_path}/sft/model", "train.steps=40", "checkpoint.every=0", "cluster.use_ray=false",
        f"weight_sync.disk_dir={tmp_path}/sync"])
    history = run_bare(cfg, str(tmp_path), log=lambda line: None)
    evals = [m["eval/reward_mean"] for m in history if "eval/reward_mean" in m]
    print("eval/reward_mean", evals)
    assert evals[0] < 0.9 and max(evals) >= 0.95, evals
    assert all(m["sync/bytes"] == history[0]["sync/bytes"] for m in history)  # the adapter, every step


def test_the_lora_recipe_validates():
    """deployments/sort-tiny-lora.yaml: LoRA on every linear, the adapter transport; its base model (made by SFT, see
    the recipe's header) is missing on this machine, which preflight names."""
    cfg = load_recipe("deployments/sort-tiny-lora.yaml")
    assert cfg.train.lora.target_modules == list(LORA_TARGETS) and cfg.weight_sync.transport == "adapter"
    assert any("model.path" in p for p in find_problems(cfg))


def test_checkpoint_through_the_run_store(tiny_model_dir, batch, tmp_path):
    """save(storage=...) (how workers write on object storage; fsspec on a local folder here): the adapters' shards,
    the PEFT folder and the merged model go into the store's checkpoint folder, and load(storage=...) resumes."""
    storage = StorageConfig(uri=str(tmp_path / "store"))
    uri = f"{tmp_path}/store/r/checkpoints/1"
    trainer = TorchTrainBackend(tiny_model_dir, TRAIN, AlgorithmConfig())
    trainer.train_step(batch)
    trainer.save(uri, storage)
    folder = Path(uri)
    assert (folder / "adapter" / CONFIG_FILE).is_file() and any((folder / "lora").glob("*.safetensors"))
    trainer.save(tmp_path / "local")  # the same state saved to a local folder: the same merged weights
    stored = load_file(str(folder / "model" / "model.safetensors"))
    local = load_file(str(tmp_path / "local" / "model" / "model.safetensors"))
    assert stored.keys() == local.keys() and all(torch.equal(t, local[n]) for n, t in stored.items())
    resumed = TorchTrainBackend(tiny_model_dir, TRAIN, AlgorithmConfig())
    resumed.load(uri, storage)
    assert all(torch.equal(a, b) for a, b in zip(_params(trainer).values(), _params(resumed).values(), strict=True))
