"""Weight sync of a Qwen2.5-7B-shaped model from the trainer to rollout workers, without Ray (issue 24, item 4):

    PYTHONUNBUFFERED=1 python -m bench.sync.weight_sync --size 7B --out bench/results/gpu_weight_sync_7b.json

on two H100s (or H200s): an estimated 3-4 minutes in all (not yet timed there), the two random 7B checkpoints
included (each built on the GPU in bf16 and saved with safetensors, ~15 GB; the trainer then loads its fp32
copy on the host, as a run does). The checkpoints go to a new folder in /tmp that is removed at the end
(unless --workdir names one).
`--size 0.5B|1.5B` for the smaller shapes; `--smoke` runs a toy model on the CPU with gloo in ~15 s (what the
CPU test does). Every call to a worker ends by `--timeout` seconds after the start (then the workers are
killed and the JSON names the error).

The real sync code runs between real processes: the torch train backend (engines/train/torch_backend.py,
fp32 master weights, no optimizer state: no step is taken) in one process on GPU 0, the embedded rollout
backend (engines/rollout/torch_backend.py, bf16, a small KV pool of --kv-tokens) in another, driven through
the transports of engines/sync/transports.py exactly as a run drives them, only over bench/sync/proc_group.py's
process worker group instead of Ray actors:
- colocated, `cuda_ipc`: the rollout worker shares GPU 0 with the trainer, maps its parameters once through
  CUDA IPC and copies (fp32 -> bf16) from them at every update. Its link is the device-to-device copy
  bandwidth of GPU 0 (bf16 -> bf16, bytes written per second) and, what the update really does, the fp32 ->
  bf16 cast copy; both measured in the same run.
- distributed, `nccl@<MB>`: the rollout worker is on GPU 1; train rank 0 broadcasts buckets of <MB> (of the
  trainer's fp32 layout, so a bucket carries half as many bf16 bytes) over a private NCCL group. Its link is
  a plain NCCL broadcast of --link-mb between the same two processes, measured in the same run.
- distributed, `distributed@<MB>`: the `distributed` transport (engines/sync/distributed.py, SGLang's routes):
  the rollout worker on GPU 1 joins a weight-update group with train rank 0, which broadcasts each bucket of
  <MB> (gathered in bf16). Its link is measured as nccl@'s, over a group of its own between the same processes
  (the transport's group lives in the rollout worker's server, which has no probe).

`--train-ranks N` (N > 1) shards the trainer over N FSDP2 ranks (rank r on GPU r; gloo ranks on the CPU), which
meet at a file:// rendezvous in the work folder. No rank holds whole weights, so a sync gathers them:
- `cuda_ipc`: N rollout workers, worker i on GPU i beside train rank i (verl's colocated layout); every rank
  all-gathers every weight into its GPU's rollout worker (engines/sync/cuda_ipc.py). Its link is an all-gather
  of --link-mb over the N train ranks (output bytes per second per rank; `link_gb_per_s_each_rank`), with the
  bf16 device copy of GPU 0 beside it. It runs on the CPU too (the shared memory is a file there).
- `distributed@<MB>`: N rollout workers on GPUs N..2N-1 (2N GPUs); the ranks gather each bucket, train rank 0
  broadcasts it to all N. Its link: a plain broadcast from train rank 0 to the same N workers, as above.
- `nccl@<MB>` reads one unsharded rank's parameters: refused.

    PYTHONUNBUFFERED=1 python -m bench.sync.weight_sync --size 7B --train-ranks 2 \\
        --out bench/results/gpu_weight_sync_7b_2ranks.json   # on 4 GPUs (on 2, distributed is skipped)
    python -m bench.sync.weight_sync --smoke --train-ranks 2 --out /tmp/wsync_2ranks.json   # CPU: both modes

Per mode: one warm-up update (it also connects), then --repeats timed ones; `sync_s` is the median of the
driver's wall time of `transport.update` (what a run waits for), `in_worker_s` the rollout workers' own time
of it (the slowest worker's; none for distributed, whose workers time each bucket's load alone). GB/s counts
the bf16 bytes one rollout worker receives. Correctness: the rollout workers start from another random
checkpoint, so their weights differ from the trainer's before the first update; after the warm-up and after
the last timed update, the sum of all the weights of every rollout worker must equal the sum of the trainer's
weights cast to bf16, and three small weights (k_proj of the first, middle and last layer) must equal the
trainer's cast to bf16 bit for bit, on every worker (`weights_match_each`; workers reused for a second mode
are reset to their own checkpoint first).
Targets (issue 24): under 1 s per update for 7B, and at least 70% of the measured link. A colocated update
reads 4 bytes (fp32) and writes 2 per weight where the bf16 copy reads and writes 2, so against that copy its
ceiling is about 67%; `fraction_of_cast_copy` compares it with the fp32 -> bf16 copy it really is.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import harness
from bench.ranks import rendezvous
from bench.rollout.gpu import SHAPES as ROLLOUT_SHAPES
from bench.sync.proc_group import ProcessWorkerGroup
from bench.train.scale import QWEN2_1_5B, QWEN2_5_7B, SMOKE, build_model
from rlflow.engines.core.config import RLConfig, config_from_dict
from rlflow.engines.core.protocols import RolloutBackend
from rlflow.engines.models.hf import DTYPES, build_char_tokenizer
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.sync.endpoints import DiskReceiver, GpuLinkProbe, NcclReceiver, NcclSender
from rlflow.engines.sync.transports import make_transport
from rlflow.engines.train.torch_backend import TorchTrainBackend

SIZES = {  # the shapes of bench/rollout/gpu.py (0.5B) and bench/train/scale.py
    "0.5B": {**ROLLOUT_SHAPES["0.5B"], "tie_word_embeddings": True},
    "1.5B": QWEN2_1_5B,
    "7B": QWEN2_5_7B,
    "smoke": SMOKE,
}
TARGET_S, TARGET_FRACTION = 1.0, 0.7  # issue 24 item 4, for the 7B shape


def recipe(device: str, transport: str, bucket_mb: float, kv_tokens: int, threads: int, workers: int = 1) -> RLConfig:
    """The run configuration a mode stands for (validated as a run's would be): the backends' sections, `workers`
    train ranks and as many rollout workers, and the transport with its bucket size. The data section is required
    by every recipe; nothing here reads it. cuda_ipc is validated as the GPU recipe it stands for: the config
    refuses it on the CPU, where the bench still runs its sharded path (over shared-memory files), and the
    transport reads no device from it."""
    if transport == "cuda_ipc":
        device = "cuda"
    return config_from_dict(
        {
            "name": "weight-sync-bench",
            "data": {"train_path": "prompts.jsonl"},
            "train": {"device": device, "precision": "bf16", "threads": threads, "num_workers": workers},
            "algorithm": {"kl_coef": 0.0},  # no reference model
            "rollout": {
                "device": device,
                "precision": "bf16",
                "num_workers": workers,
                "kv_cache": {"tokens": kv_tokens},
            },
            "cluster": {"use_ray": True, "colocate": transport == "cuda_ipc"},  # separate processes, as with Ray
            "weight_sync": {"transport": transport, "bucket_mb": bucket_mb},
        },
        source="bench/sync/weight_sync.py",
    )


def parse_mode(mode: str) -> tuple[str, float]:
    """'cuda_ipc', 'nccl@<bucket MB>' or 'distributed@<bucket MB>' -> (transport, bucket MB)."""
    transport, _, bucket = mode.partition("@")
    if transport not in ("cuda_ipc", "nccl", "distributed"):
        raise ValueError(
            f"--modes: unknown transport {transport!r} in {mode!r} (cuda_ipc, nccl@<bucket MB> or "
            "distributed@<bucket MB>)"
        )
    try:
        return transport, float(bucket or 512)
    except ValueError:
        raise ValueError(f"--modes: the bucket size in {mode!r} is not a number of MB") from None


def build_checkpoints(size: str, work: Path) -> tuple[Path, Path]:
    """Two random checkpoints of the shape (bf16 safetensors, built on the GPU when there is one): the
    trainer's, and another the rollout workers start from, so that an update has to change every weight."""
    dirs = (work / "trainer", work / "rollout")
    for seed, d in enumerate(dirs):
        build_model(SIZES[size], d, seed=seed)
        build_char_tokenizer().save_pretrained(d)
    return dirs


def placement(transport: str) -> str:
    """Where a mode's rollout workers are: beside the train ranks (cuda_ipc) or on GPUs of their own."""
    return "colocated" if transport == "cuda_ipc" else "separate"


def rollout_gpus(transport: str, device: str, ranks: int) -> list[int | None]:
    """Rollout worker i's GPU: train rank i's (cuda_ipc), or one of the next `ranks` GPUs; None on the CPU."""
    first = 0 if placement(transport) == "colocated" else ranks
    return [first + i if device == "cuda" else None for i in range(ranks)]


def skip_reason(transport: str, device: str, gpus: int, ranks: int = 1) -> str | None:
    if transport == "cuda_ipc" and device != "cuda" and ranks == 1:  # sharded, it maps files on the CPU
        return "cuda_ipc maps GPU memory between processes: needs CUDA (not run on the CPU)"
    if transport == "nccl" and device == "cuda" and gpus < 2:
        return "nccl needs a second GPU for the rollout worker (NCCL refuses two ranks on one GPU)"
    if transport == "distributed" and device == "cuda" and gpus < 2 * ranks:
        return (
            f"distributed needs {2 * ranks} GPUs: {ranks} train rank(s), then {ranks} rollout worker(s) on GPUs of "
            f"their own (NCCL refuses two ranks of one group on one GPU); this machine shows {gpus}"
        )
    return None


class Bench:
    """The trainer and the rollout groups (started together, so they load at the same time) and the figures."""

    def __init__(
        self,
        a: argparse.Namespace,
        device: str,
        trainer_ckpt: Path,
        rollout_ckpt: Path,
        modes: list[str],
        work: Path,
        deadline: float,
    ):
        self.a, self.device, self.rollout_ckpt = a, device, rollout_ckpt
        n = a.train_ranks
        base = recipe(device, "ray", 512, a.kv_tokens, a.threads, n)
        url = rendezvous(str(work / "trainer-group")) if n > 1 else None  # one rank needs no rendezvous
        self.train = ProcessWorkerGroup(
            TorchTrainBackend,
            [
                dict(
                    model_path=str(trainer_ckpt),
                    train=base.train,
                    algorithm=base.algorithm,
                    rank=r,
                    world_size=n,
                    dist_url=url,
                    seed=base.seed,
                    collective_timeout_s=a.timeout,
                )
                for r in range(n)
            ],
            [r if device == "cuda" else None for r in range(n)],
            deadline,
            name="trainer",
        )
        kw = dict(
            model_path=str(rollout_ckpt),
            device=base.rollout_device,
            dtype=DTYPES[base.rollout.precision],
            threads=a.threads,
            batch_size=base.rollout.batch_size,
            kv_cache=base.rollout.kv_cache,
        )
        self.rollouts: dict[str, ProcessWorkerGroup] = {}  # by placement: nccl and distributed share theirs
        for transport in dict.fromkeys(parse_mode(m)[0] for m in modes):
            where = placement(transport)
            if where not in self.rollouts:
                self.rollouts[where] = ProcessWorkerGroup(
                    TorchRolloutBackend,
                    [kw | {"rank": i} for i in range(n)],
                    rollout_gpus(transport, device, n),
                    deadline,
                    name=f"rollout-{where}",
                )
        self.synced: set[str] = set()  # rollout groups that hold the trainer's weights already

    def ready(self) -> float:
        t0 = time.perf_counter()
        for g in [self.train, *self.rollouts.values()]:
            g.ready()
        return time.perf_counter() - t0

    def shutdown(self, grace_s: float) -> None:
        for g in [*self.rollouts.values(), self.train]:
            g.shutdown(grace_s)

    def trainer_digest(self) -> float:
        """The sum of the trainer's weights cast to bf16 (collective over the train ranks; rank 0's answer)."""
        return self.train.call(GpuLinkProbe.weights_digest, "bf16")[0]

    def same_tensors(self, rollout: ProcessWorkerGroup, names: list[str]) -> list[bool]:
        """Per rollout worker: whether these weights equal the trainer's cast to bf16, bit for bit."""
        theirs = self.train.call(TorchTrainBackend.named_tensors, names)[0]  # collective; rank 0 holds them
        return [
            all(torch.equal(mine[n], t.to(mine[n].dtype)) for n, t in theirs)
            for mine in map(dict, rollout.call(TorchRolloutBackend.named_tensors, names))
        ]

    def matches(self, rollout: ProcessWorkerGroup, trainer_digest: float, exact: list[str]) -> list[bool]:
        """Per rollout worker: its weights' digest is the trainer's and the `exact` weights are equal bit for bit."""
        digests = rollout.call(GpuLinkProbe.weights_digest)
        same = self.same_tensors(rollout, exact)
        return [abs(d - trainer_digest) < 1e-3 and e for d, e in zip(digests, same, strict=True)]

    def run(self, mode: str, trainer_digest: float, exact: list[str]) -> dict:
        transport_name, bucket_mb = parse_mode(mode)
        where = placement(transport_name)
        rollout = self.rollouts[where]
        if where in self.synced:  # start again from the other weights: the first update must change all
            rollout.call(DiskReceiver.update_weights_from_disk, str(self.rollout_ckpt), 0)
        before = rollout.call(GpuLinkProbe.weights_digest)
        if any(abs(b - trainer_digest) < 1e-3 for b in before) or any(self.same_tensors(rollout, exact)):
            raise RuntimeError(
                f"{mode}: a rollout worker holds the trainer's weights before any update; the check would prove nothing"
            )
        cfg = recipe(self.device, transport_name, bucket_mb, self.a.kv_tokens, self.a.threads, self.a.train_ranks)
        transport = make_transport(cfg, self.train, rollout)
        timed_in_worker = transport_name != "distributed"  # its workers time each bucket's load alone
        try:
            nbytes = transport.update(1)  # connects, then the first update
            self.synced.add(where)
            warm_match = self.matches(rollout, trainer_digest, exact)
            times, in_worker = [], []
            for version in range(2, self.a.repeats + 2):
                t0 = time.perf_counter()
                transport.update(version)
                times.append(time.perf_counter() - t0)
                if timed_in_worker:
                    in_worker.append(max(rollout.call(RolloutBackend.last_update_seconds)))
            digests = rollout.call(GpuLinkProbe.weights_digest)
            exact_match = self.same_tensors(rollout, exact)
            link = self.link(transport_name, rollout)
        finally:
            transport.close()
        t, w = statistics.median(times), statistics.median(in_worker) if in_worker else None
        gbps = nbytes / t / 1e9
        each = [
            warm and abs(d - trainer_digest) < 1e-3 and e
            for warm, d, e in zip(warm_match, digests, exact_match, strict=True)
        ]
        bucketed = transport_name != "cuda_ipc"
        out = {
            "mode": mode,
            "transport": transport_name,
            "train_ranks": self.a.train_ranks,
            "rollout_workers": len(rollout),
            "bucket_mb": bucket_mb if bucketed else None,
            "buckets": len(transport.source.buckets()) if bucketed else None,
            "bytes": nbytes,
            "sync_s": t,
            "sync_s_all": times,
            "gb_per_s": gbps,
            "in_worker_s": w,
            "in_worker_gb_per_s": nbytes / w / 1e9 if w else None,
            "weights_match": all(each),
            "weights_match_each": each,  # per rollout worker, after the warm-up and after the last update
            "exact_tensors_match": all(exact_match),
            "digest_before": before[0],
            "digest_after": digests[0],
            "digests_after": digests,  # every rollout worker's
            "digest_trainer_bf16": trainer_digest,
        } | link
        out["fraction_of_link"] = gbps / out["link_gb_per_s"] if out["link_gb_per_s"] else None
        out["meets_targets"] = bool(t < TARGET_S and (out["fraction_of_link"] or 0) >= TARGET_FRACTION)
        if out.get("cast_copy_gb_per_s"):
            out["fraction_of_cast_copy"] = gbps / out["cast_copy_gb_per_s"]
            out["meets_targets_vs_cast_copy"] = bool(t < TARGET_S and out["fraction_of_cast_copy"] >= TARGET_FRACTION)
        return out

    def link(self, transport_name: str, rollout: ProcessWorkerGroup) -> dict:
        """The link this mode's bytes cross, measured now between the same processes."""
        nbytes, n, cuda = int(self.a.link_mb * 2**20), self.a.train_ranks, self.device == "cuda"
        size = f"{self.a.link_mb:g} MiB"
        if transport_name == "cuda_ipc" and n == 1:
            return {
                "link": "device-to-device copy, bf16 -> bf16 (GPU 0)",
                "link_gb_per_s": self.train.call_rank0(GpuLinkProbe.link_bandwidth, "copy", nbytes),
                "cast_copy_gb_per_s": self.train.call_rank0(GpuLinkProbe.link_bandwidth, "cast_copy", nbytes),
            }
        if transport_name == "cuda_ipc":  # every rank gathers every weight: an all-gather over the train ranks
            each = self.train.call(GpuLinkProbe.link_bandwidth, "all_gather", nbytes)
            return {
                "link": f"{'NCCL' if cuda else 'gloo (CPU)'} all-gather over {n} ranks, output bytes per rank, {size}",
                "link_gb_per_s": each[0],
                "link_gb_per_s_each_rank": each,
                "device_copy_gb_per_s": (  # context: bf16 -> bf16 on GPU 0 (no copy probe on the CPU)
                    self.train.call_rank0(GpuLinkProbe.link_bandwidth, "copy", nbytes) if cuda else None
                ),
            }
        if transport_name == "distributed":
            self.connect_broadcast(rollout)
        probe = self.train.submit_rank0(GpuLinkProbe.link_bandwidth, "nccl", nbytes)  # both ends of the broadcast
        rollout.call(GpuLinkProbe.link_bandwidth, "nccl", nbytes)
        gpus = ", ".join(str(g) for g in rollout_gpus(transport_name, self.device, n))
        name = f"NCCL broadcast GPU 0 -> GPU{'s' if n > 1 else ''} {gpus}" if cuda else "gloo broadcast (CPU)"
        own = ", a group of its own between the same processes" if transport_name == "distributed" else ""
        return {"link": f"{name}, {size}{own}", "link_gb_per_s": self.train.wait([probe])[0]}

    def connect_broadcast(self, rollout: ProcessWorkerGroup) -> None:
        """Train rank 0 and every rollout worker in a private NCCL group (gloo on the CPU), as the nccl transport
        connects them (engines/sync/nccl.py), for the plain broadcast probe: the distributed transport's own
        group lives in each rollout worker's server, which has no probe."""
        host, port = self.train.call_rank0(NcclSender.rendezvous_address)
        world = 1 + len(rollout)
        sender = self.train.submit_rank0(NcclSender.nccl_connect, host, port, world, "bf16")
        rollout.call_each(NcclReceiver.nccl_connect, [(host, port, 1 + i, world) for i in range(len(rollout))])
        self.train.wait([sender])


def markdown_row(report: dict, r: dict) -> str:
    frac = f"{r['fraction_of_link']:.0%}" if r.get("fraction_of_link") is not None else "-"
    mode = r["mode"] if r["train_ranks"] == 1 else f"{r['mode']}, {r['train_ranks']} train ranks"
    return (
        f"| {report['date']} | {report['device']} x{report['gpus']} | {report['size']} | {mode} | "
        f"{r['sync_s']:.3f} | {r['gb_per_s']:.1f} | {r['link_gb_per_s']:.1f} ({r['link']}) | {frac} | "
        f"{'yes' if r['weights_match'] else 'NO'} | `{report['command']}` |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="7B")
    harness.add_smoke(ap)
    ap.add_argument(
        "--modes",
        default="cuda_ipc,nccl@512,nccl@1024",
        help="comma-separated: cuda_ipc (colocated on GPU 0), nccl@<bucket MB> (GPU 0 -> GPU 1), "
        "distributed@<bucket MB> (as nccl@, over SGLang's routes); with --train-ranks N > 1 the default is "
        "cuda_ipc,distributed@512,distributed@1024",
    )
    ap.add_argument(
        "--train-ranks",
        type=int,
        default=1,
        help="FSDP2 train ranks, rank r on GPU r (N > 1: cuda_ipc with rollout worker i on GPU i, distributed@ with "
        "rollout workers on GPUs N..2N-1; nccl@ is refused)",
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed updates per mode, after one warm-up")
    ap.add_argument("--link-mb", type=float, default=1024, help="bytes of the link measurements, MiB")
    ap.add_argument("--kv-tokens", type=int, default=4096, help="the rollout worker's KV pool, tokens")
    ap.add_argument("--threads", type=int, default=8, help="torch threads per worker")
    ap.add_argument("--timeout", type=float, default=540, help="seconds for the whole run")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a new folder in /tmp)")
    ap.add_argument("--out", default="gpu_weight_sync.json")
    a = ap.parse_args(argv)
    start = time.monotonic()
    sharded = a.train_ranks > 1
    if a.train_ranks < 1:
        ap.error("--train-ranks: at least 1")
    if a.modes == ap.get_default("modes"):
        if a.smoke:  # buckets small enough that the toy model takes several
            a.modes = "cuda_ipc,distributed@0.1" if sharded else "cuda_ipc,nccl@0.1,nccl@0.5"
        elif sharded:
            a.modes = "cuda_ipc,distributed@512,distributed@1024"
    if a.smoke:
        a.size, a.link_mb, a.kv_tokens, a.threads = "smoke", 4, 256, 1
    a.modes = [m for m in a.modes.split(",") if m]
    for m in a.modes:
        try:
            transport, _ = parse_mode(m)
        except ValueError as e:
            ap.error(str(e))
        if transport == "nccl" and sharded:
            ap.error(
                f"--modes {m}: the nccl transport broadcasts one unsharded train rank's parameters; with "
                f"--train-ranks {a.train_ranks} (FSDP2 shards them) use distributed@<bucket MB>"
            )
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    a.gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and a.gpus < a.train_ranks:
        ap.error(f"--train-ranks {a.train_ranks}: one GPU per train rank, this machine shows {a.gpus}")
    report = harness.report_header(__spec__.name, argv, name_device=False) | {
        "size": a.size,
        "device": harness.device_name(0) if device == "cuda" else "cpu",  # --smoke runs on the CPU on any machine
        "gpus": a.gpus,
        "shape": SIZES[a.size],
        "train_ranks": a.train_ranks,
        "repeats": a.repeats,
        "modes": [],
        "skipped": [],
        "error": None,
    }
    def write() -> None:
        harness.write_json(a.out, report)

    work = Path(a.workdir or tempfile.mkdtemp(prefix="rlflow-wsync-"))
    try:
        return measure(a, device, report, work, start, write)
    finally:
        if a.workdir is None:  # 30 GB at 7B: a second run would fill a small disk
            shutil.rmtree(work, ignore_errors=True)


def measure(
    a: argparse.Namespace, device: str, report: dict, work: Path, start: float, write: Callable[[], None]
) -> int:
    """Build the checkpoints, start the workers, run every mode; the report is rewritten after each."""
    t0 = time.perf_counter()
    trainer_ckpt, rollout_ckpt = build_checkpoints(a.size, work)
    if device == "cuda":
        torch.cuda.empty_cache()  # the workers get the GPUs
    report["build_s"] = time.perf_counter() - t0
    harness.say(f"built two random {a.size} checkpoints in {report['build_s']:.0f} s under {work}")
    runnable = []
    for m in a.modes:
        reason = skip_reason(parse_mode(m)[0], device, a.gpus, a.train_ranks)
        if reason:
            report["skipped"].append({"mode": m, "reason": reason})
            harness.say(f"skip {m}: {reason}")
        else:
            runnable.append(m)
    bench = Bench(a, device, trainer_ckpt, rollout_ckpt, runnable, work, start + a.timeout)
    try:
        report["load_s"] = bench.ready()
        harness.say(f"trainer ({a.train_ranks} rank(s)) and rollout workers loaded in {report['load_s']:.0f} s")
        t0 = time.perf_counter()
        trainer_digest = bench.trainer_digest()
        report["trainer_digest_s"] = time.perf_counter() - t0
        layout = bench.train.call_rank0(TorchTrainBackend.weight_layout)
        report["params"] = sum(n for _, n in layout) // 4  # fp32 master weights
        k_proj = [n for n, _ in layout if n.endswith("k_proj.weight")]  # small, random: first, middle, last layer
        report["exact_tensors"] = exact = list(dict.fromkeys([k_proj[0], k_proj[len(k_proj) // 2], k_proj[-1]]))
        for m in runnable:
            r = bench.run(m, trainer_digest, exact)
            report["modes"].append(r)
            write()
            harness.say(
                f"{m}: {r['sync_s']:.3f} s/update, {r['gb_per_s']:.1f} GB/s, link {r['link_gb_per_s']:.1f} GB/s, "
                f"weights match: {r['weights_match']}"
            )
    except Exception as e:  # noqa: BLE001 - any failure ends the run with its message in the JSON
        report["error"] = f"{type(e).__name__}: {e}"
        harness.say(f"error: {e}")
    finally:
        bench.shutdown(30 if report["error"] is None else 5)  # after an error a worker may hang in a collective
        report["wall_s"] = time.monotonic() - start
        write()
    print("| date | GPU | size | mode | s/update | GB/s | link GB/s | of link | weights match | command |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["modes"]:
        print(markdown_row(report, r))
    ok = report["error"] is None and all(r["weights_match"] for r in report["modes"])
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
