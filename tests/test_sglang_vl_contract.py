"""The SGLang backend with images (issue 44, item 4), against sglang 0.5.10.post1's request rules and weight names.

SGLang cannot run here, so its rules are the stand-in's (tests/sglang_fixture_server.py), each read from that
release's source: how /generate reads `image_data`, which prompt form its Qwen-VL processor expands, what it counts
in meta_info.prompt_tokens, and the names its Qwen2-VL model loads weights under (docs/multimodal.md, "SGLang").
"""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen2VLForConditionalGeneration

from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models.vision_language import VisionProcessor, collapse_image_pads, open_image
from rlflow.engines.rollout.sglang_backend import SGLangRolloutBackend, generate_body, sglang_weight_name
from tests.sglang_fixture_server import image_lists


def data_uri(color: str, size: tuple[int, int] = (60, 60), fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


RED, BLUE = data_uri("red"), data_uri("blue", (112, 84), "JPEG")


@pytest.fixture(scope="module")
def vision(tiny_vl_dir) -> VisionProcessor:
    return VisionProcessor(tiny_vl_dir)


def prompt(vision: VisionProcessor, images: list[str], text: str = "1+1=") -> list[int]:
    """rlflow's prompt ids: one pad per merged patch of each image."""
    messages = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}]
    pictures = [open_image(base64.b64decode(x.split(",", 1)[1])) for x in images]
    return vision.encode(messages, pictures).prompt_ids


# ---- weight names ------------------------------------------------------------------------------------------------
def test_weights_are_sent_under_the_names_sglangs_qwen2_vl_loads(tiny_vl_dir):
    """transformers 5 names the modules model.language_model.* and model.visual.*; SGLang's Qwen2-VL names its
    parameters as the checkpoint on disk, which transformers writes: the renamed module names are exactly those."""
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir)
    names = [n for n, _ in model.named_parameters()]
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.blocks.") for n in names)
    with safe_open(str(Path(tiny_vl_dir) / "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
    assert {sglang_weight_name(n) for n in names} == on_disk
    assert sglang_weight_name("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert sglang_weight_name("model.language_model.norm.weight") == "model.norm.weight"
    for unchanged in ("lm_head.weight", "model.layers.0.mlp.up_proj.weight", "visual.merger.mlp.0.weight"):
        assert sglang_weight_name(unchanged) == unchanged


# ---- requests ----------------------------------------------------------------------------------------------------
def test_pad_runs_collapse_to_one_pad_per_image():
    vs, pad, ve = 7, 9, 8
    ids = [1, vs, pad, pad, pad, pad, ve, 5, vs, pad, ve, pad, pad]
    assert collapse_image_pads(ids, pad) == [1, vs, pad, ve, 5, vs, pad, ve, pad]
    assert collapse_image_pads(collapse_image_pads(ids, pad), pad) == [1, vs, pad, ve, 5, vs, pad, ve, pad]
    assert collapse_image_pads([1, 2, 3], pad) == [1, 2, 3] and collapse_image_pads([], pad) == []


def test_a_batch_with_images_is_sent_as_sglang_reads_it(vision):
    """One list of images per request ([] for a text one, so that SGLang takes the list of lists), n requests per
    prompt, and each prompt's pad runs collapsed; SGLang's reading of the body gives each request its images."""
    text, two = vision.tokenizer("2+2=")["input_ids"], prompt(vision, [RED, BLUE])
    pad = vision.image_token_id
    body = generate_body([text, two], SamplingParams(max_new_tokens=3, n=2), seed=0, image_data=[[], [RED, BLUE]],
                         pad_id=pad)
    assert body["image_data"] == [[], [], [RED, BLUE], [RED, BLUE]]
    assert body["input_ids"][:2] == [text, text] and body["input_ids"][2] == collapse_image_pads(two, pad)
    assert two.count(pad) > 2 and body["input_ids"][3].count(pad) == 2
    assert image_lists(body) == [[], [], [RED, BLUE], [RED, BLUE]]
    # a text request first, given as None, would make SGLang read every entry as ONE image (a list is no image)
    assert image_lists({"input_ids": [text, two], "image_data": [None, [RED, BLUE]]}) == [[], [[RED, BLUE]]]
    # the single-request form (sglang-router takes one request a call): the request's own list of images
    assert image_lists({"input_ids": two, "image_data": [RED, BLUE]}) == [[RED, BLUE]]
    # text only: the body is a text model's, no image_data; rlflow's embedded launcher (pad_id None) keeps the pads
    assert "image_data" not in generate_body([text], SamplingParams(), seed=0, image_data=[[]], pad_id=pad)
    assert generate_body([two], SamplingParams(), 0, [[RED, BLUE]])["input_ids"] == [two]


@pytest.mark.parametrize(("images", "message"), [
    ([[RED]], r"1 lists of images for 2 prompts; expected one list per prompt"),
    ([[], [RED]], r"prompt 1 places 2 images and has 1"),
])
def test_images_that_do_not_fit_the_prompts_are_refused(vision, images, message):
    prompts = [vision.tokenizer("2")["input_ids"], prompt(vision, [RED, BLUE])]
    with pytest.raises(ValueError, match=message):
        generate_body(prompts, SamplingParams(), 0, images, vision.image_token_id)


# ---- the worker against SGLang's stand-in ------------------------------------------------------------------------
@pytest.fixture
def worker(tiny_vl_dir, tmp_path):
    python = tmp_path / "sglang-env-python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    sglang = {"python": str(python), "launch_module": "tests.sglang_fixture_server", "startup_timeout_s": 120}
    backend = SGLangRolloutBackend(tiny_vl_dir, sglang, threads=1, log_dir=str(tmp_path / "worker"))
    try:
        yield backend
    finally:
        backend.close()


def test_the_sglang_worker_generates_with_images(worker, vision):
    """The worker's requests pass SGLang's processing (one pad per image, images it can load) and SGLang's count
    of the expanded prompt is checked against rlflow's; the Generations keep rlflow's prompts."""
    text, two, one = vision.tokenizer("2+2=")["input_ids"], prompt(vision, [RED, BLUE]), prompt(vision, [BLUE], "3")
    gens = worker.generate([text, two, one], SamplingParams(max_new_tokens=3), seed=0,
                           image_data=[[], [RED, BLUE], [BLUE]])
    assert [g.prompt_ids for g in gens] == [text, two, one]
    assert [g.output_ids for g in gens] == [[7, 12, 9], [2], [7, 12, 9]]  # the stand-in's recorded items, in turn
    assert gens[2].output_logprobs[1] == -float("inf") and gens[2].weight_version == 0
    assert [g.meta["prompt_tokens"] for g in gens] == [len(text), len(two), len(one)]
    # SGLang's expansion of the images differs from rlflow's (another image processor): refused, naming both counts
    longer = two[:two.index(vision.image_token_id)] + [vision.image_token_id] + two[two.index(vision.image_token_id):]
    with pytest.raises(RuntimeError, match=rf"expanded the prompt with its images to {len(two)} tokens, rlflow's "
                                           rf"processor to {len(longer)}"):
        worker.generate([longer], SamplingParams(max_new_tokens=3), seed=0, image_data=[[RED, BLUE]])


def test_sglang_refuses_expanded_pads_and_takes_a_single_request(worker, vision):
    """What the stand-in holds SGLang to: rlflow's expanded prompt fails its processor, one pad per image passes,
    and a single request (sglang-router's form) gets the expanded count back in prompt_tokens."""
    two = prompt(vision, [RED, BLUE])
    single = {"input_ids": two, "image_data": [RED, BLUE], "sampling_params": {"max_new_tokens": 3},
              "return_logprob": True}
    r = httpx.post(worker.server_url() + "/generate", json=single)
    assert r.status_code == 400 and "out of bounds" in r.json()["error"]["message"]
    r = httpx.post(worker.server_url() + "/generate",
                   json=single | {"input_ids": collapse_image_pads(two, vision.image_token_id)})
    assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == len(two)


def test_the_rl_loops_requests_pass_sglang_and_a_different_expansion_is_refused(worker, vision):
    """The RL loop reaches SGLang through engines/rollout/functions.py (single_turn -> generate), not through the
    worker's own generate: its requests carry one pad per image and pass the stand-in's SGLang rules, the samples
    keep rlflow's expanded prompt, and a server that expands the pictures to another count is refused."""
    from rlflow.engines.rollout.functions import PromptSample, RolloutRunner, generate, single_turn

    two = prompt(vision, [RED, BLUE])
    sample = PromptSample(index=0, prompt="1+1=", label="2", prompt_ids=two, n=2, seed=0, tokenizer=vision.tokenizer,
                          images=["r", "b"], image_data=[RED, BLUE])
    url = worker.server_url()
    runner = RolloutRunner(single_turn, url, [url])
    try:
        [samples] = runner.run([sample], {"max_new_tokens": 3})
        assert len(samples) == 2 and all(s.response_ids for s in samples)
        # a picture the server expands to another number of tokens than the prompt's ids hold (the trainer's)
        big = data_uri("red", (112, 112))
        with pytest.raises(RuntimeError, match=rf"ran a \d+-token prompt for a {len(two)}-token one with 2 image"):
            runner.submit(generate(url, two, {"max_new_tokens": 3}, image_data=[big, BLUE],
                                   image_pad_id=vision.image_token_id))
    finally:
        runner.close()


def test_weight_updates_reach_sglang_under_its_names(worker, tiny_vl_dir, tmp_path):
    """Every weight route the worker uses sends transformers' names as SGLang's Qwen2-VL loads them: tensors
    (written to a folder of the worker's), a folder written under transformers' names (loaded from a renamed copy),
    and the distributed route's names."""
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    assert worker.update_weights(named, 1) == 1
    folder = tmp_path / "disk" / "v2"
    folder.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in named[:5]}, str(folder / "bucket-0.safetensors"))
    save_file({n: t.contiguous() for n, t in named[5:]}, str(folder / "bucket-1.safetensors"))
    refused = httpx.post(worker.server_url() + "/update_weights_from_disk", json={"model_path": str(folder)})
    assert refused.status_code == 400 and "Failed to update weights" in refused.json()["message"]
    assert worker.update_weights_from_disk(folder, 2) == 2
    served = Path(worker.model_info()["model_path"])
    assert served.parent == tmp_path / "worker" and served != folder
    for path in served.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f, safe_open(str(folder / path.name), "pt") as g:
            written = list(g.keys())  # transformers' names
            assert {sglang_weight_name(k) for k in written} == set(f.keys())
            for k in written:
                assert torch.equal(f.get_tensor(sglang_weight_name(k)), g.get_tensor(k))
    names = [n for n, _ in named]
    assert worker.update_weights_from_distributed(names, ["float32"] * len(names),
                                                  [list(t.shape) for _, t in named], 3) == 3
    assert worker.model_info()["weight_version"] == "3"
