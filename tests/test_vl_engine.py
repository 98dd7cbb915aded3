"""The embedded rollout engine with images (Qwen2-VL): log-probs against transformers' forward, one vision-encoder
call per distinct image, no prefix sharing across different images, preemption and chunked prefill, /generate's
image_data."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil

import httpx
import pytest
import torch
from PIL import Image, ImageDraw
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from rlflow.engines.core.config import KVCacheConfig, ModelConfig
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models.hf import build_tiny_model
from rlflow.engines.models.vision_encoder import image_digest
from rlflow.engines.models.vision_language import VisionProcessor
from rlflow.engines.rollout.functions import PromptSample, single_turn
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny_vl")
    build_tiny_model(ModelConfig(arch="qwen2_vl", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                 num_kv_heads=2, max_seq_len=256), out, seed=0)
    # rope_theta 10 instead of 1e6: every rotary frequency turns by a large angle per position, so a wrong M-RoPE
    # section (height vs width vs time) changes the log-probs far beyond the tolerance
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["rope_parameters"]["rope_theta"] = 10.0
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="module")
def qwen25_backend(vl_dir, tmp_path_factory):
    """A tiny Qwen2.5-VL (its windowed vision tower) with the Qwen2-VL model's tokenizer and image processor."""
    out = tmp_path_factory.mktemp("tiny_qwen25_vl")
    shutil.copytree(vl_dir, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    text = {k: config["text_config"][k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rope_parameters", "bos_token_id", "eos_token_id",
        "pad_token_id")}
    vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    ids = {k: config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    torch.manual_seed(1)
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text | {"tie_word_embeddings": False},
                                                         vision_config=vision, tie_word_embeddings=False, **ids)
                                       ).save_pretrained(out)
    b = TorchRolloutBackend(str(out), threads=1, batch_size=8)
    yield b
    b.close()


@pytest.fixture(scope="module")
def processor(vl_dir) -> VisionProcessor:
    return VisionProcessor(vl_dir)


@pytest.fixture(scope="module")
def backend(vl_dir):
    b = TorchRolloutBackend(vl_dir, threads=1, batch_size=8)
    yield b
    b.close()


def png(width: int, height: int, color: tuple[int, int, int], box: int = 10) -> bytes:
    """A test image: a background and a coloured square."""
    image = Image.new("RGB", (width, height), (250, 250, 250))
    ImageDraw.Draw(image).rectangle([4, 4, 4 + box, 4 + box], fill=color)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def prompt_ids(processor: VisionProcessor, images: list[bytes], text: str = "count") -> list[int]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    opened = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor.encode([{"role": "user", "content": content}], opened).prompt_ids


def hf_logprobs(backend: TorchRolloutBackend, processor: VisionProcessor, gen, images: list[bytes]) -> torch.Tensor:
    """The generated tokens' log-probs under transformers' forward of the whole sequence: its image features
    (get_image_features) at the prompt's pad tokens, its M-RoPE index (get_rope_index)."""
    model = backend.model
    ids = torch.tensor([gen.prompt_ids + gen.output_ids])
    pixels = processor.pixel_inputs([Image.open(io.BytesIO(b)).convert("RGB") for b in images])
    prompt_pads = torch.zeros_like(ids, dtype=torch.bool)  # a generated pad id is text, not an image
    prompt_pads[0, :len(gen.prompt_ids)] = ids[0, :len(gen.prompt_ids)] == processor.image_token_id
    with torch.no_grad():
        features = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"]).pooler_output
        embeds = model.model.get_input_embeddings()(ids)
        embeds[prompt_pads] = torch.cat(features).to(embeds.dtype)
        positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=prompt_pads.int(),
                                                  image_grid_thw=pixels["image_grid_thw"])
        logits = model(inputs_embeds=embeds, position_ids=positions).logits[0, len(gen.prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(gen.prompt_ids):, None])[:, 0]


def assert_same(a, b, tol: float = 1e-5) -> None:
    assert [g.output_ids for g in a] == [g.output_ids for g in b]
    for x, y in zip(a, b, strict=True):
        assert max(abs(p - q) for p, q in zip(x.output_logprobs, y.output_logprobs, strict=True)) < tol


@pytest.mark.parametrize("model", ["backend", "qwen25_backend"])
@pytest.mark.parametrize("sizes", [[(60, 90)], [(56, 56), (112, 84)]])
def test_logprobs_equal_transformers_forward(request, processor, sizes, model):
    """Qwen2-VL and Qwen2.5-VL, 1 and 2 images of different sizes: the engine's sampled tokens' log-probs are
    transformers' (fp32)."""
    backend = request.getfixturevalue(model)
    assert backend.model.config.model_type == {"backend": "qwen2_vl", "qwen25_backend": "qwen2_5_vl"}[model]
    images = [png(w, h, (200, 30 * i, 40)) for i, (w, h) in enumerate(sizes)]
    ids = prompt_ids(processor, images)
    assert sum(t == processor.image_token_id for t in ids) >= 4 * len(images)
    gens = backend.generate([ids], SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, n=2), seed=3,
                            image_data=[images])
    for g in gens:
        ref = hf_logprobs(backend, processor, g, images)
        assert torch.allclose(torch.tensor(g.output_logprobs), ref, atol=1e-5), (g.output_logprobs, ref.tolist())


def test_a_group_runs_the_vision_encoder_once(backend, processor):
    """n=4 samples of one image prompt: one vision-encoder call; the same image again (a later step): none."""
    image = png(84, 56, (10, 200, 10))
    ids = prompt_ids(processor, [image])
    before = backend.vision.calls
    backend.generate([ids], SamplingParams(max_new_tokens=4, n=4), seed=0, image_data=[[image]])
    assert backend.vision.calls == before + 1
    backend.generate([ids, ids], SamplingParams(max_new_tokens=4), seed=1, image_data=[[data_uri(image)]] * 2)
    assert backend.vision.calls == before + 1


def test_prompts_admitted_together_share_one_vision_encoder_call(backend, processor):
    """Three prompts with pictures of their own, prefilled in one step: their new pictures go through the tower in
    one call, not one a prompt, and each prompt still gets its own picture's embeddings (its tokens)."""
    pictures = [png(56 + 28 * i, 56, (30 * i, 10, 200)) for i in range(3)]
    prompts = [prompt_ids(processor, [p]) for p in pictures]
    params = SamplingParams(max_new_tokens=3)
    before = backend.vision.calls
    together = backend.generate(prompts, params, seed=3, image_data=[[p] for p in pictures])
    assert backend.vision.calls == before + 1
    backend.vision.clear()
    alone = [backend.generate([ids], params, seed=3, first_index=i, image_data=[[p]])[0]
             for i, (ids, p) in enumerate(zip(prompts, pictures, strict=True))]
    assert_same(together, alone)


def test_same_tokens_different_images_share_no_prefill(backend, processor):
    """Two prompts with equal token ids and different images (same size): each gives what it gives alone."""
    red, blue = png(56, 84, (220, 0, 0), box=30), png(56, 84, (0, 0, 220), box=30)
    ids = prompt_ids(processor, [red])
    assert ids == prompt_ids(processor, [blue])
    p = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, n=2)
    both = backend.generate([ids, ids], p, seed=5, image_data=[[red], [blue]])
    alone = (backend.generate([ids], p, seed=5, image_data=[[red]])
             + backend.generate([ids], p, seed=5, first_index=2, image_data=[[blue]]))
    assert_same(alone, both)
    assert both[0].output_logprobs[0] != pytest.approx(both[2].output_logprobs[0], abs=1e-6)


def test_mixed_text_and_image_prompts_in_one_batch(backend, processor):
    """A text prompt beside an image prompt on the VL model: each as it is alone (text: plain positions)."""
    image = png(112, 56, (0, 120, 120))
    text_ids, image_ids = prompt_ids(processor, [], "plain text"), prompt_ids(processor, [image])
    p = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    both = backend.generate([text_ids, image_ids], p, seed=2, image_data=[None, [image]])
    alone = (backend.generate([text_ids], p, seed=2)
             + backend.generate([image_ids], p, seed=2, first_index=1, image_data=[[image]]))
    assert_same(alone, both)


def test_preemption_and_chunked_prefill_change_nothing(vl_dir, backend, processor):
    """A pool too small for the group (re-prefills with the same embeddings and positions) and a prefill in
    chunks of 5 tokens give the tokens and log-probs of the roomy, whole-prefill engine."""
    images = [png(56, 56, (90, 90, 0)), png(84, 112, (0, 0, 0))]
    ids = prompt_ids(processor, images)
    p = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, n=4)
    ref = backend.generate([ids], p, seed=7, image_data=[images])
    tight = TorchRolloutBackend(vl_dir, threads=1, batch_size=8, kv_cache=KVCacheConfig(page_size=4, tokens=80))
    chunked = TorchRolloutBackend(vl_dir, threads=1, batch_size=8, kv_cache=KVCacheConfig(prefill_chunk_tokens=5))
    try:
        assert_same(ref, tight.generate([ids], p, seed=7, image_data=[images]))
        assert tight.engine.stats()["num_preemptions"] > 0
        assert_same(ref, chunked.generate([ids], p, seed=7, image_data=[images]))
    finally:
        tight.close()
        chunked.close()


def test_mismatched_images_are_refused(backend, processor):
    image = png(56, 56, (1, 2, 3))
    ids = prompt_ids(processor, [image])
    with pytest.raises(ValueError, match="2 image.*1 image placeholder"):
        backend.requests([ids], SamplingParams(), image_data=[[image, image]])
    with pytest.raises(ValueError, match="patch grid needs"):  # a 56x56 image is 4 tokens; a 112x112 one 16
        backend.requests([ids], SamplingParams(), image_data=[[png(112, 112, (1, 2, 3))]])
    with pytest.raises(ValueError, match="is not an image PIL can read"):
        backend.requests([ids], SamplingParams(), image_data=[[b"not an image"]])


def test_generate_over_http_with_image_data(backend, processor, tmp_path):
    """/generate with image_data (a data URI list, a single raw-base64 string, a file path in a batch) gives what
    the backend gives; images that do not match the placeholders are a 400 naming the problem."""
    image = png(84, 84, (40, 40, 160))
    ids = prompt_ids(processor, [image])
    path = tmp_path / "im.png"
    path.write_bytes(image)
    p = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)
    want = backend.generate([ids], p, seed=11, image_data=[[image]])[0]
    sampling = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}
    with httpx.Client(base_url=backend.start_server(), timeout=120) as http:
        for image_data in ([data_uri(image)], base64.b64encode(image).decode()):
            r = http.post("/generate", json={"input_ids": ids, "sampling_params": sampling, "image_data": image_data,
                                             "return_logprob": True})
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want.output_ids
        r = http.post("/generate", json={"input_ids": [ids, prompt_ids(processor, [], "text")],
                                         "sampling_params": sampling, "image_data": [[str(path)], []]})
        assert r.status_code == 200, r.text
        assert r.json()[0]["output_ids"] == want.output_ids
        one_pad = [t for i, t in enumerate(ids) if t != processor.image_token_id or ids[i - 1] != t]  # SGLang's form
        assert len(one_pad) < len(ids)
        r = http.post("/generate", json={"input_ids": one_pad, "sampling_params": sampling,
                                         "image_data": data_uri(image)})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want.output_ids
        assert r.json()["meta_info"]["prompt_tokens"] == len(ids)
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": sampling,
                                         "image_data": [data_uri(image)] * 2})
        assert r.status_code == 400
        assert "2 image(s) for 1 image placeholder" in r.json()["error"]["message"]
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": sampling, "image_data": ["%%%"]})
        assert r.status_code == 400 and "image_data[0]" in r.json()["error"]["message"]


def test_chat_completions_take_image_parts(backend, processor):
    """/v1/chat/completions with OpenAI's image_url content parts (data URIs) runs the prompt /generate runs for the
    same picture and text: the same expanded prompt ids and tokens; a URL to fetch or an unknown part is a 400
    naming the part."""
    image = png(84, 84, (160, 40, 40))
    want = backend.generate([prompt_ids(processor, [image])], SamplingParams(max_new_tokens=5, temperature=1.0,
                                                                             ignore_eos=True), seed=13,
                            image_data=[[image]])[0]
    content = [{"type": "image_url", "image_url": {"url": data_uri(image)}}, {"type": "text", "text": "count"}]
    body = {"max_tokens": 5, "temperature": 1.0, "seed": 13, "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(base_url=backend.start_server(), timeout=120) as http:
        r = http.post("/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["prompt_token_ids"] == want.prompt_ids and choice["token_ids"] == want.output_ids
        assert want.prompt_ids.count(processor.image_token_id) > 1  # expanded from the template's one pad
        for part, where in (({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                             "messages[0].content[0].image_url.url"),
                            ({"type": "input_audio"}, "messages[0].content[0]")):
            r = http.post("/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": [part]}]})
            assert r.status_code == 400 and where in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_single_turn_sends_the_prompts_images(backend, processor, with_tokenizer):
    """The default rollout function sends PromptSample.image_data with each of its n requests (one batched
    /generate), its pads expanded or, knowing the tokenizer, one per image (SGLang's form): the group's samples are
    what the backend gives, and the image is encoded once."""
    image = png(56, 112, (120, 0, 120 + with_tokenizer))
    ids = prompt_ids(processor, [image])
    prompt = PromptSample(index=0, prompt="count", label=None, prompt_ids=ids, n=4, seed=21,
                          tokenizer=processor.tokenizer if with_tokenizer else None,
                          images=[image_digest(image)], image_data=[data_uri(image)])
    sampling = {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}
    before = backend.vision.calls
    samples = asyncio.run(single_turn(prompt, backend.start_server(), sampling))
    assert backend.vision.calls == before + 1
    for j, s in enumerate(samples):
        want = backend.generate([ids], SamplingParams(**sampling), seed=21 + j, image_data=[[image]])[0]
        assert s.response_ids == want.output_ids


def test_a_weight_update_forgets_the_cached_embeddings(backend, processor):
    """The vision tower may be trained: after a weight update an image is encoded again, not read from the cache."""
    image = png(84, 56, (7, 7, 7))
    ids = prompt_ids(processor, [image])
    p = SamplingParams(max_new_tokens=2)
    backend.generate([ids], p, seed=0, image_data=[[image]])
    calls = backend.engine.stats()["vision_encoder_calls"]
    backend.update_weights(backend.named_tensors(["model.visual.merger.mlp.0.weight"]))
    backend.generate([ids], p, seed=0, image_data=[[image]])
    assert backend.engine.stats()["vision_encoder_calls"] == calls + 1


def test_a_prompt_prefilled_again_after_a_tower_update_gets_the_new_embeddings(backend, processor):
    """A request preempted across an update of a trained tower is prefilled again with the new tower's embeddings;
    without an update its re-prefill reuses what it was first prefilled with (no tower call)."""
    encoder = backend.engine.vision
    image = png(56, 84, (9, 200, 9))
    prompt = encoder.prepare(prompt_ids(processor, [image]), [image])
    calls = encoder.calls
    first = encoder.sequence(prompt)
    assert encoder.sequence(prompt) is first and encoder.calls == calls + 1
    encoder.clear()
    again = encoder.sequence(prompt)
    assert again is not first and encoder.calls == calls + 2


def test_transformers_plain_forward_on_the_same_model_gives_the_engines_logprobs(vl_dir, backend, processor):
    """The model loaded elsewhere: transformers' own forward, with the inputs its Qwen2-VL processor builds (the
    chat template's text with the pad run expanded, the image processor's pixels and grid, the pad tokens marked
    in `mm_token_type_ids`), gives the engine's log-probs for the same picture and sampled tokens."""
    from transformers import AutoModelForImageTextToText

    images = [png(84, 56, (200, 40, 40))]
    ids = prompt_ids(processor, images)
    gen = backend.generate([ids], SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True), seed=5,
                           image_data=[images])[0]
    model = AutoModelForImageTextToText.from_pretrained(vl_dir).eval()
    pixels = processor.pixel_inputs([Image.open(io.BytesIO(b)).convert("RGB") for b in images])
    tokens = torch.tensor([ids + gen.output_ids])
    marks = torch.zeros_like(tokens, dtype=torch.int)  # the prompt's pads, as the processor marks them (a generated
    marks[0, :len(ids)] = tokens[0, :len(ids)] == processor.image_token_id  # pad id is text)
    with torch.no_grad():
        logits = model(input_ids=tokens, mm_token_type_ids=marks, **pixels).logits[0, len(ids) - 1:-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(gen.output_logprobs), ref, atol=1e-5), (gen.output_logprobs, ref.tolist())
