"""The native trainer with images (docs/multimodal.md, item 6): a tiny Qwen2-VL's packed forward equals
transformers' padded one, log-probs and gradients; train.freeze_vision keeps the vision tower out of training and
of weight syncs (and lets it train when off); the FSDP2 units; Megatron refused for a vision-language model."""

from __future__ import annotations

import io

import pytest
import torch
import torch.multiprocessing as mp
from PIL import Image
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import FSDPModule

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.batch import IMAGE_IDS, image_ids, select
from rlflow.engines.core.config import AlgorithmConfig, ModelConfig, StorageConfig, TrainConfig, config_from_dict
from rlflow.engines.models.hf import build_tiny_model, load_model
from rlflow.engines.models.packed import PackedLM, PackedRows
from rlflow.engines.models.vision_language import VisionProcessor, open_image
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.train import fsdp
from rlflow.engines.train.torch_backend import TorchTrainBackend
from rlflow.engines.train.vision import ImageInputs
from tests.conftest import assert_same_update, small_recipe
from tests.spawned_ranks import end_ranks

RUN = "vl"
TINY_VL = ModelConfig(arch="qwen2_vl", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_seq_len=256)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(TINY_VL, tmp_path_factory.mktemp("vl") / "model", seed=0))


def _png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    image = Image.new("RGB", size, color)
    image.paste((255 - color[0], color[1], 40), (5, 7, size[0] // 2, size[1] // 2))  # not uniform: patches differ
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl_batch(vl_dir, tmp_path_factory):
    """Three rows with 1, 2 (the first one's image again, and another) and 0 images, of different lengths, right
    padded; the images in a run store. Returns (batch, storage, per-row image bytes)."""
    storage = StorageConfig(uri=str(tmp_path_factory.mktemp("store")))
    store = RunStore(storage, RUN)
    red, blue = _png((60, 90), (200, 30, 30)), _png((112, 56), (20, 40, 220))
    images = [[red], [red, blue], []]
    vp = VisionProcessor(vl_dir)
    generator = torch.Generator().manual_seed(3)
    rows, digests = [], []
    for k, (imgs, response) in enumerate(zip(images, (5, 9, 3), strict=True)):
        parts = [{"type": "image"}] * len(imgs) + [{"type": "text", "text": "ab" * (k + 1)}]
        prompt = vp.encode([{"role": "user", "content": parts}], [open_image(b) for b in imgs]).prompt_ids
        out = torch.randint(3, 12, (response,), generator=generator).tolist()  # character tokens, no image pad
        rows.append(prompt + out)
        digests.append([store.put_image(b) for b in imgs])
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    loss_mask = torch.zeros(len(rows), width)
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = torch.tensor(row), 1
        loss_mask[r, len(row) - 4:len(row)] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask, IMAGE_IDS: image_ids(digests),
             "old_logprobs": torch.zeros(len(rows), width), "advantages": torch.tensor([1.0, -0.5, 0.7])}
    return batch, storage, images


def _reference(model, vp: VisionProcessor, batch, images) -> torch.Tensor:
    """transformers' padded forward of the batch: log p(x_t | x_<t) [rows, width] (column 0 and padding 0)."""
    flat = [open_image(b) for row in images for b in row]
    pixels = vp.pixel_inputs(flat)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    mm_types = ((ids == vp.image_token_id) & mask.bool()).int()
    logits = model(input_ids=ids, attention_mask=mask, pixel_values=pixels["pixel_values"],
                   image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=mm_types).logits
    logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(logp, (1, 0)) * mask


def test_packed_equals_padded_with_images(vl_dir, vl_batch):
    """PackedLM's log-probs of a 3-row micro-batch with images equal transformers' padded forward (fp32, 1e-5), and
    so do the gradients of every parameter (vision tower included: it trains through the placed embeddings). The
    shared image is processed once."""
    batch, storage, images = vl_batch
    ours, theirs = load_model(vl_dir), load_model(vl_dir)
    lm = PackedLM(ours)
    source = ImageInputs(vl_dir, RunStore(storage, RUN))
    packed = source.attach(PackedRows.from_padded(batch["input_ids"], batch["attention_mask"]), batch[IMAGE_IDS])
    assert source.processed == 2 and packed.images.order == [0, 0, 1]
    logprobs, _ = lm(packed)
    logprobs = packed.unpack(logprobs)
    expected = _reference(theirs, source.processor, batch, images)
    assert (logprobs - expected).abs().max() <= 1e-5
    weights = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(0)) * batch["loss_mask"]
    (logprobs * weights).sum().backward()
    (expected * weights).sum().backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs_params[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    assert ours.lm_head.weight.grad.abs().sum() > 0 and ours.model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def test_positions_follow_mrope_then_delta(vl_dir, vl_batch):
    """The stream's M-RoPE positions restart per sample; after a sample's last image its text positions are
    index + delta on all three components, and a row without images has plain positions."""
    batch, storage, _ = vl_batch
    source = ImageInputs(vl_dir, RunStore(storage, RUN))
    packed = source.attach(PackedRows.from_padded(batch["input_ids"], batch["attention_mask"]), batch[IMAGE_IDS])
    bounds = packed.cu_seqlens.tolist()
    for r in range(3):
        pos = packed.mrope[:, bounds[r]:bounds[r + 1]]
        assert pos[:, 0].tolist() == [0, 0, 0]
        assert (pos[:, -4:] == pos[0, -4:]).all()  # the response: one position on all three components
        assert (pos[0, -4:].diff() == 1).all()
    plain = packed.mrope[:, bounds[2]:bounds[3]]
    assert (plain == torch.arange(plain.shape[1])).all()
    assert int(packed.mrope[0, bounds[1] - 1]) < bounds[1] - bounds[0] - 1  # image rows: delta < 0 here


def _backend(vl_dir, storage, **train) -> TorchTrainBackend:
    config = TrainConfig(threads=1, lr=1e-2, **train)
    return TorchTrainBackend(vl_dir, config, AlgorithmConfig(), storage=storage, run=RUN)


def _local(backend: TorchTrainBackend) -> dict[str, torch.Tensor]:
    return {n: fsdp.local(p).detach().clone() for n, p in backend.model.named_parameters()}


@pytest.mark.parametrize("micro_batch_size", [3, 1])
def test_backend_logprobs_equal_reference(vl_dir, vl_batch, micro_batch_size):
    """The train worker's forward_logprobs (FSDP2 over one gloo rank, images read from the run store) equals the
    reference, in one micro-batch or one row each (a micro-batch without images runs the blank image)."""
    batch, storage, images = vl_batch
    backend = _backend(vl_dir, storage, micro_batch_size=micro_batch_size)
    expected = _reference(load_model(vl_dir), VisionProcessor(vl_dir), batch, images)
    assert (backend.forward_logprobs(batch) - expected).abs().max() <= 1e-5


def test_freeze_vision_trains_and_syncs_the_language_model_only(vl_dir, vl_batch):
    """train.freeze_vision (the default): after a train step the vision tower has no gradients, is not in the
    optimizer and is unchanged, the language model changed, and a weight sync names no vision weight. The FSDP2
    units: each vision block, the tower, each decoder layer."""
    batch, storage, _ = vl_batch
    backend = _backend(vl_dir, storage)
    visual = backend.model.model.visual
    assert all(isinstance(m, FSDPModule) for m in [*visual.blocks, visual, *backend.model.model.language_model.layers])
    before = _local(backend)
    backend.train_step(batch)
    after = _local(backend)
    optimized = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    for name, p in backend.model.named_parameters():
        if name.startswith("model.visual."):
            assert p.grad is None and not p.requires_grad and id(p) not in optimized, name
            assert torch.equal(before[name], after[name]), name
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    layout = [n for n, _ in backend.weight_layout()]
    sent = [n for n, _ in backend.named_tensors()]
    assert layout == sent and "lm_head.weight" in sent
    assert not [n for n in sent if "visual" in n]


def test_frozen_vision_checkpoint_resumes_exactly(vl_dir, vl_batch, tmp_path):
    """A checkpoint whose optimizer state has no vision tower loads, and the next step is the same."""
    batch, storage, _ = vl_batch
    first = _backend(vl_dir, storage)
    first.train_step(batch)
    first.save(tmp_path / "ckpt")
    resumed = _backend(vl_dir, storage)
    resumed.load(tmp_path / "ckpt")
    assert first.train_step(batch)["loss"] == resumed.train_step(batch)["loss"]
    ours, theirs = dict(first.named_tensors()), dict(resumed.named_tensors())
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_trained_vision_changes_and_is_synced(vl_dir, vl_batch):
    """train.freeze_vision false: the vision tower trains and every one of its weights is sent, as trained."""
    batch, storage, _ = vl_batch
    backend = _backend(vl_dir, storage, freeze_vision=False)
    before = _local(backend)
    backend.train_step(batch)
    sent = dict(backend.named_tensors())
    vision = [n for n in before if n.startswith("model.visual.")]
    assert vision and set(vision) <= set(sent)
    for name in ("model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.mlp.2.weight"):
        assert not torch.equal(before[name], sent[name]), name


def test_image_ids_on_a_text_model_are_refused(tiny_model_dir, vl_batch):
    batch, storage, _ = vl_batch
    backend = TorchTrainBackend(tiny_model_dir, TrainConfig(threads=1), AlgorithmConfig(), storage=storage, run=RUN)
    text = {**batch, "input_ids": batch["input_ids"].clamp(max=10)}
    with pytest.raises(ValueError, match="image_ids: the batch has images, but the model at .* is not a vision-lang"):
        backend.forward_logprobs(text)


def test_missing_image_is_named(vl_dir, vl_batch, tmp_path):
    """A digest the run store does not hold: the error names it."""
    batch, _, _ = vl_batch
    backend = _backend(vl_dir, StorageConfig(uri=str(tmp_path)))
    with pytest.raises(Exception, match=f"image {bytes(batch[IMAGE_IDS][0, 0].tolist()).hex()} is not in the run"):
        backend.forward_logprobs(batch)


def test_megatron_is_refused_for_a_vision_language_model(vl_dir, tmp_path):
    raw = small_recipe(tmp_path, model={"path": vl_dir}, train={"backend": "megatron", "steps": 1, "threads": 1})
    with pytest.raises(ValueError, match="train.backend megatron: model.path .* is a vision-language model"):
        config_from_dict(raw)
    built = small_recipe(tmp_path, model={**raw["model"], "path": "", "arch": "qwen2_vl"},
                         train={"backend": "megatron", "steps": 1, "threads": 1})
    with pytest.raises(ValueError, match="vision tower has no mapping"):
        config_from_dict(built)
    config_from_dict(small_recipe(tmp_path, model={"path": vl_dir}))  # the torch backend takes it


def two_rank_worker(rank: int, world: int, url: str, model_dir: str, store_uri: str, out: str, freeze: bool) -> None:
    """One of 2 FSDP2 ranks: rank 0 trains on the rows with images, rank 1 on rows without any; rank 0 writes the
    updated weights."""
    batch = load_file(f"{out}/batch.safetensors")
    shard = select(batch, torch.tensor([0, 1] if rank == 0 else [2, 3]))
    train = TrainConfig(threads=1, lr=1e-2, freeze_vision=freeze)
    backend = TorchTrainBackend(model_dir, train, AlgorithmConfig(), rank=rank, world_size=world, dist_url=url,
                                storage=StorageConfig(uri=store_uri), run=RUN)
    backend.train_step(shard)
    weights = dict(backend.named_tensors())
    if rank == 0:
        save_file({n: t.contiguous() for n, t in weights.items()}, f"{out}/two.safetensors")
    end_ranks()


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "trained"])
def test_two_ranks_one_without_images_equal_one_rank(vl_dir, vl_batch, tmp_path, freeze):
    """2 gloo ranks, one with every image and one with none, take the step 1 rank takes on the whole batch: the
    rank without images still gathers (and, trained, reduces) the vision units, so nothing hangs."""
    batch, storage, _ = vl_batch
    four = {k: torch.cat([v, v[2:3]]) for k, v in batch.items()}  # rows 0, 1 have images; 2, 3 none
    save_file({k: v.contiguous() for k, v in four.items()}, tmp_path / "batch.safetensors")
    mp.spawn(two_rank_worker, args=(2, f"tcp://127.0.0.1:{free_port()}", vl_dir, storage.uri, str(tmp_path), freeze),
             nprocs=2)
    one = _backend(vl_dir, storage, freeze_vision=freeze)
    start = {n: t.clone() for n, t in one.named_tensors()}
    one.train_step(four)
    expected, got = one.named_tensors(), load_file(tmp_path / "two.safetensors")
    assert sorted(n for n, _ in expected) == sorted(got)
    assert_same_update(start, expected, [(n, got[n]) for n, _ in expected])
