"""Bytes per version and seconds per sync of the `delta` weight transport against the full ones (`store`, `disk`),
on a model trained for real steps (rlflow issue 46, item 3):

    PYTHONUNBUFFERED=1 python -m bench.sync.delta --sizes 1.5B --steps 3 --out bench/results/delta_sync_15b.json
    PYTHONUNBUFFERED=1 python -m bench.sync.delta --sizes 7B --steps 2 --transports delta,store --timeout 590 \
        --out bench/results/delta_sync_7b.json

on one H200: 1.5B takes about 3 minutes for all three transports; 7B about 70 s per full version per transport
(measured: its first version), so the second command is sized for a 10-minute device call. The 7B trainer holds
fp32 weights, gradients and AdamW state (122 GB of GPU memory); host memory: about 45 GB at 7B; disk: up to 45 GB
under --workdir. `--smoke` runs the toy shape on the CPU in seconds (what the CPU test does); its numbers mean
nothing. Figures: docs/benchmarks.md.

Each size runs in a child process (bench/harness.py): a random Qwen2-shaped model (bench/rollout/gpu.py's SHAPES)
in fp32 on the GPU takes `--steps` real AdamW steps (`--lr`, 1e-6 by default: at RL learning rates most bf16
weights round to the same value after a step, which is what makes deltas small; a larger lr shows the other end)
on random tokens, a forward and backward in bf16 autocast. Version 1 is the starting weights, version k+1 the
weights after step k. After each version every transport delivers it through its real driver code
(engines/sync/delta.py, store.py, disk.py), in 64 MiB buckets as a run plans them, between bench-side stand-ins
for the two ends: the trainer's (its weights cast to bf16 and copied to the host per bucket, as a train backend's
`named_tensors` does, then the same rlflow code a train backend calls: `put_bucket`, `DeltaPublisher`) and a
rollout worker's (the same rlflow code a rollout backend calls: `get_bucket`, safetensors, `DeltaFollower`; its
"engine" is a host copy of the weights in bf16, so the figures leave out the engine's own copy to its GPU, which
every transport pays alike). The store is a local folder (file://): an object store adds its link's time per byte.

Per version and transport: `sync_s` (the driver's wall time of `transport.update`), `bytes` (what the trainer
wrote: the version's objects; for store and disk the safetensors files), and for delta the trainer's and the
receiver's seconds apart, `ratio` (bytes / the version's bf16 bytes) and whether it was a snapshot. The summary
gives medians over the delta versions (every version after the first, with the default --full-every). A check:
after every sync three tensors of the receiver (first, middle and last layer) equal the trainer's cast to bf16
bit for bit; `changed_fraction` is the share of those tensors' bf16 elements that changed since the last version.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config

from bench import harness
from bench.rollout.gpu import SHAPES
from rlflow.engines.core.config import RLConfig, StorageConfig, config_from_dict
from rlflow.engines.core.protocols import bound
from rlflow.engines.store.run_store import RunStore
from rlflow.engines.sync.base import WeightSource
from rlflow.engines.sync.delta_format import DeltaFollower, DeltaPublisher, torch_dtype
from rlflow.engines.sync.store import get_bucket, put_bucket, version_dir
from rlflow.engines.sync.transports import TRANSPORTS

TRANSPORT_NAMES = ("delta", "store", "disk")


class OneWorker:
    """A worker group of one object in this process: what the transports call (engines/cluster's LocalWorkerGroup
    does the same, but its module imports Ray, which the GPU machines lack)."""

    def __init__(self, worker):
        self.workers = [worker]

    def __len__(self) -> int:
        return 1

    def call(self, method, *args):
        return [bound(self.workers[0], method)(*args)]

    def call_rank0(self, method, *args):
        return bound(self.workers[0], method)(*args)

    submit_rank0 = call_rank0

    def submit(self, method, *args):
        return self.call(method, *args)

    def wait(self, handles):
        return handles


class Trainer:
    """The train side of every transport measured: a module's weights as HF names, and the per-bucket calls a train
    backend makes (each the same rlflow code as TorchTrainBackend's one-liners)."""

    def __init__(self, model: torch.nn.Module):
        self.params = dict(model.named_parameters())
        self.delta = DeltaPublisher()
        self.written = 0  # bytes this version's objects took in the store (or folder)
        self.seconds = 0.0  # this version's time on this side

    def weight_layout(self) -> list[tuple[str, int]]:
        return [(n, p.numel() * 2) for n, p in self.params.items()]  # bf16 on the wire

    def named_tensors(self, names: list[str] | None = None, dtype: torch.dtype | None = None,
                      device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
        return [(n, self.params[n].detach().to(dtype or torch.bfloat16).to(device)) for n in names or self.params]

    def put_weights_to_store(self, storage: StorageConfig, run: str, version: int, index: int,
                             names: list[str]) -> None:
        t0 = time.perf_counter()
        put_bucket(storage, run, version, index, self.named_tensors(names))
        store = RunStore(storage, run)
        self.written += store.fs.size(store.path(*version_dir(version), f"bucket-{index:04d}.safetensors"))
        self.seconds += time.perf_counter() - t0

    def put_weights_delta(self, storage: StorageConfig, run: str, version: int, index: int, names: list[str],
                          dtype: str, base: int | None, level: int) -> dict:
        t0 = time.perf_counter()
        entry = self.delta.put(RunStore(storage, run), version, index, self.named_tensors(names, torch_dtype(dtype)),
                               base, level)
        self.written += entry["stored_bytes"]
        self.seconds += time.perf_counter() - t0
        return entry

    def delta_held(self, buckets: int) -> tuple[str, int] | None:
        return self.delta.held_version(buckets)

    def put_delta_snapshot(self, storage: StorageConfig, run: str, version: int, level: int) -> list[dict]:
        return self.delta.put_snapshot(RunStore(storage, run), version, level)


class Receiver:
    """A rollout worker's side of every transport measured, over an "engine" that is a host copy in bf16."""

    def __init__(self, trainer: Trainer):
        self.weights = {n: torch.empty(p.shape, dtype=torch.bfloat16) for n, p in trainer.params.items()}
        self.delta = DeltaFollower()
        self.seconds = 0.0

    def update_weights(self, named_tensors, version: int | None = None) -> int:
        for name, t in named_tensors:
            self.weights[name].copy_(t)
        return version or 0

    def update_weights_from_store(self, storage: StorageConfig, run: str, version: int, index: int) -> int:
        t0 = time.perf_counter()
        self.update_weights(get_bucket(storage, run, version, index), version)
        self.seconds += time.perf_counter() - t0
        return version

    def update_weights_from_disk(self, path: str, version: int) -> int:
        t0 = time.perf_counter()
        for f in sorted(Path(path).glob("*.safetensors")):
            self.update_weights(load_file(f).items(), version)
        self.seconds += time.perf_counter() - t0
        return version

    def update_weights_from_delta(self, storage: StorageConfig, run: str, version: int) -> dict:
        t0 = time.perf_counter()
        result = self.delta.follow(RunStore(storage, run), version)
        if result.applied:
            self.update_weights(self.delta.tensors(), version)
        self.seconds += time.perf_counter() - t0
        return result.as_dict()

    def weight_dtype(self) -> str:
        return "bfloat16"

    def end_weight_update(self) -> None:
        """Nothing to finish: the copy is in place."""

    def weight_bytes(self) -> int:
        return sum(t.numel() * 2 for t in self.weights.values())


def recipe(workdir: Path, transport: str, full_every: int) -> RLConfig:
    """The run configuration a transport runs under: its store and folder in the work folder, 64 MiB buckets."""
    return config_from_dict({
        "name": "delta-bench", "data": {"train_path": "prompts.jsonl"}, "storage": {"uri": str(workdir / "store")},
        "weight_sync": {"transport": transport, "bucket_mb": 64, "disk_dir": str(workdir / "disk"),
                        "delta": {"full_every": full_every}},
    }, source="bench/sync/delta.py")


def build(size: str, device: str) -> torch.nn.Module:
    shape = dict(SHAPES[size])
    shape.pop("arch", None)
    cfg = Qwen2Config(**{"tie_word_embeddings": True, "rope_theta": 1e6, "max_position_embeddings": 4096, **shape})
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def sampled(params: dict[str, torch.Tensor]) -> list[str]:
    """Three weights to check bit for bit: the first, middle and last layer's k_proj."""
    names = [n for n in params if n.endswith("k_proj.weight")]
    return [names[0], names[len(names) // 2], names[-1]]


def measure(args: argparse.Namespace) -> dict:
    device = harness.device()
    model = build(args.size, device)
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=device == "cuda")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlflow-delta-bench-"))
    trainer = Trainer(model)
    source = WeightSource(OneWorker(trainer), 64 << 20)
    receivers = {t: Receiver(trainer) for t in args.transports}
    transports = {t: TRANSPORTS[t](recipe(workdir, t, args.full_every), source, OneWorker(receivers[t]))
                  for t in args.transports}
    checked = sampled(trainer.params)
    before = {n: trainer.params[n].detach().to(torch.bfloat16).cpu() for n in checked}
    out: dict = {"size": args.size, "params": n_params, "bf16_bytes": n_params * 2, "lr": args.lr,
                 "steps": args.steps, "tokens_per_step": args.batch * args.seq, "full_every": args.full_every,
                 "buckets": len(source.buckets()), "versions": []}
    try:
        for version in range(1, args.steps + 2):
            row: dict = {"version": version}
            if version > 1:  # a real AdamW step on random tokens
                t0 = time.perf_counter()
                ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
                with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                harness.sync(device)
                row |= {"train_s": time.perf_counter() - t0, "loss": float(loss)}
            now = {n: trainer.params[n].detach().to(torch.bfloat16).cpu() for n in checked}
            row["changed_fraction"] = (sum(int((now[n] != before[n]).sum()) for n in checked)
                                       / sum(now[n].numel() for n in checked))
            before = now
            for name, transport in transports.items():
                trainer.written, trainer.seconds, receivers[name].seconds = 0, 0.0, 0.0
                t0 = time.perf_counter()
                transport.update(version)
                r = {"sync_s": time.perf_counter() - t0, "bytes": trainer.written,
                     "trainer_s": trainer.seconds, "receiver_s": receivers[name].seconds}
                if name == "delta":
                    m = transport.take_metrics()
                    r |= {"ratio": m["sync/delta_ratio"], "snapshot": bool(m["sync/delta_full"]),
                          "full_fetches": m["sync/delta_full_fetches"]}
                r["exact"] = all(torch.equal(receivers[name].weights[n], now[n]) for n in checked)
                row[name] = r
            out["versions"].append(row)
            harness.say(f"{args.size} v{version}: " + ", ".join(
                f"{t} {row[t]['sync_s']:.2f} s {row[t]['bytes'] / 1e6:.1f} MB" for t in transports))
    finally:
        for t in transports.values():
            t.close()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    out["summary"] = summary(out["versions"], list(transports))
    out["peak_gpu_gib"] = harness.peak_gib()
    return out


def summary(versions: list[dict], transports: list[str]) -> dict:
    """Medians over the versions after the first (deltas with the default --full-every), and the first apart."""
    later = versions[1:] or versions
    out: dict = {}
    for t in transports:
        out[t] = {"median_sync_s": harness.median([v[t]["sync_s"] for v in later]),
                  "median_bytes": harness.median([v[t]["bytes"] for v in later]),
                  "first_version_sync_s": versions[0][t]["sync_s"], "first_version_bytes": versions[0][t]["bytes"],
                  "all_exact": all(v[t]["exact"] for v in versions)}
        if t == "delta":
            out[t]["median_ratio"] = harness.median([v[t]["ratio"] for v in later])
    if "delta" in out:
        for t in transports:
            if t != "delta":
                out[f"delta_bytes_vs_{t}"] = out["delta"]["median_bytes"] / max(out[t]["median_bytes"], 1)
                out[f"delta_seconds_vs_{t}"] = out["delta"]["median_sync_s"] / out[t]["median_sync_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1.5B,7B")
    ap.add_argument("--steps", type=int, default=4, help="AdamW steps: versions 2 .. steps+1 are their weights")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--full-every", type=int, default=10, help="weight_sync.delta.full_every")
    ap.add_argument("--transports", default=",".join(TRANSPORT_NAMES))
    ap.add_argument("--workdir", default=None, help="where the store and the disk folder go (default: a new /tmp one)")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per size")
    ap.add_argument("--out", default="delta_sync.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # measure this size here
    harness.add_smoke(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes, args.steps, args.batch, args.seq = "smoke", 2, 2, 16
    args.transports = args.transports.split(",")
    if args.child:
        args.size = args.child
        harness.emit_result(measure(args))
        return
    report: dict = harness.report_header(__spec__.name, argv) | {"sizes": {}}
    child = ["-m", __spec__.name, "--steps", str(args.steps), "--lr", str(args.lr), "--batch", str(args.batch),
             "--seq", str(args.seq), "--full-every", str(args.full_every), "--transports", ",".join(args.transports),
             *(["--workdir", args.workdir] if args.workdir else [])]
    for size in args.sizes.split(","):
        report["sizes"][size] = harness.run_child([*child, "--child", size], args.timeout)
        harness.write_json(args.out, report)
        print(f"{size}: {report['sizes'][size].get('summary', report['sizes'][size])}", flush=True)


if __name__ == "__main__":
    main()
