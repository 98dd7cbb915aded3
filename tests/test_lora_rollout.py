"""LoRA adapters on the rollout side: the embedded engine merges a PEFT adapter into its weights (and gives what
the PEFT model gives), serves SGLang's adapter routes, and the SGLang backend drives the same routes of a launched
server (rlflow's launch module in SGLang's place)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.models.flat_weights import flatten_
from rlflow.engines.rollout.router import RolloutRouter
from rlflow.engines.rollout.sglang_backend import SGLangRolloutBackend, lora_server_args
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 8, "target_modules": MODULES}
PROMPTS = [[1, 4, 5, 6], [1, 9, 8]]
SAMPLED = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
TOKEN = "secret-token"


def _peft(model_dir: str, seed: int, config: dict | None = None):
    """A PEFT LoRA model on the tiny model, with random non-zero lora_A and lora_B (init_lora_weights=False)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": MODULES, "init_lora_weights": False} | (config or {})
    return get_peft_model(base, LoraConfig(**cfg)).eval()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict:
    """Two adapters saved in PEFT's format under one folder (the server's weight dir), with their PEFT models:
    a1 on every projection; a2 (rsLoRA, rank 8) on q/v only, so loading it after a1 must restore the others."""
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "a1": (1, {}),
        "a2": (2, {"r": 8, "lora_alpha": 4, "use_rslora": True, "target_modules": ["q_proj", "v_proj"]}),
    }
    out = {"root": root, "made": made}
    for name, (seed, cfg) in made.items():
        model = _peft(tiny_model_dir, seed, cfg)
        model.save_pretrained(root / name)
        out[name] = model
    return out


def _backend(model_dir: str, adapters: dict, lora=LORA, **kwargs) -> TorchRolloutBackend:
    return TorchRolloutBackend(
        model_dir, threads=1, batch_size=4, weight_dirs=[str(adapters["root"])], lora=lora, **kwargs
    )


def _weights(backend) -> dict[str, torch.Tensor]:
    return dict(backend.named_tensors())


@torch.no_grad()
def _peft_logprobs(model, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each output token, argmax at each output position) under the PEFT model's own forward."""
    ids = torch.tensor([prompt + output])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0], logits.argmax(-1)


# ---- the merge -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
def test_merged_adapter_generates_what_the_peft_model_does(tiny_model_dir, adapters, fused):
    """Prefill and decode with adapter a1 merged give the PEFT model's logprobs and greedy tokens; the merged
    weights are PEFT's merge_and_unload. Fused: the weights in one flat buffer, q/k/v and gate/up as one GEMM
    over it (the GPU layout): the merge writes into that buffer, so the fused views and pointers stay."""
    backend = _backend(tiny_model_dir, adapters)
    try:
        if fused:
            flatten_(backend.params)
        base_tokens = [g.output_ids for g in backend.generate(PROMPTS, GREEDY, seed=0)]
        pointers = backend.engine.lm.weight_pointers()
        backend.load_lora_adapter("a1", str(adapters["root"] / "a1"))
        assert backend.engine.lm.weight_pointers() == pointers, "merged in place: graphs and fused views stay valid"
        assert backend.engine.lm.fused_groups == (4 if fused else 0)
        model = adapters["a1"]
        for gens, params in (
            (backend.generate(PROMPTS, SAMPLED, seed=3), SAMPLED),
            (backend.generate(PROMPTS, GREEDY, seed=0), GREEDY),
        ):
            for prompt, g in zip(PROMPTS, gens, strict=True):
                logp, argmax = _peft_logprobs(model, prompt, g.output_ids)
                if params is GREEDY:
                    assert g.output_ids == argmax.tolist()
                else:
                    torch.testing.assert_close(torch.tensor(g.output_logprobs), logp, atol=1e-4, rtol=1e-4)
        greedy = [g.output_ids for g in backend.generate(PROMPTS, GREEDY, seed=0)]
        assert greedy != base_tokens, "the adapter changes what the model says"
    finally:
        backend.close()


def test_merged_weights_are_peft_merge_and_unload(tiny_model_dir, adapters):
    """Every weight equals PEFT's merge (fp32 tolerance), with lora_alpha / r and rsLoRA's lora_alpha / sqrt(r)."""
    backend = _backend(tiny_model_dir, adapters)
    try:
        for name in ("a1", "a2"):
            backend.load_lora_adapter(name, str(adapters["root"] / name))
            # the same PEFT model again (same seed): merge_and_unload changes the model it merges
            model = _peft(tiny_model_dir, *adapters["made"][name])
            expected = model.merge_and_unload(progressbar=False).state_dict()
            got = _weights(backend)
            assert set(got) == set(expected)
            for key, value in expected.items():
                torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=key)
    finally:
        backend.close()


def test_unload_restores_the_base_and_the_next_adapter_merges_from_it(tiny_model_dir, adapters):
    backend, alone = _backend(tiny_model_dir, adapters), _backend(tiny_model_dir, adapters)
    try:
        base = _weights(backend)
        backend.load_lora_adapter("a1", str(adapters["root"] / "a1"))
        backend.load_lora_adapter("policy", str(adapters["root"] / "a2"))  # replaces a1, which is dropped
        backend.load_lora_adapter("policy", str(adapters["root"] / "a2"))  # the same name: replaced, not stacked
        assert backend.loaded_adapters() == {"policy": str(adapters["root"] / "a2")}
        alone.load_lora_adapter("a2", str(adapters["root"] / "a2"))
        after, only = _weights(backend), _weights(alone)
        assert all(torch.equal(after[k], only[k]) for k in base), "a2 after a1 is bitwise a2 alone"
        assert torch.equal(after["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"]), (
            "a module only a1 targeted is back to the base"
        )
        with pytest.raises(ValueError, match="'a1' is not loaded"):
            backend.unload_lora_adapter("a1")
        backend.unload_lora_adapter("policy")
        restored = _weights(backend)
        assert all(torch.equal(restored[k], base[k]) for k in base), "unload restores the base bitwise"
        assert backend.loaded_adapters() == {}
    finally:
        backend.close()
        alone.close()


def test_release_and_resume_keep_the_base_and_the_adapter(tiny_model_dir, adapters):
    """Colocated LoRA runs release the weights for the trainer and get only adapters back: the engine restores
    the base from host memory and merges the adapter again, bitwise, on resume or on the next load."""
    backend = _backend(tiny_model_dir, adapters)
    try:
        base = _weights(backend)
        backend.release_memory_occupation()  # before any adapter: the whole base is kept
        backend.load_lora_adapter("a1", str(adapters["root"] / "a1"))
        merged = _weights(backend)
        tokens = [g.output_ids for g in backend.generate(PROMPTS, GREEDY, seed=0)]
        backend.release_memory_occupation()
        assert backend.params["model.layers.0.self_attn.q_proj.weight"].numel() == 0, "the memory was given back"
        backend.resume_memory_occupation()
        assert all(torch.equal(merged[k], v) for k, v in _weights(backend).items())
        assert [g.output_ids for g in backend.generate(PROMPTS, GREEDY, seed=0)] == tokens
        backend.release_memory_occupation()
        backend.unload_lora_adapter("a1")  # resumes first
        assert all(torch.equal(base[k], v) for k, v in _weights(backend).items())
    finally:
        backend.close()


def test_base_updates_are_refused_while_an_adapter_is_merged(tiny_model_dir, adapters):
    backend = _backend(tiny_model_dir, adapters)
    try:
        head = backend.named_tensors(["lm_head.weight"])
        backend.load_lora_adapter("a1", str(adapters["root"] / "a1"))
        with pytest.raises(RuntimeError, match="update_weights: LoRA adapter 'a1' is merged.*unload it first"):
            backend.update_weights(head, 3)
        backend.unload_lora_adapter("a1")
        assert backend.update_weights([(n, -t) for n, t in head], 3) == 3
        backend.update_weight_version(7)
        assert {g.weight_version for g in backend.generate(PROMPTS, GREEDY, seed=0)} == {7}
    finally:
        backend.close()


def _edit(src: Path, dst: Path, config: dict | None = None, tensors=None, drop: str | None = None) -> str:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps(cfg | config))
    if tensors is not None:
        save_file(tensors(load_file(dst / "adapter_model.safetensors")), dst / "adapter_model.safetensors")
    if drop:
        (dst / drop).unlink()
    return str(dst)


def test_bad_adapters_name_the_file_and_key(tiny_model_dir, adapters):
    src, root = adapters["root"] / "a1", adapters["root"]
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    cases = [
        (
            dict(config={"target_modules": ["q_proj", "foo_proj"]}),
            r"adapter_config.json: target_modules \['foo_proj'\]",
        ),
        (dict(config={"r": 16}), r"lora_A \[4, 64\] and lora_B \[32, 4\] do not fit r = 16"),
        (dict(config={"use_dora": True}), "adapter_config.json: use_dora = True is not supported"),
        (
            dict(tensors=lambda t: t | {f"{key}.lora_A.weight": t[f"{key}.lora_A.weight"][:, :-1].contiguous()}),
            rf"adapter_model.safetensors: {key}: lora_A \[4, 31\]",
        ),
        (
            dict(tensors=lambda t: {k: v for k, v in t.items() if k != f"{key}.lora_B.weight"}),
            rf"{key}.lora_B.weight is missing",
        ),
        (dict(drop="adapter_model.safetensors"), "has no adapter_model.safetensors"),
        (dict(drop="adapter_config.json"), "has no adapter_config.json"),
    ]
    backend = _backend(tiny_model_dir, adapters, lora={"rank": 8, "target_modules": MODULES})
    try:
        for i, (edit, message) in enumerate(cases):
            folder = _edit(src, root / f"bad{i}", **edit)
            with pytest.raises(ValueError, match=message):
                backend.load_lora_adapter("bad", folder)
        assert backend.loaded_adapters() == {}
        narrow = _backend(tiny_model_dir, adapters, lora={"rank": 8, "target_modules": ["q_proj", "v_proj"]})
        with pytest.raises(ValueError, match=r"target_modules \['down_proj', 'gate_proj', .* are outside"):
            narrow.load_lora_adapter("a1", str(src))
        narrow.close()
        low = _backend(tiny_model_dir, adapters, lora={"rank": 2, "target_modules": ["all"]})
        with pytest.raises(
            ValueError, match=r"adapter_config.json: r = 4 is above the rank the engine was started for"
        ):
            low.load_lora_adapter("a1", str(src))
        low.close()
        plain = _backend(tiny_model_dir, adapters, lora=None)
        with pytest.raises(RuntimeError, match="started without LoRA"):
            plain.load_lora_adapter("a1", str(src))
        plain.close()
    finally:
        backend.close()


# ---- HTTP ------------------------------------------------------------------------------------------------


def test_adapter_routes_and_requests_over_http(tiny_model_dir, adapters, tmp_path):
    backend = _backend(tiny_model_dir, adapters)
    url = backend.start_server(token=TOKEN)
    http = httpx.Client(base_url=url, timeout=60)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    a1 = str(adapters["root"] / "a1")
    try:
        body = {"lora_name": "a1", "lora_path": a1}
        assert http.post("/load_lora_adapter", json=body).status_code == 401, "a control route"
        shutil.copytree(a1, tmp_path / "a1")
        r = http.post("/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(tmp_path / "a1")}, headers=auth)
        assert r.status_code == 403 and r.json()["success"] is False
        assert "lora_path:" in r.json()["error_message"] and "outside the folders" in r.json()["error_message"]
        r = http.post("/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(adapters["root"])}, headers=auth)
        assert r.status_code == 400 and "has no adapter_config.json" in r.json()["error_message"]
        r = http.post("/load_lora_adapter", json=body, headers=auth)
        r2 = http.post("/load_lora_adapter", json=body, headers=auth)
        assert r2.status_code == 400 and "'a1' is already loaded" in r2.json()["error_message"], "as SGLang"
        assert r.status_code == 200 and r.json() == {
            "success": True,
            "error_message": "",
            "loaded_adapters": {"a1": a1},
        }

        gen = {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        }
        r = http.post("/generate", json=gen | {"lora_path": "a1"})
        assert r.status_code == 200
        assert r.json()["output_ids"] == _peft_logprobs(adapters["a1"], PROMPTS[0], r.json()["output_ids"])[1].tolist()
        for lora_path, message in (
            ("a2", "LoRA adapter 'a2' is not loaded; this server serves 'a1'"),
            (None, "this server serves LoRA adapter 'a1'"),
        ):
            r = http.post("/generate", json=gen | {"lora_path": lora_path})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("lora_path: ")
            assert message in r.json()["error"]["message"]
        batch = gen | {"input_ids": PROMPTS}
        assert http.post("/generate", json=batch | {"lora_path": ["a1", "a1"]}).status_code == 200
        r = http.post("/generate", json=batch | {"lora_path": ["a1", None]})
        assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]

        model = backend.model_path
        done = http.post("/v1/completions", json={"model": f"{model}:a1", "prompt": "12", "max_tokens": 3})
        assert done.status_code == 200
        r = http.post("/v1/completions", json={"model": model, "prompt": "12", "max_tokens": 3})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("model: this server serves LoRA")
        r = http.post(
            "/v1/chat/completions",
            json={"model": f"{model}:a2", "max_tokens": 3, "messages": [{"role": "user", "content": "12"}]},
        )
        assert r.status_code == 400 and "'a2' is not loaded" in r.json()["error"]["message"]
        assert [c["id"] for c in http.get("/v1/models").json()["data"]] == [model, "a1"]

        r = http.post("/update_weights_from_disk", json={"model_path": model}, headers=auth)
        assert r.status_code == 400 and "unload it first" in r.json()["message"]
        assert http.post("/update_weight_version", json={"new_version": "7"}).status_code == 401
        r = http.post("/update_weight_version", json={"new_version": "7", "abort_all_requests": False}, headers=auth)
        assert r.json() == {"success": True, "message": "Weight version updated to 7", "new_version": "7"}
        assert http.post("/generate", json=gen | {"lora_path": "a1"}).json()["meta_info"]["weight_version"] == "7"

        router = RolloutRouter([url], token=TOKEN)  # the run's router sends adapter routes to every worker
        try:
            with httpx.Client(base_url=router.url, timeout=60) as via:
                assert via.post("/update_weight_version", json={"new_version": "8"}).status_code == 401
                r = via.post("/update_weight_version", json={"new_version": "8"}, headers=auth)
                assert r.status_code == 200 and r.json()["success"]
                r = via.post("/load_lora_adapter", json=body, headers=auth)  # loaded already: the worker's 400
                assert r.status_code == 400 and "'a1' is already loaded" in r.json()["message"]
                out = via.post("/generate", json=gen | {"lora_path": "a1"}).json()
                assert out["meta_info"]["weight_version"] == "8"
        finally:
            router.stop()

        r = http.post("/unload_lora_adapter", json={"lora_name": "a1"}, headers=auth)
        assert r.json() == {"success": True, "error_message": "", "loaded_adapters": {}}
        r = http.post("/unload_lora_adapter", json={"lora_name": "a1"}, headers=auth)
        assert r.status_code == 400 and "'a1' is not loaded" in r.json()["error_message"]
        r = http.post("/generate", json=gen | {"lora_path": "a1"})
        assert r.status_code == 400 and "serves the base model" in r.json()["error"]["message"]
        assert http.post("/generate", json=gen).status_code == 200
    finally:
        http.close()
        backend.close()


# ---- the SGLang backend ----------------------------------------------------------------------------------


def test_lora_flags_join_the_recipes_args_once():
    assert lora_server_args({"dtype": "float32"}, None) == {"dtype": "float32"}
    assert lora_server_args({"dtype": "float32"}, LORA) == {
        "dtype": "float32",
        "enable-lora": True,
        "max-lora-rank": 8,
        "lora-target-modules": MODULES,
    }
    given = {"enable-lora": True, "max-lora-rank": 16, "lora-target-modules": ["all"]}
    assert lora_server_args(given, LORA) == given, "the recipe's own values are kept, not repeated"
    with pytest.raises(ValueError, match="max-lora-rank: 4 is below train.lora.rank"):
        lora_server_args({"max-lora-rank": 4}, LORA)
    with pytest.raises(ValueError, match=r"lora-target-modules: \['q_proj'\] leaves out"):
        lora_server_args({"lora-target-modules": ["q_proj"]}, LORA)


def test_sglang_backend_loads_adapters_through_the_launched_server(tiny_model_dir, adapters):
    sglang = {
        "launch_module": "rlflow.engines.rollout.launch",
        "startup_timeout_s": 120,
        "args": {"dtype": "float32", "max-running-requests": 2, "max-total-tokens": 256},
    }
    worker = SGLangRolloutBackend(tiny_model_dir, sglang, threads=1, weight_dirs=[str(adapters["root"])], lora=LORA)
    try:
        command = worker.command[worker.command.index("--enable-lora") :]
        assert command[:10] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *MODULES[:6]]
        info = worker.server_info()
        assert (info["enable_lora"], info["max_lora_rank"], info["lora_target_modules"]) == (True, 8, MODULES)
        a1 = str(adapters["root"] / "a1")
        worker.load_lora_adapter("a1", str(adapters["root"] / "a2"))
        worker.load_lora_adapter("a1", a1)  # a loaded name: unloaded first, as SGLang wants
        assert worker.server_info()["loaded_adapters"] == {"a1": a1} == worker.adapters
        gen = {
            "input_ids": PROMPTS[1],
            "lora_path": "a1",
            "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
        }
        out = httpx.post(worker.server_url() + "/generate", json=gen, timeout=60).json()["output_ids"]
        assert out == _peft_logprobs(adapters["a1"], PROMPTS[1], out)[1].tolist()
        with pytest.raises(RuntimeError, match=r"/load_lora_adapter 'bad' failed \(400\): .*has no adapter_config"):
            worker.load_lora_adapter("bad", str(adapters["root"]))
        worker.update_weight_version(5)
        assert worker.model_info()["weight_version"] == "5" and worker.weight_version == 5
        worker.unload_lora_adapter("a1")
        assert worker.server_info()["loaded_adapters"] == {}
        with pytest.raises(RuntimeError, match=r"/unload_lora_adapter 'a1' failed \(400\): .*'a1' is not loaded"):
            worker.unload_lora_adapter("a1")
    finally:
        worker.close()
