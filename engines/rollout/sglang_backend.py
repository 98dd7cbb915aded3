"""The SGLang rollout backend: each rollout worker runs `python -m sglang.launch_server` as its child.

`SGLangRolloutBackend` is a plain class, wrapped in Ray actors by engines/cluster/groups.py like
TorchRolloutBackend. Its constructor launches the server on the GPUs Ray gave the actor (the child inherits
CUDA_VISIBLE_DEVICES; tensor parallelism is the user's `tp-size`), in its own process group:

    <rollout.sglang.python> -m <rollout.sglang.launch_module> --model-path <model> --host 127.0.0.1 --port <port> <args>

where `rollout.sglang.args` are SGLang's own flags, spelled as its parser wants them (the recipe normalised and
checked them: engines/core/sglang_args.py), and `python` is the interpreter of an environment with SGLang
installed (SGLang pins its own torch; default: this one). It waits until
`/health` answers 200; a server that exits first, or does not answer within `startup_timeout_s`, fails the
worker with the end of the server's log in the error. `close()` stops the whole process group, and so does
a small guard process when the worker dies without closing (a killed Ray actor runs no exit handlers; see
engines/cluster/process_group.py).

Everything else goes through SGLang's HTTP routes: generation (`/generate`), weights
(`/update_weights_from_disk`; the `ray` and `store` transports hand tensors to the worker, which writes them
to a local folder and loads that the same way), colocation (`/release_memory_occupation`,
`/resume_memory_occupation` by tags, in slime's order: drain and flush, release everything; weights back before an
update, KV cache after it, one `/flush_cache` per update), and SGLang's distributed pair (`/init_weights_update_group`,
`/update_weights_from_distributed`; the trainer's side is in engines/sync/distributed.py), and LoRA adapters
(`/load_lora_adapter`, `/unload_lora_adapter`, `/update_weight_version`; a worker built with `lora` launches the
server with `--enable-lora --max-lora-rank R --lora-target-modules ...`). SGLang's
`/update_weights_from_tensor` is not used: its payload is pickled.
The tests launch the embedded server (`python -m rlflow.engines.rollout.launch`, same routes and flag names) in
SGLang's place, since SGLang cannot be installed where they run.

Vision-language models (Qwen2-VL, Qwen2.5-VL), as sglang 0.5.10.post1's source has them (docs/multimodal.md, "SGLang"):
- `/generate` takes a prompt's images in `image_data` (here base64 data URIs), batched as one list per request; its
  processor decodes `input_ids` to text and expands each `<|vision_start|><|image_pad|><|vision_end|>` with the
  model's processor, which indexes one image per `<|image_pad|>`. rlflow's prompt ids hold the pad once per merged
  patch (what the model sees), so each run of pads is sent as one (`collapse_image_pads`); SGLang's
  `meta_info.prompt_tokens` counts the expanded prompt again, and must equal ours (else its image processor or
  tokenizer differs from the trainer's: the request fails, naming both counts).
- SGLang's Qwen2-VL modules are named as the checkpoint on disk (`model.layers.*`, `visual.*`, `lm_head.*`) and its
  `load_weights` renames nothing else, while transformers 5 names them `model.language_model.*` and `model.visual.*`:
  every weight update is sent under the checkpoint names (`sglang_weight_name`). rlflow's embedded launcher keeps
  transformers' names and the expanded pads, as its own engine takes them.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from safetensors.torch import save_file

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.cluster.process_group import start_guard, stop_group
from rlflow.engines.core.config import SGLANG_LAUNCHERS, SGLangConfig, StorageConfig
from rlflow.engines.core.protocols import RolloutBackend
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.core.sglang_args import server_dtype, weight_update_ranks
from rlflow.engines.models.vision_language import collapse_image_pads, is_vision_language
from rlflow.engines.rollout.engine import Generation
from rlflow.engines.rollout.http_api import MEMORY_TAGS, auth_headers, parse_weight_version
from rlflow.engines.rollout.lora import LoraLimits
from rlflow.engines.rollout.torch_backend import pack_generations
from rlflow.engines.rollout.weight_routes import WEIGHT_DIRS_ENV
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.delta_format import DeltaFollower
from rlflow.engines.sync.distributed import GROUP_NAME, init_request, update_request
from rlflow.engines.sync.endpoints import (
    AdapterReceiver,
    DeltaReceiver,
    DiskReceiver,
    DistributedReceiver,
    StoreReceiver,
)
from rlflow.engines.sync.store import get_bucket

STOP_GRACE_S = 10.0  # SIGTERM first; SIGKILL what is left of the process group after this
LOG_TAIL_CHARS = 4000
EMBEDDED_LAUNCHER = SGLANG_LAUNCHERS[1]  # rlflow's stand-in: launched without a token, it must be told so


def server_args(args: dict[str, Any]) -> list[str]:
    """launch_server's command-line options from the recipe's (normalised) `rollout.sglang.args`: `key: value` ->
    `--key value`; true -> `--key`; false or null -> nothing; a list -> `--key v1 v2 ...` (an empty one:
    nothing); a dict -> `--key '<json>'` (SGLang takes JSON strings for such options)."""
    out: list[str] = []
    for key, value in args.items():
        flag = key if key.startswith("-") else f"--{key}"
        if value is None or value is False or (isinstance(value, list | tuple) and not value):
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            out += [flag, *map(_arg, value)]
        else:
            out += [flag, _arg(value)]
    return out


def lora_server_args(args: dict[str, Any], lora: Any) -> dict[str, Any]:
    """`args` (normalised `rollout.sglang.args`) with the LoRA flags a run with `lora` (`rank`, `target_modules`)
    needs: enable-lora, max-lora-rank, lora-target-modules, each added unless the recipe's args set it already. Args
    that set them too small for the run (a lower rank, modules left out) are refused, naming the flag."""
    limits = LoraLimits.of(lora)
    if limits is None:
        return dict(args)
    out = dict(args)
    if out.get("enable-lora") is False:
        raise ValueError("rollout.sglang.args.enable-lora: false, but the run trains a LoRA adapter (train.lora)")
    out["enable-lora"] = True
    rank = out.setdefault("max-lora-rank", limits.rank)
    if int(rank) < limits.rank:
        raise ValueError(f"rollout.sglang.args.max-lora-rank: {rank} is below train.lora.rank ({limits.rank})")
    given = out.setdefault("lora-target-modules", list(limits.target_modules))
    given = [given] if isinstance(given, str) else list(given)
    if "all" not in given:
        missing = sorted(set(limits.target_modules) - set(given))
        if missing:
            raise ValueError(f"rollout.sglang.args.lora-target-modules: {given} leaves out {missing} of "
                             "train.lora.target_modules")
    return out


def _arg(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def safetensors_header(path: str | Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets; and `__metadata__`) and where its data
    starts."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def safetensors_bytes(folder: str | Path) -> int:
    """Bytes of the tensors in a folder's *.safetensors files, from their headers (nothing is loaded)."""
    total = 0
    for path in Path(folder).glob("*.safetensors"):
        header, _ = safetensors_header(path)
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


# transformers 5's module names of Qwen2-VL / Qwen2.5-VL -> the checkpoint's, which SGLang's model classes use
# (sglang 0.5.10.post1 srt/models/qwen2_vl.py:458-478 and qwen2_5_vl.py:604-633 build `visual`, `model`, `lm_head`;
# their load_weights, qwen2_vl.py:573 and qwen2_5_vl.py:792, rename only q/k/v, gate/up and visual `attn.qkv`)
SGLANG_VL_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def sglang_weight_name(name: str) -> str:
    """A vision-language weight's name as SGLang's Qwen2-VL / Qwen2.5-VL load it: the checkpoint's
    (`model.language_model.layers.0...` -> `model.layers.0...`, `model.visual.blocks...` -> `visual.blocks...`)."""
    for module, checkpoint in SGLANG_VL_PREFIXES:
        if name.startswith(module):
            return checkpoint + name[len(module):]
    return name


def renamed_safetensors(src: str | Path, dst: str | Path, rename: Callable[[str], str]) -> bool:
    """Copy the *.safetensors files of folder `src` into `dst` with every tensor renamed by `rename`: the header is
    written anew, the data bytes are copied as they are. False, and nothing written, when no name changes."""
    files = sorted(Path(src).glob("*.safetensors"))
    headers = [safetensors_header(f) for f in files]
    if all(rename(k) == k for h, _ in headers for k in h if k != "__metadata__"):
        return False
    Path(dst).mkdir(parents=True, exist_ok=True)
    for path, (header, start) in zip(files, headers, strict=True):
        renamed = {k if k == "__metadata__" else rename(k): v for k, v in header.items()}
        if len(renamed) != len(header):
            raise ValueError(f"{path}: two tensors take one name once renamed for SGLang")
        text = json.dumps(renamed, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as safetensors writes it
        with open(path, "rb") as f, open(Path(dst) / path.name, "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            f.seek(start)
            shutil.copyfileobj(f, out)
    return True


def image_token_id(model_path: str | Path) -> int | None:
    """The image pad token id of a vision-language model directory (config.json's `image_token_id`); None for a
    text model."""
    if not is_vision_language(model_path):
        return None
    config = json.loads((Path(model_path) / "config.json").read_text())
    if "image_token_id" not in config:
        raise ValueError(f"{model_path}/config.json: a vision-language model without image_token_id")
    return int(config["image_token_id"])


def generate_body(prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int,
                  image_data: Sequence[Sequence[str]] | None = None, pad_id: int | None = None) -> dict:
    """SGLang's batched /generate for `params.n` requests per prompt (prompt-major), each with its sampling_seed.
    `image_data`: one list of images per prompt ([] for a text prompt); sent, one list per request, only when some
    prompt has images, and then each prompt's pad runs are collapsed when `pad_id` is given (SGLang's form)."""
    one = params.model_dump(exclude={"n"})
    n = params.n
    ids = [list(p) for p in prompts for _ in range(n)]
    body: dict[str, Any] = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": [one | {"sampling_seed": request_seed(seed, i)} for i in range(len(ids))],
    }
    if image_data is None or not any(image_data):
        return body
    if len(image_data) != len(prompts):
        raise ValueError(f"image_data: {len(image_data)} lists of images for {len(prompts)} prompts; expected one "
                         "list per prompt ([] for a text prompt)")
    if pad_id is not None:
        body["input_ids"] = [collapse_image_pads(p, pad_id) for p in prompts for _ in range(n)]
        for i, (p, images) in enumerate(zip(body["input_ids"][::n], image_data, strict=True)):
            if p.count(pad_id) != len(images):
                raise ValueError(f"image_data: prompt {i} places {p.count(pad_id)} images and has {len(images)}")
    # a list for every request, [] for a text one: SGLang reads image_data as a list of lists only when its first
    # entry is a list (io_struct.py _normalize_image_data); a None first would wrap every entry as one image
    body["image_data"] = [list(images) for images in image_data for _ in range(n)]
    return body


def check_prompt_tokens(prompt: Sequence[int], item: dict, where: str) -> None:
    """SGLang counts a prompt with images as its processor expanded it (meta_info.prompt_tokens); a count that
    differs from rlflow's means its image processor (min/max pixels) or tokenizer differs from the trainer's, and the
    log-probs it returns were computed on another prompt."""
    got = item["meta_info"].get("prompt_tokens")
    if got is not None and got != len(prompt):
        raise RuntimeError(f"rollout.sglang: {where}: SGLang expanded the prompt with its images to {got} tokens, "
                           f"rlflow's processor to {len(prompt)}: the server's image processor "
                           "(preprocessor_config.json) or tokenizer differs from the trainer's")


def request_seed(seed: int, index: int) -> int:
    """The `sampling_seed` of request `index` of a call seeded with `seed` (nearby seeds and indices differ)."""
    return int(np.random.SeedSequence([seed & (2**63 - 1), index]).generate_state(1, dtype=np.uint64)[0]) & (2**63 - 1)


def generation_from_item(prompt: list[int], item: dict) -> Generation:
    """A Generation from one SGLang /generate item returned with return_logprob. SGLang writes a -inf logprob (a
    token its filters had ruled out) as JSON null, and a fresh server's weight_version is "default" (version 0)."""
    meta = item["meta_info"]
    logprobs = [-math.inf if x[0] is None else float(x[0]) for x in meta.get("output_token_logprobs") or []]
    return Generation(
        prompt,
        list(item["output_ids"]),
        logprobs,
        meta["finish_reason"],
        parse_weight_version(meta.get("weight_version"), "meta_info.weight_version"),
        rid=str(meta.get("id", "")),
        meta=meta,
    )


class SGLangRolloutBackend(RolloutBackend, StoreReceiver, DiskReceiver, DistributedReceiver, AdapterReceiver,
                           DeltaReceiver):
    def __init__(
        self,
        model_path: str,
        sglang: SGLangConfig | dict | None = None,
        rank: int = 0,
        threads: int | None = None,
        log_dir: str | None = None,
        python: str | None = None,
        host: str = "127.0.0.1",
        token: str | None = None,
        weight_dirs: Iterable[str] = (),
        lora: Any = None,
    ):
        """Launch the server on `host` and wait until it answers. `threads` sets the child's OMP_NUM_THREADS
        (unless the environment has it); its log goes to `<log_dir>/server.log` (default: a new temporary
        folder). `token`: SGLang's --api-key, sent with every request this worker makes. `weight_dirs`: the folders
        the server may load weights from besides the model (with this worker's own; rlflow's launch module only).
        `lora`: the run's `train.lora` (`rank`, `target_modules`): the server is launched to load such adapters."""
        self.model_path, self.rank, self.threads = str(model_path), rank, threads
        self.cfg = sglang if isinstance(sglang, SGLangConfig) else SGLangConfig.model_validate(sglang or {})
        self.launch_args = lora_server_args(self.cfg.args, lora)  # the recipe's args and the run's LoRA flags
        self.python = python or self.cfg.python or sys.executable
        self.weight_version = 0
        self.last_update_s = 0.0
        self._released: set[str] = set()  # SGLang memory tags released and not resumed yet
        self.adapters: dict[str, str] = {}  # LoRA adapters the server serves: {name: folder}
        self._loaded_dir: Path | None = (
            None  # a weights folder of this worker's the server loaded last (its model_path)
        )
        self._dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"rlflow-sglang-{rank}-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self._delta = DeltaFollower()  # the delta transport's host mirror of the last version applied
        self.weight_dirs = [*weight_dirs, str(self._dir)]  # update_weights writes its folders under _dir
        self.log_path = self._dir / "server.log"
        self.proc: subprocess.Popen | None = None
        self._guard: subprocess.Popen | None = None
        self._log = None
        self.url: str | None = None
        self.command: list[str] = []
        self._http = httpx.Client(timeout=httpx.Timeout(None, connect=10))
        self._host, self._token = host, token
        self._weight_bytes = safetensors_bytes(self.model_path)
        # a vision-language model's image pad token; SGLang (not rlflow's embedded launcher) takes its prompts with one
        # pad per image and its weights under checkpoint names (the module's docstring)
        self.image_token_id = image_token_id(self.model_path)
        self.sglang_forms = self.image_token_id is not None and self.cfg.launch_module != EMBEDDED_LAUNCHER
        self._update_bytes = 0  # received by the buckets of the update in progress (end_weight_update counts them)
        atexit.register(self.close)
        self.start_server(host, token=token)

    # ---- the server process ----------------------------------------------------------------------------
    def start_server(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> str:
        """Launch the server and wait for /health; a running one on the same host and token is kept (its URL).
        `token` becomes SGLang's --api-key: every route then needs it, and this worker sends it."""
        if self.proc is not None and self.proc.poll() is None and (host, token) == (self._host, self._token):
            return self.url
        self.close_server()
        self._host, self._token = host, token
        self._http.headers.pop("Authorization", None)
        self._http.headers.update(auth_headers(token))
        port = port or free_port()
        self.command = [
            self.python,
            "-m",
            self.cfg.launch_module,
            "--model-path",
            self.model_path,
            "--host",
            host,
            "--port",
            str(port),
            *server_args(self.launch_args),
            *self._token_args(token),
        ]
        self.adapters = {}  # a new server serves none
        env = dict(os.environ)
        env[WEIGHT_DIRS_ENV] = os.pathsep.join(self.weight_dirs)
        if self.threads and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes it until close()
        self._log.write(f"$ {self.shown_command()}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self._guard = start_guard(self.proc.pid, STOP_GRACE_S)
        self.url = f"http://{host}:{port}"
        self._wait_healthy()
        return self.url

    def _token_args(self, token: str | None) -> list[str]:
        """`--api-key=<token>`: one argument, since a token may start with "-". Without a token, rlflow's embedded
        launcher is told its control routes are open (it refuses to start otherwise); SGLang's serves them open."""
        if token:
            return [f"--api-key={token}"]
        return ["--insecure-no-token"] if self.cfg.launch_module == EMBEDDED_LAUNCHER else []

    def shown_command(self) -> str:
        """The launch command for logs and errors, the control token masked."""
        shown = " ".join(self.command)
        return shown.replace(self._token, "***") if self._token else shown

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.close_server()
                raise RuntimeError(
                    f"rollout.sglang: the server exited with code {code} before answering /health "
                    f"({self.shown_command()}). The end of its log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            try:
                if self._http.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close_server()
                raise TimeoutError(
                    f"rollout.sglang: the server did not answer {self.url}/health within "
                    f"{self.cfg.startup_timeout_s:g} s (rollout.sglang.startup_timeout_s). The end of "
                    f"its log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return data[-chars:].decode(errors="replace")

    def server_url(self) -> str | None:
        return self.url

    def pid(self) -> int:
        """This worker's process id (fault-injection drills kill it; the guard then stops the server)."""
        return os.getpid()

    def server_pid(self) -> int | None:
        """The server's process id, which is also its process group's."""
        return None if self.proc is None else self.proc.pid

    def close_server(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after STOP_GRACE_S) and its guard."""
        proc, self.proc, self.url = self.proc, None, None
        if proc is not None:
            stop_group(proc.pid, STOP_GRACE_S, leader=proc)
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.stdin.close()  # the server is gone: the guard finds nothing to stop and exits
            try:
                guard.wait(timeout=STOP_GRACE_S + 5)
            except subprocess.TimeoutExpired:
                guard.kill()
                guard.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self.close_server()
        self._http.close()
        atexit.unregister(self.close)

    # ---- HTTP ------------------------------------------------------------------------------------------
    def _post(self, route: str, body: dict | None = None, ok: tuple[int, ...] = (200,)) -> httpx.Response:
        if self.url is None:
            raise RuntimeError("rollout.sglang: the server is not running (start_server)")
        r = self._http.post(self.url + route, json=body or {})
        if r.status_code not in ok:
            raise RuntimeError(f"rollout.sglang: {route} answered {r.status_code}: {r.text[:500]}")
        return r

    def _get_info(self, route: str, deprecated: str) -> dict:
        """GET `route`, or its deprecated name on a server older than the route (404)."""
        if self.url is None:
            raise RuntimeError("rollout.sglang: the server is not running (start_server)")
        r = self._http.get(self.url + route)
        if r.status_code == 404:
            r = self._http.get(self.url + deprecated)
        if r.status_code != 200:
            raise RuntimeError(f"rollout.sglang: {route} answered {r.status_code}: {r.text[:500]}")
        return r.json()

    def server_info(self) -> dict:
        """SGLang's /server_info (its server args, scheduler info, internal states); /get_server_info on servers
        that predate it."""
        return self._get_info("/server_info", "/get_server_info")

    def model_info(self) -> dict:
        """SGLang's /model_info (model_path, weight_version, ...); /get_model_info on servers that predate it."""
        return self._get_info("/model_info", "/get_model_info")

    # ---- memory (colocation) ---------------------------------------------------------------------------
    def release_memory_occupation(self) -> None:
        """Give the server's GPU memory (weights, KV cache, CUDA graphs) to the colocated trainer, in slime's order:
        wait until no request runs (SGLang's release asserts an idle server) and flush the cache, then release every
        tag. SGLang frees memory only when launched with `enable-memory-saver: true`."""
        if self._released:
            return
        self._drain()
        self._post("/release_memory_occupation", {"tags": list(MEMORY_TAGS)})
        self._released = set(MEMORY_TAGS)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take the memory of these kinds back (None: all), the weights before the KV cache and CUDA graphs. A weight
        update takes the weights' itself; the KV cache and CUDA graphs follow once the trainer has parked its state
        (engines/session/colocation.py), as slime orders it."""
        for group in (["weights"], ["kv_cache", "cuda_graph"]):
            self._resume([t for t in group if tags is None or t in tags])

    def _resume(self, tags: list[str]) -> None:
        todo = [t for t in tags if t in self._released]
        if todo:
            self._post("/resume_memory_occupation", {"tags": todo})
            self._released -= set(todo)

    def _drain(self) -> None:
        """Wait until the server runs no request: SGLang's /flush_cache flushes only then (400 while requests run
        or wait), so its 200 is the idle signal and the flush in one."""
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while True:
            r = self._post("/flush_cache", ok=(200, 400))
            if r.status_code == 200:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rollout.sglang: {self.url} still runs requests after "
                    f"{self.cfg.drain_timeout_s:g} s (rollout.sglang.drain_timeout_s); its memory "
                    f"cannot be released while they run. Last /flush_cache: {r.text[:200]}"
                )
            time.sleep(0.05)

    def end_weight_update(self) -> None:
        """The update's last bucket arrived: the prefix cache, computed with the old weights, is flushed once (each
        bucket went with flush_cache false). A flush refused because requests still run is skipped, as SGLang's own
        per-update flush is. (Colocated, the KV cache comes back later: `resume_memory_occupation`.)"""
        self._post("/flush_cache", ok=(200, 400))
        if self._update_bytes:
            self._weight_bytes, self._update_bytes = self._update_bytes, 0

    # ---- weights ---------------------------------------------------------------------------------------
    def pause_generation(self) -> None:
        """SGLang's /pause_generation in `retract` mode: running requests go back to its queue (their caches may
        be flushed by the update and are recomputed with the new weights) and continue after
        `continue_generation`. Without the pause SGLang's update waits for every request in flight to finish."""
        self._post("/pause_generation", {"mode": "retract"})

    def continue_generation(self) -> None:
        self._post("/continue_generation")

    def update_weights_from_disk(self, path: str | Path, version: int) -> int:
        """The server loads every *.safetensors file of the local folder `path` (HF names; all weights or some)
        and numbers its weights `version` (SGLang's /update_weights_from_disk). SGLang then reports `path` as its
        model_path: the folder must stay until the next update (the disk transport and `update_weights` keep it).
        A vision-language model's files under transformers' names are loaded from a copy of this worker's under
        SGLang's names (`renamed_safetensors`), kept as `update_weights` keeps its folders."""
        if not self.sglang_forms:
            return self._load_from_disk(path, version)
        renamed = Path(tempfile.mkdtemp(prefix="weights-", dir=self._dir))
        try:
            if not renamed_safetensors(path, renamed, sglang_weight_name):
                renamed.rmdir()
                return self._load_from_disk(path, version)
            self._load_from_disk(renamed, version)
        except BaseException:
            shutil.rmtree(renamed, ignore_errors=True)
            raise
        self._keep_loaded(renamed)
        return version

    def _load_from_disk(self, path: str | Path, version: int) -> int:
        """POST /update_weights_from_disk for a folder whose names the server takes as they are."""
        t0 = time.perf_counter()
        self._resume(["weights"])
        r = self._post(
            "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version), "flush_cache": False}
        )
        answer = r.json()
        if not answer.get("success", False):
            raise RuntimeError(f"rollout.sglang: /update_weights_from_disk {path}: {answer.get('message')}")
        self._update_bytes += safetensors_bytes(path)
        self.weight_version = version
        self.last_update_s = time.perf_counter() - t0
        return version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> int:
        """Tensors that reached the worker (the `ray` transport, a checkpoint's weights): written to a folder of
        this worker's and loaded from there, since SGLang's tensor route would need them pickled. The folder the
        server loaded stays (it is the server's model_path now) until the next one is loaded."""
        version = self.weight_version if version is None else version
        folder = Path(tempfile.mkdtemp(prefix="weights-", dir=self._dir))
        try:
            tensors = {self._server_name(n): t.detach().cpu().contiguous() for n, t in named_tensors}
            save_file(tensors, str(folder / "model.safetensors"))
            loaded = self._load_from_disk(folder, version)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._keep_loaded(folder)
        return loaded

    def _keep_loaded(self, folder: Path) -> None:
        """`folder`, of this worker's, is the server's model_path now: the one it loaded before goes."""
        previous, self._loaded_dir = self._loaded_dir, folder
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    def _server_name(self, name: str) -> str:
        """A weight's name as this server loads it (SGLang's checkpoint names for a vision-language model)."""
        return sglang_weight_name(name) if self.sglang_forms else name

    def update_weights_from_store(self, storage: StorageConfig, run: str, version: int, index: int) -> int:
        """Bucket `index` of weight version `version` from the run store (the `store` transport)."""
        return self.update_weights(get_bucket(storage, run, version, index), version)

    def update_weights_from_delta(self, storage: StorageConfig, run: str, version: int) -> dict:
        """The `delta` transport: this worker (the Ray actor, beside the server) rebuilds `version` on its host
        mirror from the run store and hands the whole model to the server as `update_weights` does."""
        result = self._delta.follow(RunStore(storage, run), version)
        if result.applied:
            self.update_weights(self._delta.tensors(), version)
        return result.as_dict()

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = GROUP_NAME,
        backend: str = "nccl",
    ) -> None:
        """Join the trainer's weight-update group as rank `rank_offset` (SGLang's /init_weights_update_group). It
        returns once all ranks joined: the trainer joins at the same time (join_weights_update_group)."""
        self._post(
            "/init_weights_update_group",
            init_request(master_address, master_port, rank_offset, world_size, group_name, backend),
        )

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int, group_name: str = GROUP_NAME
    ) -> int:
        """Receive these weights from the group's rank 0, one broadcast per name in order, while the trainer sends
        them (broadcast_weights); SGLang's /update_weights_from_distributed."""
        t0 = time.perf_counter()
        self._resume(["weights"])
        sent = [self._server_name(n) for n in names]
        self._post("/update_weights_from_distributed", update_request(sent, dtypes, shapes, version, group_name))
        self._update_bytes += sum(
            math.prod(s) * getattr(torch, d).itemsize for d, s in zip(dtypes, shapes, strict=True)
        )
        self.weight_version = version
        self.last_update_s = time.perf_counter() - t0
        return version

    def destroy_weights_update_group(self, group_name: str = GROUP_NAME) -> None:
        self._post("/destroy_weights_update_group", {"group_name": group_name})

    def weight_update_ranks(self) -> int:
        """SGLang joins the group as rank_offset + tp_rank from each tensor-parallel rank (pipeline stages would
        collide: the recipe refuses pp-size > 1 with this transport)."""
        return weight_update_ranks(self.cfg.args)

    def weight_dtype(self) -> str:
        """The dtype the server holds its weights in ("bfloat16", ...): what the distributed transport broadcasts,
        so no byte is sent that the server would drop. A concrete `dtype` in /server_info is taken as it is;
        SGLang's `auto` is resolved from the model's config.json as SGLang resolves it."""
        return server_dtype(self.server_info().get("dtype"), self.model_path)

    def weight_bytes(self) -> int:
        """Bytes the last whole update delivered, all its buckets (the model's files at first): as stored on disk,
        or as broadcast in the server's dtype."""
        return self._weight_bytes

    def last_update_seconds(self) -> float:
        return self.last_update_s

    def drain_trace(self) -> list[dict]:
        """The server's per-request events are not collected from SGLang: none."""
        return []

    # ---- LoRA adapters ---------------------------------------------------------------------------------
    def _lora_route(self, route: str, body: dict) -> dict:
        """POST one of SGLang's LoRA routes; RuntimeError with its error_message unless it answers success."""
        r = self._post(route, body, ok=(200, 400, 403))
        try:
            answer = r.json()
        except ValueError:
            answer = {}
        if r.status_code != 200 or not answer.get("success", False):
            message = answer.get("error_message") or (answer.get("error") or {}).get("message") or r.text[:500]
            raise RuntimeError(f"rollout.sglang: {route} {body.get('lora_name')!r} failed ({r.status_code}): "
                               f"{message}")
        return answer

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """SGLang's /load_lora_adapter: the server reads the PEFT adapter in its local folder `lora_path` and
        serves it as `lora_name` (generation requests name it in lora_path). A name it serves already is
        unloaded first (SGLang refuses a loaded name; the adapter transport loads every version as one name), so
        requests naming it between the two calls are refused: syncs land between rollout steps."""
        t0 = time.perf_counter()
        if lora_name in self.adapters:
            self.unload_lora_adapter(lora_name)
        self._lora_route("/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(lora_path)})
        self.adapters[lora_name] = str(lora_path)
        # prefixes cached under the previous version of this name are stale, as after a weight update
        # (end_weight_update): flushed, unless requests still run (then SGLang refuses, and they finish first)
        self._post("/flush_cache", ok=(200, 400))
        self.last_update_s = time.perf_counter() - t0

    def unload_lora_adapter(self, lora_name: str) -> None:
        self._lora_route("/unload_lora_adapter", {"lora_name": lora_name})
        self.adapters.pop(lora_name, None)

    def update_weight_version(self, version: int) -> None:
        """SGLang's /update_weight_version, leaving requests in flight alone (abort_all_requests false)."""
        self._post("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        self.weight_version = version

    # ---- generation ------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 image_data: Sequence[Sequence[str]] | None = None) -> list[Generation]:
        """One batched /generate with `params.n` requests per prompt (prompt-major), each with its own
        sampling_seed derived from (seed, index); returns when all finished. `image_data`: each prompt's images
        (base64 data URIs, as PromptSample.image_data; [] for a text prompt) for a vision-language model, whose
        prompts hold each image's pad token once per merged patch; the Generations keep those prompts."""
        if not prompts:
            return []
        if image_data is not None and any(image_data) and self.image_token_id is None:
            raise ValueError(f"image_data: {self.model_path} is not a vision-language model (config.json model_type)")
        seed = random.getrandbits(63) if seed is None else seed
        pad = self.image_token_id if self.sglang_forms else None
        body = generate_body(prompts, params, seed, image_data, pad)
        answers = self._post("/generate", body).json()
        ids = [list(p) for p in prompts for _ in range(params.n)]
        gens = [generation_from_item(prompt, a) for prompt, a in zip(ids, answers, strict=True)]
        if "image_data" in body:
            for i, (prompt, a) in enumerate(zip(ids, answers, strict=True)):
                check_prompt_tokens(prompt, a, f"/generate request {i}")
        return gens

    def generate_packed(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                        image_data: Sequence[Sequence[str]] | None = None) -> dict:
        """`generate`, as the flat arrays the RL loop moves over Ray (torch_backend.pack_generations)."""
        return pack_generations(self.generate(prompts, params, seed, image_data))
