"""`python -m rlflow.engines.rollout.launch`: the embedded rollout server as a process of its own, a stand-in for
`python -m sglang.launch_server` (the SGLang backend launches either).

Its control routes (weights, memory, aborts, cache, process groups) take orders from whoever reaches its port, so it
starts only with `--api-key` (required on them) or with `--insecure-no-token`, which says they are meant to be open
(docs/security.md)."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import uvicorn

from rlflow.engines.core.config import KVCacheConfig
from rlflow.engines.rollout.server import build_app
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.rollout.weight_routes import WEIGHT_DIRS_ENV

# SGLang's launch_server flags the embedded server takes (names, defaults and meanings from SGLang's server_args);
# any other flag is refused by name rather than ignored
DTYPE_FLAGS = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
               "float32": "float32"}
NO_TOKEN_FLAG = "--insecure-no-token"  # rlflow's: serve the control routes without a token


def main(argv: list[str] | None = None) -> None:
    """Serve one model as `sglang.launch_server` would, with the subset of its flags the embedded engine has:
    --model-path (--model), --host, --port, --dtype, --device, --context-length, --max-running-requests,
    --random-seed, --enable-deterministic-inference (always on here), --api-key (here required on control routes
    only), --enable-lora with --max-lora-rank and --lora-target-modules (one adapter served at a time, merged:
    engines/rollout/lora.py); and rlflow's --weight-dir and --insecure-no-token (no --api-key: the control routes
    open). Stops on SIGTERM / SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m rlflow.engines.rollout.launch", allow_abbrev=False,
                                     description="rlflow's embedded rollout server with SGLang's routes and a "
                                     "subset of sglang.launch_server's flags.")
    parser.add_argument("--model-path", "--model", dest="model_path", required=True,
                        help="A local Hugging Face model folder.")
    parser.add_argument("--host", default="127.0.0.1", help="The host of the HTTP server.")
    parser.add_argument("--port", type=int, default=30000, help="The port of the HTTP server.")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_FLAGS],
                        help="Weights and compute dtype; auto: the checkpoint's (SGLang's auto serves FP32 "
                        "checkpoints in FP16).")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="Default: cuda when a GPU is visible, else cpu.")
    parser.add_argument("--context-length", type=int, default=None,
                        help="Tokens per sequence, prompt included (default: the model's maximum, within the KV "
                        "page pool).")
    parser.add_argument("--max-running-requests", type=int, default=None,
                        help="Requests decoded together (page-table rows; default 512).")
    parser.add_argument("--page-size", type=int, default=None, help="Tokens per KV-cache page (default 16).")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="Tokens the KV page pool holds (default: a share of the free GPU memory, "
                        "--kv-memory-fraction; 65536 on CPU).")
    parser.add_argument("--kv-memory-fraction", type=float, default=None,
                        help="Share of the GPU memory free after loading the weights that the KV page pool takes "
                        "(default 0.5). rlflow's: SGLang's --mem-fraction-static counts the total memory.")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="Prompt tokens prefilled per engine step (default 8192); longer prompts are chunked.")
    parser.add_argument("--enable-torch-compile", action="store_true",
                        help="CUDA: torch.compile the decode step before capturing it in CUDA graphs.")
    parser.add_argument("--random-seed", type=int, default=None,
                        help="Seeds the server's random generators (requests without a sampling_seed).")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="Accepted for SGLang's sake: the embedded engine always samples a request with a "
                        "sampling_seed the same way, whatever else shares its batch.")
    parser.add_argument("--api-key", default=None,
                        help="Required as 'Authorization: Bearer <key>' on the control routes (weights, memory, "
                        f"aborts, cache, process groups). Without it, give {NO_TOKEN_FLAG}.")
    parser.add_argument(NO_TOKEN_FLAG, action="store_true",
                        help="Start without --api-key: the control routes then obey any process that reaches the "
                        "port (push weights, load a folder's, abort, dial a host). For a test or a benchmark on a "
                        "machine of your own. rlflow's, not SGLang's.")
    parser.add_argument("--enable-lora", action="store_true",
                        help="Serve LoRA adapters (/load_lora_adapter); the embedded engine merges one at a time.")
    parser.add_argument("--max-lora-rank", type=int, default=None,
                        help="The largest adapter rank /load_lora_adapter takes (required with --enable-lora).")
    parser.add_argument("--lora-target-modules", nargs="+", default=None,
                        help="The modules adapters may target (q_proj k_proj ...; 'all': every linear module).")
    parser.add_argument("--max-loras-per-batch", type=int, default=None,
                        help="Accepted for SGLang's sake: the embedded engine serves one adapter at a time.")
    parser.add_argument("--weight-dir", dest="weight_dirs", action="append",
                        default=[d for d in os.environ.get(WEIGHT_DIRS_ENV, "").split(os.pathsep) if d],
                        help="A folder /update_weights_from_disk may load from besides --model-path (repeat for "
                        f"more; default: ${WEIGHT_DIRS_ENV}, {os.pathsep}-separated). rlflow's, not SGLang's.")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")] or unknown
        known = sorted({s for a in parser._actions for s in a.option_strings} - {"-h", "--help"})
        parser.error(f"the embedded server does not support {', '.join(flags)} (it takes SGLang's {', '.join(known)})")

    if not args.api_key and not args.insecure_no_token:
        parser.error(f"give --api-key KEY (then required as 'Authorization: Bearer KEY' on the control routes: "
                     f"weights, memory, aborts, cache, process groups), or {NO_TOKEN_FLAG} to serve those routes open "
                     "to every process that reaches the port")
    if args.api_key and args.insecure_no_token:
        parser.error(f"--api-key and {NO_TOKEN_FLAG}: give one")
    if args.insecure_no_token:
        print(f"WARNING: {NO_TOKEN_FLAG}: the control routes (weights, memory, aborts, cache, process groups) obey "
              f"any process that reaches http://{args.host}:{args.port}", file=sys.stderr, flush=True)

    lora = None
    if args.enable_lora:
        if args.max_lora_rank is None or not args.lora_target_modules:
            parser.error("--enable-lora: give --max-lora-rank and --lora-target-modules (the embedded server loads "
                         "adapters after start-up only, so it cannot infer them from --lora-paths)")
        lora = {"rank": args.max_lora_rank, "target_modules": args.lora_target_modules}
    elif args.max_lora_rank is not None or args.lora_target_modules:
        parser.error("--max-lora-rank / --lora-target-modules: give --enable-lora too")
    if args.random_seed is not None:
        random.seed(args.random_seed)
        np.random.seed(args.random_seed % 2**32)
        torch.manual_seed(args.random_seed)
    dtype_name = DTYPE_FLAGS.get(args.dtype)
    if dtype_name is None:  # auto: the dtype the checkpoint was saved in
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        saved = config.get("torch_dtype") or config.get("dtype")
        dtype_name = saved if saved in ("float32", "bfloat16", "float16") else "float32"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = {"batch_size": args.max_running_requests, "context_len": args.context_length,
              "compile": args.enable_torch_compile}
    kv = {"page_size": args.page_size, "tokens": args.max_total_tokens, "memory_fraction": args.kv_memory_fraction,
          "prefill_chunk_tokens": args.chunked_prefill_size}
    backend = TorchRolloutBackend(args.model_path, device=device, dtype=getattr(torch, dtype_name),
                                  kv_cache=KVCacheConfig(**{k: v for k, v in kv.items() if v is not None}), lora=lora,
                                  **{k: v for k, v in kwargs.items() if v is not None})
    app = build_app(backend, args.api_key, args.weight_dirs)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                          log_level="warning", lifespan="off", timeout_keep_alive=30))
    print(f"rlflow embedded rollout server: {args.model_path} ({device}, {dtype_name}) on "
          f"http://{args.host}:{args.port}", flush=True)
    try:
        server.run()  # returns on SIGTERM / SIGINT
    finally:
        backend.close()


if __name__ == "__main__":
    main()
