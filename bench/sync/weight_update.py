"""SGLang's distributed weight update over NCCL between two GPUs, against the raw link, in one run.

    PYTHONUNBUFFERED=1 python -m bench.sync.weight_update --out gpu_weight_update.json

GPU 0 is the trainer: this process holds fp32 weights of a random Qwen2-0.5B-shaped model and sends them
with engines/sync/distributed.py's sender. GPU 1 runs the embedded rollout server (`python -m
rlflow.engines.rollout.launch`, bf16), which joins the group through /init_weights_update_group and receives
through /update_weights_from_distributed, as an SGLang server does (the `distributed` transport). Every
weight goes as bf16, in one request or in buckets of --bucket-mb; an update's time is the driver's wall time
from the first request to the last answer (the server has loaded the weights), the fp32 -> bf16 cast
included. The raw link is a plain NCCL broadcast of as many bytes between the same two GPUs (a helper process
on GPU 1). Checked: after an update, the server's greedy tokens and logprobs equal a local engine's holding
the sent weights.

`--smoke` runs a tiny model with gloo on the CPU to check the script itself (no link figure).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from bench import harness
from bench.rollout.gpu import build_model
from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.sampling import SamplingParams
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.sync.base import plan_buckets
from rlflow.engines.sync.distributed import (
    broadcast_weights,
    destroy_weights_update_group,
    dtype_name,
    init_request,
    join_weights_update_group,
    update_request,
)
from rlflow.engines.sync.nccl import NcclChannel

GROUP = "bench-weight-update"


def watchdog(server: subprocess.Popen, seconds: float) -> None:
    """After `seconds`, print where this process and the server are (a hang shows where it hangs)."""
    def fire() -> None:
        time.sleep(seconds)
        harness.say("watchdog: stacks of this process, then the server's")
        faulthandler.dump_traceback(all_threads=True)
        server.send_signal(signal.SIGABRT)  # the server runs with PYTHONFAULTHANDLER=1

    threading.Thread(target=fire, daemon=True).start()


def start_server(path: Path, gpu: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = os.environ | {"PYTHONFAULTHANDLER": "1"} | ({"CUDA_VISIBLE_DEVICES": "1"} if gpu else {})
    proc = subprocess.Popen([sys.executable, "-m", "rlflow.engines.rollout.launch", "--model-path", str(path), "--port",
                             str(port), "--dtype", "bfloat16" if gpu else "float32", "--device",
                             "cuda" if gpu else "cpu", "--insecure-no-token"], env=env)  # a bench on loopback
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the rollout server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the rollout server did not answer /health")


HTTP = httpx.Client(timeout=httpx.Timeout(None, connect=10))  # kept alive: a new client costs ~25 ms


def post(url: str, route: str, body: dict) -> dict:
    r = HTTP.post(url + route, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{route}: {r.status_code} {r.text[:500]}")
    return r.json()


def greedy(url: str, prompts: list[list[int]]) -> list[dict]:
    return post(url, "/generate", {"input_ids": prompts, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}})


def join(url: str, backend: str):
    """This process as rank 0 and the server as rank 1 of a new weight-update group (both join at once)."""
    port = free_port()
    joined = threading.Thread(target=post, args=(url, "/init_weights_update_group", init_request(
        "127.0.0.1", port, 1, 2, GROUP, backend)))
    joined.start()
    group = join_weights_update_group("127.0.0.1", port, 0, 2, GROUP, backend)
    joined.join()
    return group


def update(url: str, group, params: dict[str, torch.Tensor], buckets: list[list[str]], dtype: torch.dtype,
           version: int) -> float:
    """One weight update, bucket by bucket: the server's request and this process's broadcast together."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        for names in buckets:
            body = update_request(names, [dtype_name(dtype)] * len(names),
                                  [list(params[n].shape) for n in names], version, GROUP)
            answer = pool.submit(post, url, "/update_weights_from_distributed", body)
            broadcast_weights(group, [params[n].to(dtype) for n in names])
            if not answer.result().get("success"):
                raise RuntimeError(f"/update_weights_from_distributed: {answer.result()}")
    return time.perf_counter() - t0


def link_gb_per_s(nbytes: int, repeats: int) -> float:
    """A plain NCCL broadcast of `nbytes` from GPU 0 to a helper process on GPU 1."""
    port = free_port()
    helper = subprocess.Popen([sys.executable, "-m", __spec__.name, "--link-receiver", str(port),
                               str(nbytes), str(repeats)], env=os.environ | {"CUDA_VISIBLE_DEVICES": "1"})
    channel = NcclChannel("127.0.0.1", port, 0, 2, torch.device("cuda", 0))
    gb_per_s = channel.measure_bandwidth(nbytes, repeats)
    helper.wait(timeout=120)
    return gb_per_s


def link_receiver(port: int, nbytes: int, repeats: int) -> None:
    """The helper's side of link_gb_per_s: as many broadcasts, received on its GPU."""
    channel = NcclChannel("127.0.0.1", port, 1, 2, torch.device("cuda", 0))
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(1 + repeats):
        channel.broadcast(buf).wait()
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.5B", choices=["0.5B", "smoke"])
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--watchdog-s", type=float, default=1e9, help="dump both processes' stacks after this long")
    ap.add_argument("--link-receiver", nargs=3, type=int, metavar=("PORT", "NBYTES", "REPEATS"))
    harness.add_smoke(ap)
    args = ap.parse_args()
    if args.link_receiver:
        return link_receiver(*args.link_receiver)
    if args.smoke:
        args.size = "smoke"

    gpu = args.size != "smoke"
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args.size, Path(tmp) / "model", device)
        proc, url = start_server(path, gpu)
        watchdog(proc, args.watchdog_s)
        harness.say("server up")
        try:
            # the trainer's fp32 weights: the server's, moved a little, so an update changes what it generates
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
            torch.manual_seed(1)
            params = {n: p.detach() + 0.02 * p.detach().abs().mean() * torch.randn_like(p)
                      for n, p in model.named_parameters()}
            del model
            nbytes = sum(p.numel() * dtype.itemsize for p in params.values())
            prompts = [[int(x) for x in torch.randint(10, 500, (12,), generator=torch.Generator().manual_seed(i))]
                       for i in range(4)]
            before = greedy(url, prompts)
            harness.say("generated before the update")

            group = join(url, "nccl" if gpu else "gloo")
            harness.say("weight-update group joined")

            layout = [(n, p.numel() * dtype.itemsize) for n, p in params.items()]
            modes = {"one request": [list(params)],
                     f"{args.bucket_mb:g} MB buckets": list(plan_buckets(layout, int(args.bucket_mb * 2**20)))}
            result: dict = harness.report_header(__spec__.name, None, name_device=False) | {
                "size": args.size, "weight_bytes": nbytes, "device": harness.device_name(0) if gpu else "cpu",
                "modes": {}}
            version = 0
            for mode, buckets in modes.items():
                times = []
                for _ in range(1 + args.repeats):  # the first is a warm-up
                    version += 1
                    times.append(update(url, group, params, buckets, dtype, version))
                harness.say(f"{mode}: {times}")
                s = statistics.median(times[1:])
                result["modes"][mode] = {"buckets": len(buckets), "seconds": times[1:], "median_s": s,
                                         "gb_per_s": nbytes / s / 1e9}

            after = greedy(url, prompts)
            local = TorchRolloutBackend(str(path), device=device, dtype=dtype, batch_size=len(prompts), threads=1)
            try:
                local.update_weights(((n, p.to(dtype)) for n, p in params.items()), version)
                expected = local.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0,
                                                                  ignore_eos=True), seed=0)
            finally:
                local.close()
            same = all(a["output_ids"] == e.output_ids for a, e in zip(after, expected, strict=True))
            diff = max(abs(lp - x) for a, e in zip(after, expected, strict=True)
                       for (lp, _t, _), x in zip(a["meta_info"]["output_token_logprobs"], e.output_logprobs,
                                                 strict=True))
            moved = max(abs(x[0] - y[0]) for a, b in zip(after, before, strict=True)
                        for x, y in zip(a["meta_info"]["output_token_logprobs"],
                                        b["meta_info"]["output_token_logprobs"], strict=True))
            result["check"] = {"tokens_changed_by_update": any(a["output_ids"] != b["output_ids"]
                                                               for a, b in zip(after, before, strict=True)),
                               "logprob_max_change_by_update": moved,
                               "tokens_equal_local_engine": same, "logprob_max_abs_diff": diff,
                               "weight_version": after[0]["meta_info"]["weight_version"]}
            report(result, args.out)
            if gpu:
                result["link_gb_per_s"] = link_gb_per_s(nbytes, args.repeats)
                for m in result["modes"].values():
                    m["share_of_link"] = m["gb_per_s"] / result["link_gb_per_s"]
                report(result, args.out)
            # both ends leave the group together and join a new one, as a reconnect after a worker restart does
            # (DistributedTransport.connect, engines/sync/distributed.py); the new group brings back the server's
            # first weights
            with ThreadPoolExecutor(1) as pool:
                left = pool.submit(post, url, "/destroy_weights_update_group", {"group_name": GROUP})
                destroy_weights_update_group(group)
                result["group_destroyed"] = bool(left.result(timeout=60).get("success"))
            group = join(url, "nccl" if gpu else "gloo")
            first = {n: p.detach() for n, p in
                     AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).named_parameters()}
            update(url, group, first, [list(first)], dtype, version + 1)
            again = greedy(url, prompts)
            result["rejoined"] = {
                "tokens_equal_first_weights": all(a["output_ids"] == b["output_ids"]
                                                  for a, b in zip(again, before, strict=True)),
                "logprob_max_abs_diff": max(abs(x[0] - y[0]) for a, b in zip(again, before, strict=True)
                                            for x, y in zip(a["meta_info"]["output_token_logprobs"],
                                                            b["meta_info"]["output_token_logprobs"], strict=True)),
            }
            with ThreadPoolExecutor(1) as pool:
                left = pool.submit(post, url, "/destroy_weights_update_group", {"group_name": GROUP})
                destroy_weights_update_group(group)
                result["rejoined"]["group_destroyed"] = bool(left.result(timeout=60).get("success"))
            report(result, args.out)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def report(result: dict, out: str | None) -> None:
    print(json.dumps(result, indent=1), flush=True)
    if out:
        harness.write_json(out, result)


if __name__ == "__main__":
    main()
