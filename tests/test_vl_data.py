"""Vision-language data (docs/multimodal.md, items 1, 2, 3 and 5): verl's and TRL's image rows read as their bytes,
the named errors, images stored once by digest, RolloutBatch's image digests through the Arrow schema into the
train batch, and prompts of a tiny Qwen2-VL encoded with one pad token per merged patch."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from rlflow.engines.core.batch import IMAGE_IDS, ROLLOUT_SCHEMA, RolloutBatch, image_digests
from rlflow.engines.core.config import EvalSamplingConfig, StorageConfig
from rlflow.engines.data.prompts import DataError, load_prompts
from rlflow.engines.models import vision_language
from rlflow.engines.models.hf import load_tokenizer
from rlflow.engines.models.vision_language import IMAGE_PAD, VisionProcessor
from rlflow.engines.rollout.functions import PromptSample, Sample
from rlflow.engines.session.evaluation import generate_and_reward
from rlflow.engines.session.stages.prompting import prompt_samples
from rlflow.engines.store.run_store import RunStore


def picture(color: str, size: tuple[int, int] = (60, 60), fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, fmt)
    return buf.getvalue()


RED, BLUE, GREEN = picture("red"), picture("blue"), picture("green", (84, 56), "JPEG")


def verl_rows(images: list[list[dict]]) -> dict[str, list]:
    """verl's geo3k layout: chat prompt with `<image>` markers, images, reward_model.ground_truth."""
    return {
        "prompt": [[{"role": "user", "content": "<image>How many sides?"}] for _ in images],
        "images": images,
        "reward_model": [{"ground_truth": str(i), "style": "rule"} for i in range(len(images))],
        "data_source": ["geo3k"] * len(images),
    }


def test_verl_parquet_from_datasets_image_feature(tmp_path: Path) -> None:
    """A parquet file written by datasets with Sequence(Image()): rows hold the images' bytes as given."""
    import datasets  # seconds to import: only the tests that write with it

    ds = datasets.Dataset.from_dict(verl_rows([[{"bytes": RED, "path": None}], [{"bytes": GREEN, "path": "g.jpg"}]]))
    ds.cast_column("images", datasets.Sequence(datasets.Image())).to_parquet(str(tmp_path / "train.parquet"))
    rows = load_prompts(str(tmp_path / "train.parquet"))
    assert [r["images"] for r in rows] == [[RED], [GREEN]]  # not decoded and re-encoded: the bytes as stored
    assert rows[1]["label"] == "1" and rows[1]["prompt"] == "<image>How many sides?"
    assert "images" not in rows[0]["meta"] and rows[0]["meta"]["data_source"] == "geo3k"


def test_verl_parquet_from_pyarrow_with_relative_path(tmp_path: Path, monkeypatch) -> None:
    """A struct column written by pyarrow; an image given by a path is read relative to the data file's folder."""
    (tmp_path / "data" / "imgs").mkdir(parents=True)
    (tmp_path / "data" / "imgs" / "b.png").write_bytes(BLUE)
    table = pa.Table.from_pydict(verl_rows([[{"bytes": RED, "path": None}, {"bytes": None, "path": "imgs/b.png"}]]))
    table = table.set_column(0, "prompt", pa.array([[{"role": "user", "content": "<image> and <image>?"}]]))
    pq.write_table(table, str(tmp_path / "data" / "train.parquet"))
    monkeypatch.chdir(tmp_path)  # the path is the file's folder's, not the working directory's
    [row] = load_prompts(str(tmp_path / "data" / "train.parquet"))
    assert row["images"] == [RED, BLUE]


def test_trl_image_and_images_columns(tmp_path: Path) -> None:
    """TRL: one `image` (Image feature) with a plain prompt; `images` with content-part messages."""
    import datasets  # seconds to import: only the tests that write with it

    one = datasets.Dataset.from_dict({"prompt": ["What color?"], "completion": ["red"],
                                      "image": [{"bytes": RED, "path": None}]})
    one.cast_column("image", datasets.Image()).to_parquet(str(tmp_path / "one.parquet"))
    [row] = load_prompts(str(tmp_path / "one.parquet"))
    assert row["images"] == [RED] and row["label"] == "red" and row["prompt"] == "What color?"
    assert "messages" not in row and "image" not in row["meta"]

    parts = [{"type": "image", "text": None}, {"type": "text", "text": "Which is bigger?"},
             {"type": "image", "text": None}]
    many = pa.Table.from_pydict({"prompt": [[{"role": "user", "content": parts}]], "completion": ["left"],
                                 "images": [[{"bytes": RED, "path": None}, {"bytes": BLUE, "path": None}]]})
    pq.write_table(many, str(tmp_path / "many.parquet"))
    [row] = load_prompts(str(tmp_path / "many.parquet"))
    assert row["images"] == [RED, BLUE] and row["prompt"] == "Which is bigger?"
    content = [{"type": "image"}, {"type": "text", "text": "Which is bigger?"}, {"type": "image"}]
    assert row["messages"] == [{"role": "user", "content": content}]  # the nulls of the column union dropped


def test_jsonl_with_image_paths(tmp_path: Path) -> None:
    (tmp_path / "red.png").write_bytes(RED)
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "<image>color?", "label": "red",
                                                      "images": ["red.png"]}) + "\n")
    [row] = load_prompts(str(tmp_path / "train.jsonl"))
    assert row["images"] == [RED]


def test_text_rows_have_no_images(tmp_path: Path) -> None:
    """A text file mentioning `<image>` has no image column: its text is text."""
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": "what does <image> mean in HTML?", "label": "x"}) + "\n")
    [row] = load_prompts(str(tmp_path / "t.jsonl"))
    assert "images" not in row and row["prompt"] == "what does <image> mean in HTML?"


def test_images_on_object_storage(s3_bucket, tmp_path: Path) -> None:
    import s3fs  # only the object-storage test needs it (and its moto server)

    root, endpoint = s3_bucket
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    fs.pipe_file(f"{root}/data/imgs/b.png", BLUE)
    with fs.open(f"{root}/data/train.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pydict(verl_rows([[{"bytes": None, "path": "imgs/b.png"}]])), f)
    url = f"{root}/data/train.parquet"
    options = StorageConfig(uri=str(tmp_path), endpoint_url=endpoint).fsspec_options(url)
    [row] = load_prompts(url, storage_options=options)
    assert row["images"] == [BLUE]


def write_verl(tmp_path: Path, images: list[list[dict]], prompt: str = "<image>How many sides?") -> str:
    table = pa.Table.from_pydict(verl_rows(images))
    table = table.set_column(0, "prompt", pa.array([[{"role": "user", "content": prompt}]] * len(images)))
    path = str(tmp_path / "train.parquet")
    pq.write_table(table, path)
    return path


def test_missing_image_file_is_named(tmp_path: Path) -> None:
    path = write_verl(tmp_path, [[{"bytes": RED, "path": None}], [{"bytes": None, "path": "gone.png"}]])
    with pytest.raises(DataError, match=rf"{path}: row 2: \"images\" item 0: image file not found: "
                                        rf"{tmp_path}/gone.png"):
        load_prompts(path)


def test_unreadable_image_is_named(tmp_path: Path) -> None:
    path = write_verl(tmp_path, [[{"bytes": b"not an image", "path": None}]])
    with pytest.raises(DataError, match=rf"{path}: row 1: \"images\" item 0: 12 bytes that PIL cannot read"):
        load_prompts(path)
    truncated = write_verl(tmp_path, [[{"bytes": RED[:-20], "path": None}]])  # the header reads, the data not
    with pytest.raises(DataError, match="row 1: .* PIL cannot read"):
        load_prompts(truncated)


def test_more_placeholders_than_images_is_named(tmp_path: Path) -> None:
    path = write_verl(tmp_path, [[{"bytes": RED, "path": None}]], prompt="<image> vs <image>")
    with pytest.raises(DataError, match=rf"{path}: row 1: the prompt has 2 image placeholders .* for 1 images"):
        load_prompts(path)


def test_image_larger_than_max_image_pixels_is_named(tmp_path: Path) -> None:
    path = write_verl(tmp_path, [[{"bytes": GREEN, "path": None}]])  # 84 x 56
    assert load_prompts(path, max_image_pixels=84 * 56)[0]["images"] == [GREEN]
    with pytest.raises(DataError, match=rf"{path}: row 1: .*84x56 = 4704 pixels, more than "
                                        r"data.max_image_pixels = 4000"):
        load_prompts(path, max_image_pixels=4000)


# ---- RolloutBatch and the train batch ---------------------------------------------------------------------
def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_batch() -> RolloutBatch:
    prompts = [PromptSample(index=0, prompt="a", label="x", prompt_ids=[1, 2], n=2, seed=0,
                            images=[digest(RED), digest(BLUE)]),
               PromptSample(index=1, prompt="b", label="y", prompt_ids=[1, 3], n=1, seed=2),  # a text prompt
               PromptSample(index=2, prompt="c", label="z", prompt_ids=[1, 4], n=1, seed=3, images=[digest(RED)])]
    groups = [[Sample([5], logprobs=[-0.5]), Sample([6, 7], logprobs=[-0.1, -0.2])], [Sample([8], logprobs=[-1.0])],
              [Sample([9], logprobs=[-2.0])]]
    return RolloutBatch.from_samples(prompts, groups)


def test_rollout_batch_images_round_trip() -> None:
    b = image_batch()
    assert b.images == [[digest(RED), digest(BLUE)]] * 2 + [[], [digest(RED)]]
    table = b.to_arrow()
    assert table.schema.remove_metadata() == ROLLOUT_SCHEMA
    back = RolloutBatch.from_arrow(table)
    assert back.images == b.images
    assert b.select([3, 0]).images == [[digest(RED)], [digest(RED), digest(BLUE)]]
    assert b.with_rewards(["r"] * 4, [1.0] * 4).images == b.images


def test_text_batches_and_old_tables_have_no_images() -> None:
    text = RolloutBatch.from_samples([PromptSample(index=0, prompt="a", label="x", prompt_ids=[1], n=1, seed=0)],
                                     [[Sample([5], logprobs=[-0.5])]])
    assert text.images is None
    assert text.to_arrow().column("images").to_pylist() == [[]]
    assert IMAGE_IDS not in text.to_train_batch(0, torch.zeros(1))
    old = image_batch().to_arrow().drop_columns(["images"])  # written before the column existed
    assert RolloutBatch.from_arrow(old).images is None


def test_rollout_batch_refuses_a_name_that_is_no_digest() -> None:
    bad = PromptSample(index=0, prompt="a", label="x", prompt_ids=[1], n=1, seed=0, images=["red.png"])
    with pytest.raises(ValueError, match="images of sample 0: 'red.png' is not a sha256 hex digest"):
        RolloutBatch.from_samples([bad], [[Sample([5])]])


def test_train_batch_image_ids() -> None:
    b = image_batch()
    batch = b.to_train_batch(0, torch.zeros(4))
    ids = batch[IMAGE_IDS]
    assert ids.dtype == torch.uint8 and ids.shape == (4, 2, 32)
    assert bytes(ids[0, 1].tolist()) == hashlib.sha256(BLUE).digest()
    assert ids[2].eq(0).all() and ids[3, 1].eq(0).all()  # a text sample, and past the last image: zero rows
    assert image_digests(ids) == b.images
    assert image_digests(ids[torch.tensor([3, 1])]) == [[digest(RED)], [digest(RED), digest(BLUE)]]


# ---- prompts of a vision-language model -------------------------------------------------------------------
def session(model_dir: str, store: RunStore | None, rows: list[dict]) -> SimpleNamespace:
    """The part of RunEngines prompt_samples reads. A real RunEngines starts train and rollout workers and loads
    the data files; prompting needs only its tokenizer, processor, store and settings, as RunEngines builds them."""
    tok = load_tokenizer(model_dir)
    vision = VisionProcessor(model_dir, tok) if vision_language.is_vision_language(model_dir) else None
    cfg = SimpleNamespace(algorithm=SimpleNamespace(routing_replay="off"),
                          data=SimpleNamespace(chat_template=False, train_path="train.parquet", eval_path=None))
    return SimpleNamespace(cfg=cfg, model_path=model_dir, tokenizer=tok, fn_tokenizer=tok, vision=vision,
                           image_store=store, stored_images=set(), tokenizer_lock=threading.Lock(),
                           context_len=256, context_source="model.max_seq_len",
                           prompts=SimpleNamespace(rows=rows), eval_rows=[])


def test_prompt_samples_of_a_vision_language_model(tiny_vl_dir: str, tmp_path: Path) -> None:
    store = RunStore(str(tmp_path / "store"), "run")
    rows = [{"prompt": "<image>count?", "label": "1", "meta": {}, "images": [RED],
             "messages": [{"role": "user", "content": "<image>count?"}]},
            {"prompt": "again", "label": "1", "meta": {}, "images": [RED, GREEN]},  # a plain prompt: one user turn
            {"prompt": "text only", "label": "0", "meta": {}}]
    s = session(tiny_vl_dir, store, rows)
    samples = prompt_samples(s, rows, n=2, seed=0)
    pad = s.vision.image_token_id
    grids = [s.vision.grids([vision_language.open_image(x) for x in r.get("images", [])]) for r in rows]
    for sample, g in zip(samples, grids, strict=True):
        assert sample.prompt_ids.count(pad) == sum(s.vision.tokens_per_image(x) for x in g)
    assert samples[0].prompt_ids.count(pad) == 4  # 60 x 60 resized to 56 x 56: 4 x 4 patches, merged 2 x 2
    assert samples[1].images == [digest(RED), digest(GREEN)] and samples[2].images == []
    assert samples[1].image_data[1].startswith("data:image/jpeg;base64,")
    assert base64.b64decode(samples[0].image_data[0].split(",", 1)[1]) == RED
    assert samples[0].image_data[0].startswith("data:image/png;base64,")
    assert samples[2].prompt_ids == s.tokenizer("text only")["input_ids"]  # a text row: as a text model's
    assert IMAGE_PAD not in s.tokenizer.decode(samples[2].prompt_ids)
    # stored once by content: RED is in two prompts (and taken again next step, and by a resumed session), one
    # object, written once
    writes = []
    write = store.write_bytes
    store.write_bytes = lambda data, *parts: (writes.append(parts), write(data, *parts))[1]
    prompt_samples(s, rows, n=2, seed=4)
    prompt_samples(session(tiny_vl_dir, store, rows), rows, n=2, seed=4)
    listed = [p.rsplit("/", 1)[-1] for p in store.fs.ls(store.path("images"), detail=False)]
    assert sorted(listed) == sorted({digest(RED), digest(GREEN)}) and writes == []
    assert store.get_image(digest(GREEN)) == GREEN


def test_images_for_a_text_model_are_refused(tiny_model_dir: str) -> None:
    rows = [{"prompt": "<image>count?", "label": "1", "meta": {}, "images": [RED]}]
    s = session(tiny_model_dir, None, rows)
    with pytest.raises(DataError, match=rf"train.parquet: row 1: the row has 1 image\(s\), but model.path "
                                        rf"{tiny_model_dir} is not a vision-language model"):
        prompt_samples(s, rows, n=1, seed=0)


def test_the_evaluate_flow_generates_with_the_rows_images(tiny_vl_dir: str, tiny_model_dir: str) -> None:
    """The evaluate flow's shard encodes an image row as the rollout does and sends its pictures to the engine:
    the rewarded tokens are those the engine generates for those ids and pictures; a text model refuses the rows."""
    from rlflow.engines.core.sampling import SamplingParams
    from rlflow.engines.models.hf import decode_responses
    from rlflow.engines.models.vision_language import encode_row
    from rlflow.engines.rollout.torch_backend import TorchRolloutBackend

    rows = [{"prompt": "<image>count?", "label": "1", "meta": {}, "images": [RED]},
            {"prompt": "<image>count?", "label": "1", "meta": {}, "images": [GREEN]},
            {"prompt": "text only", "label": "0", "meta": {}}]
    cfg = EvalSamplingConfig(samples_per_prompt=2, temperature=1.0, seed=5)
    engine = TorchRolloutBackend(tiny_vl_dir, batch_size=8, context_len=128)
    seen: list[str] = []

    def reward(prompts, responses, labels, **kw):  # records what was generated
        seen.extend(responses)
        return [0.0] * len(prompts)

    try:
        out = generate_and_reward(engine, reward, {}, "geo", rows, 0, cfg, 6)
        ids = encode_row(VisionProcessor(tiny_vl_dir, engine.tokenizer), rows[1], [GREEN])
        direct = engine.generate([ids] * 2, SamplingParams(max_new_tokens=6, temperature=1.0), seed=5,
                                 first_index=2, image_data=[[GREEN]] * 2)
    finally:
        engine.close()
    assert len(out["rewards"]) == 6
    assert out["lengths"][2:4] == [len(g.output_ids) for g in direct]
    expected = decode_responses(engine.tokenizer, [g.output_ids for g in direct],
                                [g.finish_reason["type"] == "stop" for g in direct])
    assert seen[2:4] == expected
    text = TorchRolloutBackend(tiny_model_dir, batch_size=2, context_len=64)
    try:
        with pytest.raises(ValueError, match="evaluation dataset geo: its rows have images, and the model at"):
            generate_and_reward(text, None, {}, "geo", rows[:1], 0, EvalSamplingConfig(), 8)
    finally:
        text.close()


def test_trl_conversational_rows_with_image_parts(tmp_path: Path) -> None:
    """TRL `messages` rows whose turns are content parts: the last assistant turn's text is the label."""
    user = [{"type": "image", "text": None}, {"type": "text", "text": "Color?"}]
    answer = [{"type": "text", "text": "red"}]
    table = pa.Table.from_pydict({"messages": [[{"role": "user", "content": user},
                                                {"role": "assistant", "content": answer}]],
                                  "images": [[{"bytes": RED, "path": None}]]})
    pq.write_table(table, str(tmp_path / "conv.parquet"))
    [row] = load_prompts(str(tmp_path / "conv.parquet"))
    assert row["label"] == "red" and row["prompt"] == "Color?" and row["images"] == [RED]
    assert row["messages"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}]


def test_a_carried_group_keeps_digests_not_bytes_and_reads_the_images_back(tmp_path: Path) -> None:
    """Dynamic sampling's carry (a checkpoint's state) names a VL prompt's images by digest only: JSON without the
    bytes or data URIs, and from_json reads them back from the run store."""
    from rlflow.engines.models.vision_language import data_uri
    from rlflow.engines.rollout.dynamic_sampling import Carry

    store = RunStore(StorageConfig(uri=str(tmp_path)), "run")
    data = RED
    digest = store.put_image(data)
    prompt = PromptSample(index=0, prompt="<image>=", label="1", prompt_ids=[1, 2], n=2, seed=0,
                          row={"prompt": "<image>=", "label": "1", "images": [data]}, images=[digest],
                          image_data=[data_uri(data)])
    text = json.dumps(Carry(prompt, []).to_json())
    assert digest in text and "base64" not in text and len(text) < 1000
    back = Carry.from_json(json.loads(text), None, store.get_image).prompt
    assert back.images == [digest] and back.row["images"] == [data] and back.image_data == [data_uri(data)]
    with pytest.raises(ValueError, match="no image store"):
        Carry.from_json(json.loads(text), None)


def test_content_parts_with_fewer_image_parts_than_images_put_the_rest_first(tiny_vl_dir: str) -> None:
    """A TRL row whose content parts place no image (the data layer accepts it: TRL puts the images first) is
    encoded with its image first in the first user message, not refused at its step."""
    from rlflow.engines.models.vision_language import encode_row, messages_with_images

    messages = [{"role": "user", "content": [{"type": "text", "text": "Color?"}]}]
    placed = messages_with_images(messages, 1)
    assert placed[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Color?"}]
    processor = VisionProcessor(tiny_vl_dir)
    ids = encode_row(processor, {"prompt": "Color?", "messages": messages}, [RED])
    assert ids.count(processor.image_token_id) == 4
