"""The run's workers: which backend classes a recipe names, their constructor arguments, and the worker groups
that hold them (Ray actors in placement groups, or objects in this process); plus the data and model files the
workers start from. The one place placement is decided (colocated or disaggregated, GPUs per worker)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig

from rlflow.engines.cluster.addresses import LOOPBACK
from rlflow.engines.cluster.groups import LocalWorkerGroup, RayWorkerGroup, init_ray, wait_ready
from rlflow.engines.cluster.placement import Placement, PlacementError, RoleDemand, driver_node_id, place
from rlflow.engines.core.config import ModelRewardSource, RLConfig
from rlflow.engines.core.protocols import (
    CriticBackend,
    RewardModelBackend,
    RolloutBackend,
    TeacherBackend,
    TrainBackend,
    WorkerGroup,
)
from rlflow.engines.core.sglang_args import gpus_per_server
from rlflow.engines.data.builtin_tasks import write_task_files
from rlflow.engines.models.hf import DTYPES, ROLLOUT_DTYPES, build_tiny_model, load_tokenizer
from rlflow.engines.models.vision_language import is_vision_language
from rlflow.engines.reward.model_worker import SequenceClassifierReward
from rlflow.engines.rollout.sglang_backend import SGLangRolloutBackend
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.store.run_store import replay_storage, worker_storage, workers_write_checkpoints
from rlflow.engines.sync.disk import weight_dirs
from rlflow.engines.sync.transports import TRANSPORTS
from rlflow.engines.train.torch_backend import TorchTrainBackend

# what the session calls on each group; the recipe's weight transport adds what it needs of either side
TEACHER = (TrainBackend, TeacherBackend)  # the distillation teacher: logprobs of the sampled tokens, or its top k
TRAIN, ROLLOUT, CRITIC, REWARD = (TrainBackend,), (RolloutBackend,), (CriticBackend,), (RewardModelBackend,)


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
    A debug mode starts no workers of one kind: that group is empty. `placements` are the Ray placement groups
    they run in (the run owns them); `spans_nodes`: some worker runs on another node than the driver's."""

    train: WorkerGroup[TrainBackend]
    rollout: WorkerGroup[RolloutBackend]
    critic: WorkerGroup[CriticBackend] | None = None
    reward: dict[str, WorkerGroup[RewardModelBackend]] = field(default_factory=dict)  # by reward source name
    teacher: WorkerGroup[TrainBackend] | None = None  # on-policy distillation's frozen teacher (forward_logprobs)
    placements: list[Placement] = field(default_factory=list)
    spans_nodes: bool = False
    control_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # the rollout servers' (per run)

    def rollout_host(self, rank: int) -> str:
        """The address rollout worker `rank`'s server binds: its node's when the run spans nodes (asked where
        the worker's bundle is now: a restarted worker may be on another node), else loopback."""
        return self.rollout.node_ip(rank) if self.spans_nodes else LOOPBACK

    def shutdown(self) -> None:
        """Stop every worker, then release the placement groups they ran in."""
        for group in (self.train, self.rollout, self.critic, self.teacher, *self.reward.values()):
            if group is not None:
                group.shutdown()
        for placement in self.placements:
            placement.remove()
        self.placements.clear()


def start_workers(cfg: RLConfig, model_path: str, use_ray: bool) -> Workers:
    """Ray actors in placement groups, or objects in this process (the bare loop)."""
    make_train, make_rollout = train_kwargs(cfg, model_path), rollout_kwargs(cfg, model_path)
    make_critic = critic_kwargs(cfg, model_path) if cfg.use_critic and cfg.debug.trains else None
    make_teacher = teacher_kwargs(cfg, model_path) if cfg.distill.enabled and cfg.debug.trains else None
    train_cls, rollout_cls = train_backend_class(cfg), rollout_backend_class(cfg)
    n_train = cfg.train.num_workers if cfg.debug.trains else 0  # debug modes start one kind of worker
    n_rollout = cfg.rollout.num_workers if cfg.debug.generates else 0
    train_protocols, rollout_protocols = group_protocols(cfg)
    if not use_ray:
        local = Workers(LocalWorkerGroup([]), LocalWorkerGroup([]))
        if cfg.rollout.backend == "sglang":
            make_rollout = _with_server(make_rollout, lambda rank: LOOPBACK, local.control_token)
        teachers = cfg.distill.num_workers if make_teacher else 0
        if n_train > 1 or (make_critic and cfg.critic.num_workers > 1) or teachers > 1:
            raise ValueError("train.num_workers / critic.num_workers / distill.num_workers > 1 need cluster.use_ray: "
                             "true")
        local.train = LocalWorkerGroup([train_cls(**make_train(r)) for r in range(n_train)],
                                       protocols=train_protocols)
        local.rollout = LocalWorkerGroup([rollout_cls(**make_rollout(r)) for r in range(n_rollout)],
                                         factory=lambda r: rollout_cls(**make_rollout(r)), protocols=rollout_protocols)
        if make_critic:
            local.critic = LocalWorkerGroup([TorchTrainBackend(**make_critic(0))], protocols=CRITIC)
        if make_teacher:
            local.teacher = LocalWorkerGroup([TorchTrainBackend(**make_teacher(0))], protocols=TEACHER)
        for i, src in reward_models(cfg):
            make = reward_model_kwargs(cfg, src, i)
            local.reward[str(src.name)] = LocalWorkerGroup([SequenceClassifierReward(**make(r))
                                                            for r in range(src.num_workers)], protocols=REWARD)
        return local
    init_ray(cfg.cluster)
    return ray_workers(cfg, train_cls, make_train, make_rollout, make_critic, n_train, n_rollout, make_teacher)


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
    """Constructor arguments of train worker `rank` (its group adds the rendezvous address, dist_url)."""
    norm_len = cfg.rollout.max_new_tokens
    extra = {"megatron": cfg.megatron} if cfg.train.backend == "megatron" else {}

    if cfg.distill.enabled:
        extra["distill"] = cfg.distill
    if cfg.rollout.true_on_policy:  # the policy's forward runs the engine's batch-invariant ops
        extra["true_on_policy"] = True
    if is_vision_language(model_path):  # the train workers read a batch's images from the run store by digest:
        # this run's, or with debug.replay_run the replayed run's, whose batches name its own pictures
        replayed = cfg.debug.replay_run is not None
        extra |= {"storage": worker_storage(replay_storage(cfg) if replayed else cfg.storage),
                  "run": cfg.debug.replay_run if replayed else cfg.name}

    def make(rank: int) -> dict:
        return dict(model_path=model_path, train=cfg.train, algorithm=cfg.algorithm,
                    temperature=cfg.rollout.temperature or 1.0, norm_len=norm_len, rank=rank,
                    world_size=cfg.train.num_workers, seed=cfg.seed,
                    collective_timeout_s=cfg.cluster.collective_timeout_s, **extra)

    return make


def critic_kwargs(cfg: RLConfig, model_path: str):
    """The critic's workers: the torch backend as role "critic", from critic.model_path or the policy's model."""
    c = cfg.critic
    if c.model_path and not (Path(c.model_path) / "config.json").is_file():
        raise FileNotFoundError(f"critic.model_path: no Hugging Face model (config.json) in {c.model_path}")

    def make(rank: int) -> dict:  # its own process group (dist_url from its worker group)
        return dict(model_path=c.model_path or model_path, train=c.train_config(cfg.train), algorithm=cfg.algorithm,
                    rank=rank, world_size=c.num_workers, seed=cfg.seed, role="critic", value_clip=c.value_clip,
                    collective_timeout_s=cfg.cluster.collective_timeout_s)

    return make


def teacher_kwargs(cfg: RLConfig, model_path: str):
    """On-policy distillation's teacher: the torch backend as role "teacher" (frozen, forward_logprobs only) on
    distill.teacher_path, in distill.precision, scoring at the rollout's temperature as the student's logprobs
    are taken; its workers are data-parallel over their own process group, whatever train.backend is."""
    d = cfg.distill
    if not (Path(d.teacher_path) / "config.json").is_file():
        raise FileNotFoundError(f"distill.teacher_path: no Hugging Face model (config.json) in {d.teacher_path}")
    check_teacher_vocabulary(model_path, d.teacher_path)
    train = cfg.train.model_copy(update={"num_workers": d.num_workers, "precision": d.precision or cfg.train.precision,
                                         "activation_checkpointing": "off"})

    def make(rank: int) -> dict:
        return dict(model_path=d.teacher_path, train=train, algorithm=cfg.algorithm,
                    temperature=cfg.rollout.temperature or 1.0, rank=rank, world_size=d.num_workers, seed=cfg.seed,
                    role="teacher", collective_timeout_s=cfg.cluster.collective_timeout_s)

    return make


def check_teacher_vocabulary(model_path: str, teacher_path: str) -> None:
    """The teacher scores the student's token ids: both must mean the same tokens by the same ids (the same
    tokenizer vocabulary), and the teacher's embedding must have a row for every id. A mismatch would give
    logprobs of other tokens, silently: refuse it before any worker starts."""
    student, teacher = load_tokenizer(model_path).get_vocab(), load_tokenizer(teacher_path).get_vocab()
    if student != teacher:
        differ = sorted(set(student.items()) ^ set(teacher.items()), key=lambda kv: kv[1])[:5]
        raise ValueError(f"distill.teacher_path: the teacher's tokenizer ({teacher_path}, {len(teacher)} tokens) "
                         f"is not the student's ({model_path}, {len(student)} tokens); on-policy distillation "
                         f"needs the same vocabulary (first differences, token: id: {differ})")
    rows = AutoConfig.from_pretrained(teacher_path).vocab_size
    if rows < len(student):
        raise ValueError(f"distill.teacher_path: the teacher's embedding has {rows} rows (config.json vocab_size) "
                         f"for a vocabulary of {len(student)} tokens")


def rollout_kwargs(cfg: RLConfig, model_path: str):
    dirs = weight_dirs(cfg)  # what the servers' /update_weights_from_disk may read

    def make(rank: int) -> dict:
        if cfg.rollout.backend == "sglang":
            return dict(model_path=model_path, sglang=cfg.rollout.sglang, rank=rank, threads=cfg.train.threads,
                        weight_dirs=dirs, lora=cfg.train.lora)
        return dict(model_path=model_path, device=cfg.rollout_device, dtype=ROLLOUT_DTYPES[cfg.rollout.precision],
                    threads=cfg.train.threads, batch_size=cfg.rollout.batch_size,
                    trace=cfg.debug.trace_every > 0, rank=rank, weight_dirs=dirs, kv_cache=cfg.rollout.kv_cache,
                    compile=cfg.rollout.compile, lora=cfg.train.lora,
                    record_routing=cfg.algorithm.routing_replay == "r3", fp8=cfg.rollout.precision == "fp8",
                    true_on_policy=cfg.rollout.true_on_policy,
                    frozen_vision=is_vision_language(model_path) and cfg.train.freeze_vision)

    return make


def reward_models(cfg: RLConfig) -> list[tuple[int, ModelRewardSource]]:
    """The recipe's reward-model sources with their index in reward.sources (named in errors and placement)."""
    return [(i, s) for i, s in enumerate(cfg.reward.resolved_sources()) if isinstance(s, ModelRewardSource)]


def reward_model_device(cfg: RLConfig, src: ModelRewardSource) -> str:
    return src.device or cfg.train.device


def reward_model_kwargs(cfg: RLConfig, src: ModelRewardSource, index: int):
    """Constructor arguments of a reward model's worker `rank` (every rank holds the whole model)."""

    def make(rank: int) -> dict:
        return dict(path=src.path, device=reward_model_device(cfg, src), dtype=DTYPES[src.precision],
                    batch_size=src.batch_size, max_length=src.max_length, template=src.template,
                    chat_template=src.chat_template, label=src.label, threads=cfg.train.threads,
                    field=f"reward.sources[{index}]")

    return make


def role_demands(cfg: RLConfig, n_train: int, n_rollout: int, critic: bool, teacher: bool = False
                 ) -> list[RoleDemand]:
    """What each role asks of the cluster: one GPU per train or critic worker, one per rollout worker (an SGLang
    server's tensor x pipeline parallel GPUs), or with cluster.colocate one GPU per train/rollout pair; CPUs
    from cluster.cpus_per_worker. A debug mode that starts no workers of a kind asks nothing for them."""
    cpus = cfg.cluster.cpus_per_worker
    train_gpus, rollout_gpus = worker_gpus(cfg)

    def bundle(gpus: float, workers: int = 1) -> dict[str, float]:
        return {"CPU": cpus * workers} | ({"GPU": gpus} if gpus else {})

    demands = []
    if cfg.cluster.colocate:  # bundle i holds train worker i and rollout worker i, half a GPU each
        if n_train or n_rollout:
            demands.append(RoleDemand("train", cfg.train.num_workers, cfg.train.nodes, bundle(1.0, workers=2)))
    else:
        if n_train:
            demands.append(RoleDemand("train", n_train, cfg.train.nodes, bundle(train_gpus)))
        if n_rollout:
            demands.append(RoleDemand("rollout", n_rollout, cfg.rollout.nodes, bundle(rollout_gpus)))
    if critic:  # GPUs of its own, also when colocated
        demands.append(RoleDemand("critic", cfg.critic.num_workers, cfg.critic.nodes,
                                  bundle(1.0 if cfg.train.device == "cuda" else 0.0)))
    if teacher:  # the distillation teacher: its own placement group, also when colocated
        demands.append(RoleDemand("teacher", cfg.distill.num_workers, cfg.distill.nodes, bundle(teacher_gpus(cfg))))
    for i, src in reward_models(cfg):  # each reward model: a placement of its own
        gpus = src.num_gpus if reward_model_device(cfg, src) == "cuda" else 0.0
        demands.append(RoleDemand(f"reward.sources[{i}]", src.num_workers, src.nodes, bundle(gpus)))
    return demands


def teacher_gpus(cfg: RLConfig) -> float:
    """GPUs of one distillation teacher worker (none on CPU)."""
    return cfg.distill.gpus_per_worker if cfg.train.device == "cuda" else 0.0


def worker_gpus(cfg: RLConfig) -> tuple[float, float]:
    """GPUs of one train worker and one rollout worker (half each when a pair shares one)."""
    if cfg.cluster.colocate:
        return 0.5, 0.5
    train_gpus = 1.0 if cfg.train.device == "cuda" else 0.0
    rollout_gpus = 1.0 if cfg.rollout_device == "cuda" else 0.0
    if cfg.rollout.backend == "sglang":  # one server's GPUs: its tensor x pipeline parallel size
        rollout_gpus *= gpus_per_server(cfg.rollout.sglang.args)
    return train_gpus, rollout_gpus


def _with_server(make, host, token: str):
    """SGLang workers launch their server in the constructor: give it the address and the token there."""
    return lambda rank: make(rank) | {"host": host(rank), "token": token}


def reaches_all_by_store(cfg: RLConfig) -> bool:
    """A run over several nodes needs no shared folder when nothing goes through the driver's disk: the train
    workers write and read checkpoints in the (object) run store, the model is the recipe's model.path (which
    every node must have anyway, not one the driver builds) and weights do not go through disk_dir."""
    return workers_write_checkpoints(cfg) and bool(cfg.model.path) and cfg.weight_sync.transport != "disk"


def ray_workers(cfg: RLConfig, train_cls: type, make_train, make_rollout, make_critic, n_train: int,
                n_rollout: int, make_teacher=None) -> Workers:
    """Plan every role on the cluster (a recipe it cannot hold fails here, before any actor starts), reserve
    the placement groups, then start the actors in them: every group's at once (their processes import torch and
    load their models side by side), waiting for them all at the end. Colocated, the trainer is up before the rollout
    engine starts on its GPUs, which sizes its cache by the memory the trainer left free."""
    cpus, name = cfg.cluster.cpus_per_worker, cfg.name
    placements = place(role_demands(cfg, n_train, n_rollout, make_critic is not None, make_teacher is not None), name)
    spans = len({p.node(r).node_id for p in placements.values() for r in range(len(p))} | {driver_node_id()}) > 1
    workers = Workers(LocalWorkerGroup([]), LocalWorkerGroup([]), placements=list(placements.values()),
                      spans_nodes=spans)
    try:
        if spans and not cfg.cluster.shared_dir and not reaches_all_by_store(cfg):
            raise PlacementError(
                "cluster.shared_dir: this run's workers are placed on other nodes than the driver's, and they read "
                "the model and write checkpoints by path: set a folder every node mounts at the same path (or "
                "use object storage for storage.uri with train.backend torch and a model.path every node has)")
        train_gpus, rollout_gpus = worker_gpus(cfg)
        train_protocols, rollout_protocols = group_protocols(cfg)
        if n_train:
            workers.train = RayWorkerGroup(train_cls, n_train, make_train, cpus, f"{name}-train", train_gpus,
                                           placements["train"], train_protocols, rendezvous=True,
                                           wait=cfg.cluster.colocate)
        if n_rollout:
            rollout_placement = placements["train" if cfg.cluster.colocate else "rollout"]
            if cfg.rollout.backend == "sglang":  # its server starts with the worker: on its address, with the token
                make_rollout = _with_server(
                    make_rollout, lambda r: rollout_placement.node(r).ip if spans else LOOPBACK, workers.control_token)
            workers.rollout = RayWorkerGroup(rollout_backend_class(cfg), n_rollout, make_rollout, cpus,
                                             f"{name}-rollout", rollout_gpus, rollout_placement, rollout_protocols,
                                             wait=False)
        if make_critic:
            workers.critic = RayWorkerGroup(TorchTrainBackend, cfg.critic.num_workers, make_critic, cpus,
                                            f"{name}-critic", 1.0 if cfg.train.device == "cuda" else 0.0,
                                            placements["critic"], CRITIC, rendezvous=True, wait=False)
        if make_teacher:
            workers.teacher = RayWorkerGroup(TorchTrainBackend, cfg.distill.num_workers, make_teacher, cpus,
                                             f"{name}-teacher", teacher_gpus(cfg), placements["teacher"], TEACHER,
                                             rendezvous=True, wait=False)
        for i, src in reward_models(cfg):
            gpus = src.num_gpus if reward_model_device(cfg, src) == "cuda" else 0.0
            workers.reward[str(src.name)] = RayWorkerGroup(
                SequenceClassifierReward, src.num_workers, reward_model_kwargs(cfg, src, i), cpus,
                f"{name}-reward-{src.name}", gpus, placements[f"reward.sources[{i}]"], REWARD, wait=False)
        groups = [workers.train, workers.rollout, workers.critic, workers.teacher, *workers.reward.values()]
        wait_ready([g for g in groups if isinstance(g, RayWorkerGroup)])
    except BaseException:
        workers.shutdown()
        raise
    return workers
