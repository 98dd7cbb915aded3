"""What an RL session holds: one run's engines and the controller state that outlives a step.

`RunEngines` owns the tokenizer, the prompt source (engines/session/prompt_source.py), the train, rollout and (for
PPO with GAE) critic worker groups, the router and rollout runner in front of the rollout workers, the reward
sources, the weight transport, and the steps in flight. It does no stage's work: the stages
(engines/session/stages/) take it and a step's state, and `RLSession` (engines/session/rl.py) runs them in order.
"""

from __future__ import annotations

import logging
import threading
from typing import Self

from transformers import AutoConfig

from rlflow.engines.cluster.addresses import LOOPBACK, node_ip
from rlflow.engines.core.config import LoraConfig, RLConfig
from rlflow.engines.core.protocols import (
    CriticBackend,
    RewardModelBackend,
    RolloutBackend,
    TrainBackend,
    WorkerGroup,
)
from rlflow.engines.data.prompts import load_prompts
from rlflow.engines.env.client import EnvClient, start_env_hosts
from rlflow.engines.models.hf import load_tokenizer, rollout_context
from rlflow.engines.models.moe import routing_width
from rlflow.engines.models.vision_language import VisionProcessor, is_vision_language
from rlflow.engines.reward.sources import RewardSources
from rlflow.engines.rollout.env_rollout import register_env, unregister_env
from rlflow.engines.rollout.functions import RolloutRunner, load_rollout_fn
from rlflow.engines.rollout.router import start_router
from rlflow.engines.session.colocation import ColocatedMemory
from rlflow.engines.session.prompt_source import PromptSource
from rlflow.engines.session.step_state import StepsInFlight
from rlflow.engines.session.timeline import StageTimeline
from rlflow.engines.session.workers import Workers, start_workers
from rlflow.engines.store.run_store import RunStore, replay_source
from rlflow.engines.sync.base import WeightTransport
from rlflow.engines.sync.transports import make_transport

log = logging.getLogger(__name__)


class RunEngines:
    def __init__(self, cfg: RLConfig, model_path: str, train_group: WorkerGroup[TrainBackend],
                 rollout_group: WorkerGroup[RolloutBackend], critic_group: WorkerGroup[CriticBackend] | None = None,
                 reward_groups: dict[str, WorkerGroup[RewardModelBackend]] | None = None,
                 teacher_group: WorkerGroup[TrainBackend] | None = None):
        self.cfg, self.model_path = cfg, model_path
        self.train_group, self.rollout_group = train_group, rollout_group
        self.critic_group = critic_group  # the value model's train workers (role "critic"), when the run has one
        self.teacher_group = teacher_group  # on-policy distillation's frozen teacher (role "teacher"), when distilling
        self.tokenizer = load_tokenizer(model_path)
        # the recipe's reward: reward.fn, or the weighted sum of reward.sources (functions, reward models, judges)
        self.rewards = RewardSources(cfg.reward, reward_groups)
        self.rollout_fn = load_rollout_fn(cfg.rollout.fn)
        self.fn_tokenizer = load_tokenizer(model_path)  # rollout functions' own: HF tokenizers are not thread-safe
        self.runner: RolloutRunner | None = None  # runs rollout_fn against the router (set by create)
        self.env: EnvClient | None = None  # rollout.env's env hosts, which env_rollout drives (set by create)
        self.fresh_adapter_due = False  # LoRA: fresh adapters still to push before the first generation
        data, options = cfg.data, cfg.storage.fsspec_options
        train_rows = load_prompts(data.train_path, data.prompt_key, data.label_key, options(data.train_path),
                                  data.max_image_pixels)
        self.eval_rows = (
            load_prompts(data.eval_path, data.prompt_key, data.label_key, options(data.eval_path),
                         data.max_image_pixels)
            if data.eval_path else []
        )
        # vision-language models: the processor that places a prompt's images (with the tokenizer above, used
        # under tokenizer_lock), and the run's store, which holds each image once by digest (docs/multimodal.md)
        self.vision = VisionProcessor(model_path, self.tokenizer) if is_vision_language(model_path) else None
        self.image_store = RunStore(cfg.storage, cfg.name) if self.vision is not None else None
        self.stored_images: set[str] = set()  # digests this session put in image_store
        self.prompts = PromptSource(train_rows, cfg.rollout.prompts_per_step, cfg.data.seed, cfg.data.shuffle,
                                    self.fn_tokenizer, self.image_store.get_image if self.image_store else None)
        # tokens a rollout sequence holds: a longer prompt is refused here, naming its data row
        self.context_len, self.context_source = rollout_context(cfg.model, cfg.rollout.backend)
        # routing replay r3: ids per token in a rollout's expert record (MoE layers x k)
        self.routing_width = routing_width(AutoConfig.from_pretrained(model_path)) if (
            cfg.algorithm.routing_replay == "r3") else None
        self.weight_version = 0  # of the trainer's weights: the number of syncs so far
        self.kl_coef = cfg.algorithm.kl_coef  # KL-in-reward coefficient of the next step (adaptive: it moves)
        self.dp_ranks: list[int] | None = None  # each train worker's data-parallel rank (asked at the first step)
        # steps in flight: with asynchronous training the rollouts of up to max_staleness later steps run (in
        # other threads) while a step trains, so max_staleness + 1 steps can be open at once
        self.steps = StepsInFlight()
        # train -> rollout weights, by the recipe's transport (engines/sync/); none without rollout workers
        self.weight_transport: WeightTransport | None = (
            make_transport(cfg, train_group, rollout_group) if cfg.debug.generates else None)
        self.tokenizer_lock = threading.Lock()  # the rollout thread and the main thread share the tokenizer
        self.heal_lock = threading.Lock()  # one replacement of dead rollout workers at a time
        self.workers_restarted = 0
        self.reward_workers_restarted = 0
        self.replay = replay_source(cfg)
        self.timeline = StageTimeline(enabled=cfg.debug.trace_every > 0)  # the driver's side of a step's trace
        self.server_urls: list[str] = []  # each rollout worker's SGLang-compatible server
        self.router = None  # ... and one least-loaded endpoint in front of them (engines/rollout/router.py)
        # the groups with their placement groups, rollout servers' addresses and control token (create sets them)
        self.workers = Workers(train_group, rollout_group, critic_group, reward=dict(reward_groups or {}),
                               teacher=teacher_group)
        # colocated: whose turn it is on the shared GPUs (the trainer parks its state while rollout runs)
        self.gpu = ColocatedMemory(cfg, train_group, rollout_group)

    @classmethod
    def create(cls, cfg: RLConfig, model_path: str, use_ray: bool | None = None) -> Self:
        """Start the workers (Ray actors by default, or objects in this process) and the router in front of the
        rollout workers' servers, which rollout functions talk HTTP to."""
        workers = start_workers(cfg, model_path, cfg.cluster.use_ray if use_ray is None else use_ray)
        try:
            session = cls(cfg, model_path, workers.train, workers.rollout, workers.critic, workers.reward,
                          workers.teacher)
        except BaseException:
            workers.shutdown()
            raise
        session.workers = workers
        if len(workers.rollout):
            session.server_urls = workers.rollout.call_each(RolloutBackend.start_server, [
                (workers.rollout_host(i), 0, workers.control_token) for i in range(len(workers.rollout))])
            # on the driver's node address when the run spans nodes: rollout functions may hand it to environments
            # elsewhere (its control routes need the token; generation is open, as the servers' is)
            host = node_ip() if workers.spans_nodes else LOOPBACK
            session.router = start_router(cfg.rollout, session.server_urls, host, workers.control_token)
            lora = cfg.train.lora is not None
            session.runner = RolloutRunner(session.rollout_fn, session.router.url, session.server_urls,
                                           workers.control_token, batched=session.router.kind != "sglang-router",
                                           adapter=LoraConfig.ADAPTER_NAME if lora else None)
            if cfg.rollout.env is not None:  # env hosts as Ray actors with the run's workers, or here in the bare loop
                env_ray = cfg.rollout.env.use_ray
                env_ray = env_ray if env_ray is not None else (cfg.cluster.use_ray if use_ray is None else use_ray)
                try:
                    session.env = start_env_hosts(cfg.rollout.env, cfg.sandbox, env_ray, cfg.cluster)
                except BaseException:
                    session.shutdown()
                    raise
                register_env(session.router.url, session.env, session.context_len)
            # LoRA: requests name the adapter, so the engines need one before they generate: fresh adapters
            # (B = 0, what the base computes) go out before the first generation, unless a checkpoint's come first
            session.fresh_adapter_due = lora and session.weight_transport is not None
        return session

    def _close_env(self) -> None:
        if self.env is not None:
            if self.router is not None:
                unregister_env(self.router.url)
            self.env.close_hosts()
            self.env = None

    def shutdown(self) -> None:
        """Stop what the session started. A part that cannot stop cleanly (a worker of it died with its node) is
        logged and passed over: the workers and their placement groups are released whatever happens."""
        try:
            for part, stop in (("rollout runner", self.runner and self.runner.close), ("env hosts", self._close_env),
                               ("judges", self.rewards.close),
                               ("router", self.router and self.router.stop),
                               ("weight transport", self.weight_transport and self.weight_transport.close)):
                try:
                    if stop:
                        stop()
                except Exception as exc:  # noqa: BLE001 - shutting down after a failure: go on with the rest
                    log.warning("shutdown: the %s did not stop cleanly: %s", part, exc)
        finally:
            self.workers.shutdown()
