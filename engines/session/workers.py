"""The run's workers: which backend classes a recipe names, their constructor arguments, and the worker groups
that hold them (Ray actors in placement groups, or objects in this process); plus the data and model files the
workers start from. The one place placement is decided (colocated or disaggregated, GPUs per worker)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ray.util.placement_group import remove_placement_group

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.cluster.groups import LocalWorkerGroup, RayWorkerGroup, init_ray, make_placement_group
from rlflow.engines.core.config import RLConfig
from rlflow.engines.core.protocols import CriticBackend, RolloutBackend, TrainBackend, WorkerGroup
from rlflow.engines.data.builtin_tasks import write_task_files
from rlflow.engines.models.hf import DTYPES, build_tiny_model
from rlflow.engines.rollout.sglang_backend import SGLangRolloutBackend, gpus_per_server
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.sync.transports import TRANSPORTS
from rlflow.engines.train.torch_backend import TorchTrainBackend

# what the session calls on each group; the recipe's weight transport adds what it needs of either side
TRAIN, ROLLOUT, CRITIC = (TrainBackend,), (RolloutBackend,), (CriticBackend,)


def group_protocols(cfg: RLConfig) -> tuple[tuple[type, ...], tuple[type, ...]]:
    """The protocols the train and the rollout workers are used through in this run."""
    transport = TRANSPORTS[cfg.weight_sync.transport]
    return TRAIN + transport.sender, ROLLOUT + transport.receiver


def prepare_data(cfg: RLConfig) -> None:
    """Write the built-in task files the recipe asks for, if they are not there yet."""
    gen = cfg.data.generate
    missing = not Path(cfg.data.train_path).exists() or (cfg.data.eval_path and not Path(cfg.data.eval_path).exists())
    if gen is not None and missing:
        write_task_files(gen, cfg.data.train_path, cfg.data.eval_path)
    sft = cfg.sft
    if sft.generate is not None and sft.train_path and not Path(sft.train_path).exists():
        write_task_files(sft.generate, None, None, sft_path=sft.train_path)


def prepare_model(cfg: RLConfig, workdir: str | Path) -> str:
    """The HF directory the engines load: the recipe's model, or a tiny one built from the recipe."""
    if cfg.model.path:
        if not (Path(cfg.model.path) / "config.json").is_file():
            raise FileNotFoundError(f"model.path: no Hugging Face model (config.json) in {cfg.model.path}")
        return cfg.model.path
    out = Path(workdir) / "base_model"
    if not (out / "model.safetensors").is_file():
        build_tiny_model(cfg.model, out, seed=cfg.seed)
    return str(out)

@dataclass
class Workers:
    """The run's worker groups: the policy's train workers, the rollout workers and (PPO with GAE) the critic's.
    A debug mode starts no workers of one kind: that group is empty."""

    train: WorkerGroup[TrainBackend]
    rollout: WorkerGroup[RolloutBackend]
    critic: WorkerGroup[CriticBackend] | None = None

    def shutdown(self, colocated: bool) -> None:
        """Stop every worker, then the placement group colocated train and rollout workers shared (which
        neither group owns)."""
        for group in (self.train, self.rollout, self.critic):
            if group is not None:
                group.shutdown()
        shared = getattr(self.train, "placement_group", None)
        if colocated and shared is not None:
            remove_placement_group(shared)


def start_workers(cfg: RLConfig, model_path: str, use_ray: bool) -> Workers:
    """Ray actors in placement groups, or objects in this process (the bare loop)."""
    make_train, make_rollout = train_kwargs(cfg, model_path), rollout_kwargs(cfg, model_path)
    make_critic = critic_kwargs(cfg, model_path) if cfg.use_critic and cfg.debug.trains else None
    train_cls, rollout_cls = train_backend_class(cfg), rollout_backend_class(cfg)
    n_train = cfg.train.num_workers if cfg.debug.trains else 0  # debug modes start one kind of worker
    n_rollout = cfg.rollout.num_workers if cfg.debug.generates else 0
    critic = None
    train_protocols, rollout_protocols = group_protocols(cfg)
    if not use_ray:
        if n_train > 1 or (make_critic and cfg.critic.num_workers > 1):
            raise ValueError("train.num_workers / critic.num_workers > 1 need cluster.use_ray: true")
        train = LocalWorkerGroup([train_cls(**make_train(r)) for r in range(n_train)], protocols=train_protocols)
        rollout = LocalWorkerGroup([rollout_cls(**make_rollout(r)) for r in range(n_rollout)],
                                   factory=lambda r: rollout_cls(**make_rollout(r)),
                                   protocols=rollout_protocols)
        if make_critic:
            critic = LocalWorkerGroup([TorchTrainBackend(**make_critic(0))], protocols=CRITIC)
        return Workers(train, rollout, critic)
    init_ray(cfg.cluster)
    train, rollout = ray_groups(cfg, train_cls, make_train, make_rollout, n_train, n_rollout)
    if make_critic:  # its own actors and placement group (on GPUs: GPUs of its own, also when colocated)
        gpus = 1.0 if cfg.train.device == "cuda" else 0.0
        critic = RayWorkerGroup(TorchTrainBackend, cfg.critic.num_workers, make_critic, cfg.cluster.cpus_per_worker,
                                f"{cfg.name}-critic", gpus, protocols=CRITIC)
    return Workers(train, rollout, critic)


def train_backend_class(cfg: RLConfig) -> type:
    """The train backend the recipe names (megatron-core is imported only when asked for)."""
    if cfg.train.backend == "megatron":
        from rlflow.engines.train.megatron.backend import MegatronTrainBackend  # optional: megatron-core

        return MegatronTrainBackend
    return TorchTrainBackend


def rollout_backend_class(cfg: RLConfig) -> type:
    """The rollout backend the recipe names: the embedded engine, or an SGLang server per worker."""
    if cfg.rollout.backend != "sglang":
        return TorchRolloutBackend
    if cfg.weight_sync.transport in ("cuda_ipc", "nccl"):
        raise ValueError(f"weight_sync.transport: {cfg.weight_sync.transport} feeds the embedded engine only; "
                         "rollout.backend sglang takes 'disk' (or 'ray' / 'store', through a folder of the worker's)")
    return SGLangRolloutBackend


def train_kwargs(cfg: RLConfig, model_path: str):
    dist_url = f"tcp://127.0.0.1:{free_port()}" if cfg.train.num_workers > 1 else None
    norm_len = cfg.rollout.max_new_tokens
    extra = {"megatron": cfg.megatron} if cfg.train.backend == "megatron" else {}

    def make(rank: int) -> dict:
        return dict(model_path=model_path, train=cfg.train, algorithm=cfg.algorithm,
                    temperature=cfg.rollout.temperature or 1.0, norm_len=norm_len, rank=rank,
                    world_size=cfg.train.num_workers, dist_url=dist_url, seed=cfg.seed, **extra)

    return make


def critic_kwargs(cfg: RLConfig, model_path: str):
    """The critic's workers: the torch backend as role "critic", from critic.model_path or the policy's model."""
    c = cfg.critic
    if c.model_path and not (Path(c.model_path) / "config.json").is_file():
        raise FileNotFoundError(f"critic.model_path: no Hugging Face model (config.json) in {c.model_path}")
    dist_url = f"tcp://127.0.0.1:{free_port()}" if c.num_workers > 1 else None  # its own process group

    def make(rank: int) -> dict:
        return dict(model_path=c.model_path or model_path, train=c.train_config(cfg.train), algorithm=cfg.algorithm,
                    rank=rank, world_size=c.num_workers, dist_url=dist_url, seed=cfg.seed, role="critic",
                    value_clip=c.value_clip)

    return make


def rollout_kwargs(cfg: RLConfig, model_path: str):
    def make(rank: int) -> dict:
        if cfg.rollout.backend == "sglang":
            return dict(model_path=model_path, sglang=cfg.rollout.sglang, rank=rank, threads=cfg.train.threads)
        return dict(model_path=model_path, device=cfg.rollout_device, dtype=DTYPES[cfg.rollout.precision],
                    threads=cfg.train.threads, batch_size=cfg.rollout.batch_size,
                    trace=cfg.debug.trace_every > 0, rank=rank)

    return make


def ray_groups(cfg: RLConfig, train_cls: type, train_kwargs, rollout_kwargs, n_train: int,
                n_rollout: int) -> tuple[RayWorkerGroup | LocalWorkerGroup, RayWorkerGroup | LocalWorkerGroup]:
    """Train and rollout actors. On GPUs: one GPU per worker (disaggregated), or with cluster.colocate
    rollout worker i takes half of train worker i's GPU bundle, so the pair shares one device. A debug
    mode asks for no workers of one kind: that group is empty."""
    cpus, name = cfg.cluster.cpus_per_worker, cfg.name
    train_gpus = 1.0 if cfg.train.device == "cuda" else 0.0
    rollout_gpus = 1.0 if cfg.rollout_device == "cuda" else 0.0
    if cfg.rollout.backend == "sglang":  # one server's GPUs: its tensor x pipeline parallel size
        rollout_gpus *= gpus_per_server(cfg.rollout.sglang.args)
    shared = None
    if cfg.cluster.colocate:
        shared = make_placement_group([{"CPU": 2 * cpus, "GPU": 1}] * cfg.train.num_workers, f"{name}-colocated-pg")
        train_gpus = rollout_gpus = 0.5
    train_protocols, rollout_protocols = group_protocols(cfg)
    train = (RayWorkerGroup(train_cls, n_train, train_kwargs, cpus, f"{name}-train", train_gpus, shared,
                            protocols=train_protocols) if n_train else LocalWorkerGroup([]))
    rollout = (RayWorkerGroup(rollout_backend_class(cfg), n_rollout, rollout_kwargs, cpus, f"{name}-rollout",
                              rollout_gpus, shared, protocols=rollout_protocols) if n_rollout else LocalWorkerGroup([]))
    return train, rollout
