"""One RL run's engines and the work of each stage, independent of Prefect.

`RLSession` owns the tokenizer, the prompt source (engines/session/prompt_source.py), the train, rollout and
(for PPO with GAE) critic worker groups, and the step in flight. Each stage method does one stage and
returns a small dict of metrics; tensors stay here or in the workers. The Prefect flow calls these methods
from tasks; the bare loop (bench/, tests) calls them directly, with or without Ray.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import torch

from rlflow.engines.cluster.addresses import LOOPBACK, node_ip
from rlflow.engines.core import algorithms
from rlflow.engines.core.batch import (
    TEACHER_LOGPROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    RolloutBatch,
    TrainBatch,
    batch_size,
    select,
    shard_for_workers,
)
from rlflow.engines.core.config import LoraConfig, RLConfig, StorageConfig
from rlflow.engines.core.protocols import (
    CriticBackend,
    RewardModelBackend,
    RolloutBackend,
    TeacherBackend,
    TrainBackend,
    WorkerGroup,
)
from rlflow.engines.data.prompts import DataError, load_prompts
from rlflow.engines.models.hf import encode_prompt, load_tokenizer, prompt_input, rollout_context
from rlflow.engines.reward.sources import RewardSources
from rlflow.engines.rollout.dynamic_sampling import collect_groups
from rlflow.engines.rollout.functions import PromptSample, RolloutRunner, Sample, load_rollout_fn
from rlflow.engines.rollout.router import start_router
from rlflow.engines.session.colocation import ColocatedMemory
from rlflow.engines.session.evaluation import score
from rlflow.engines.session.prompt_source import PromptSource
from rlflow.engines.session.timeline import StageTimeline
from rlflow.engines.session.workers import Workers, start_workers
from rlflow.engines.store.run_store import RunStore, replay_source
from rlflow.engines.sync.base import WeightTransport
from rlflow.engines.sync.transports import make_transport
from rlflow.engines.train.torch_backend import with_train_logprobs

log = logging.getLogger(__name__)
TOKEN_ADVANTAGES = ("reinforce_pp", "gae", "reinforce_pp_baseline")  # estimators giving per-token advantages


@dataclass
class StepState:
    """What one iteration has produced so far; a stage reads the fields earlier stages filled."""

    step: int
    rows: list[dict]  # the step's prompts (data rows)
    batch: RolloutBatch  # its samples; the reward stage adds responses and rewards
    advantages: torch.Tensor | None = None  # [N], or [N, L] aligned with the packed batch (token-level estimators)
    train_logprobs: torch.Tensor | None = None  # the train engine's, when the advantages stage already needed them
    values: torch.Tensor | None = None  # [N, L] the critic's, aligned with the packed batch (with a critic)
    returns: torch.Tensor | None = None  # [N, L] GAE's value targets for the critic
    behaviour_logprobs: torch.Tensor | None = None  # the train engine's, for samples that came without logprobs
    keep: torch.Tensor | None = None  # [N, L] 0 on the tokens rollout correction rejected (algorithm.rejection)
    is_weights: torch.Tensor | None = None  # [N, L] importance weights computed over the whole batch
    kl_coef: float | None = None  # the KL-in-reward coefficient this step used (adaptive kl_ctrl moves it)
    teacher_logprobs: torch.Tensor | None = None  # [N, L] the distillation teacher's, aligned with the packed batch
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None  # ... or its top-k (ids, logprobs) [N, L, k]





class RLSession:
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
        self._fn_tokenizer = load_tokenizer(model_path)  # rollout functions' own: HF tokenizers are not thread-safe
        self.runner: RolloutRunner | None = None  # runs rollout_fn against the router (set by create)
        self._fresh_adapter_due = False  # LoRA: fresh adapters still to push before the first generation
        data, options = cfg.data, cfg.storage.fsspec_options
        train_rows = load_prompts(data.train_path, data.prompt_key, data.label_key, options(data.train_path))
        self.prompts = PromptSource(train_rows, cfg.rollout.prompts_per_step, cfg.data.seed, cfg.data.shuffle,
                                    self._fn_tokenizer)
        self.eval_rows = (
            load_prompts(data.eval_path, data.prompt_key, data.label_key, options(data.eval_path))
            if data.eval_path else []
        )
        # tokens a rollout sequence holds: a longer prompt is refused here, naming its data row
        self.context_len, self._context_source = rollout_context(cfg.model, cfg.rollout.backend)
        self.weight_version = 0  # of the trainer's weights: the number of syncs so far
        self.kl_coef = cfg.algorithm.kl_coef  # KL-in-reward coefficient of the next step (adaptive: it moves)
        self._dp_ranks: list[int] | None = None
        # steps in flight: with asynchronous training the rollouts of up to max_staleness later steps run (in
        # other threads) while a step trains, so max_staleness + 1 steps can be open at once
        self._states: dict[int, StepState] = {}
        self._states_lock = threading.Lock()
        # train -> rollout weights, by the recipe's transport (engines/sync/); none without rollout workers
        self.weight_transport: WeightTransport | None = (
            make_transport(cfg, train_group, rollout_group) if cfg.debug.generates else None)
        self._tokenizer_lock = threading.Lock()  # the rollout thread and the main thread share the tokenizer
        self._heal_lock = threading.Lock()  # one replacement of dead rollout workers at a time
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

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: RLConfig, model_path: str, use_ray: bool | None = None) -> RLSession:
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
            # LoRA: requests name the adapter, so the engines need one before they generate: fresh adapters
            # (B = 0, what the base computes) go out before the first generation, unless a checkpoint's come first
            session._fresh_adapter_due = lora and session.weight_transport is not None
        return session

    def shutdown(self) -> None:
        """Stop what the session started. A part that cannot stop cleanly (a worker of it died with its node) is
        logged and passed over: the workers and their placement groups are released whatever happens."""
        try:
            for part, stop in (("rollout runner", self.runner and self.runner.close), ("judges", self.rewards.close),
                               ("router", self.router and self.router.stop),
                               ("weight transport", self.weight_transport and self.weight_transport.close)):
                try:
                    if stop:
                        stop()
                except Exception as exc:  # noqa: BLE001 - shutting down after a failure: go on with the rest
                    log.warning("shutdown: the %s did not stop cleanly: %s", part, exc)
        finally:
            self.workers.shutdown()

    # ---- stages --------------------------------------------------------------------------------------
    def rollout(self, step: int) -> dict[str, float]:
        """Generate samples_per_prompt responses for the next prompts_per_step prompts (or replay them)."""
        if self.replay is not None:
            return self.replay_rollout(step)
        t0 = time.perf_counter()
        metrics = self.replace_dead_rollout_workers()
        self._serve_fresh_adapter()
        self.gpu.for_rollout()
        if self.cfg.rollout.dynamic_sampling.enabled:
            prompts, groups, metrics = self._dynamic_groups(step)
            rows = [p.row for p in prompts]
        else:
            rows = self.prompts.take(step)
            prompts = self._prompt_samples(rows, self.cfg.rollout.samples_per_prompt, self._seed(step))
            groups = self.runner.run(prompts, self._sampling(self.cfg.rollout.temperature))
            if self.cfg.algorithm.advantage == "remax":
                groups = self._with_greedy_baselines(rows, groups, step)
        batch = RolloutBatch.from_samples(prompts, groups)
        if self.cfg.rollout.dynamic_sampling.enabled:  # its prompts do not follow from the cursor: store both
            batch.metadata = self.prompts.batch_metadata(step)
        self._open(StepState(step, rows, batch))
        metrics |= batch.metrics() | self.gpu.take_metrics()
        return metrics | {"rollout/tokens_per_s": metrics["rollout/tokens"] / (time.perf_counter() - t0)}

    def _with_greedy_baselines(self, rows: list[dict], groups: list[list[Sample]], step: int
                               ) -> list[list[Sample]]:
        """ReMax: each group with one more sample, the prompt's greedy response (temperature 0, through the same
        rollout function), marked as the baseline and with an all-0 loss mask: it is rewarded like the others
        and never trained on."""
        prompts = self._prompt_samples(rows, 1, 2**61 + self._seed(step))  # seeds apart (greedy needs none)
        greedy = self.runner.run(prompts, self._sampling(0.0))
        for group, extra in zip(groups, greedy, strict=True):
            base = extra[0]
            base.metadata["remax_baseline"] = True
            base.loss_mask = [0] * len(base.response_ids)
            group.append(base)
        return groups

    def _dynamic_groups(self, step: int) -> tuple[list[PromptSample], list[list[Sample]], dict[str, float]]:
        """Dynamic sampling (engines/rollout/dynamic_sampling.py): prompts_per_step groups whose rewards differ, taking
        prompts from the data as needed; what is left over carries into the next step. A retried rollout of
        the same step starts again from the same cursor and carry."""
        r, ds = self.cfg.rollout, self.cfg.rollout.dynamic_sampling
        carry = self.prompts.begin_dynamic(step)
        taken = 0

        def next_prompts(k: int) -> list[PromptSample]:
            nonlocal taken
            rows = self.prompts.next_rows(k)
            prompts = self._prompt_samples(rows, r.samples_per_prompt, self._seed(step) + taken * r.samples_per_prompt)
            for i, p in enumerate(prompts):
                p.index = taken + i
            taken += k
            return prompts

        async def score(prompt: PromptSample, samples: list[Sample]) -> list[float]:
            texts = await asyncio.to_thread(self._responses, [s.response_ids for s in samples],
                                            [s.response for s in samples])
            for s, text in zip(samples, texts, strict=True):
                s.response = text
            given = np.array([np.nan if s.reward is None else s.reward for s in samples])
            return await asyncio.to_thread(self._rewards, [prompt.prompt] * len(samples), texts,
                                           [prompt.label] * len(samples), given,
                                           [prompt.row.get("meta", {})] * len(samples))

        collected = self.runner.submit(collect_groups(
            self.rollout_fn, self.runner.name, self.runner.router_url, self._sampling(r.temperature),
            r.prompts_per_step, next_prompts, score, carry, over_sample=ds.over_sample,
            max_prompts=ds.max_prompts or 4 * r.prompts_per_step, partial=ds.partial_rollout))
        self.prompts.end_dynamic(step, collected.carry)
        return ([p for p, _ in collected.groups], [g for _, g in collected.groups], collected.metrics)

    def rollout_batch(self, step: int) -> RolloutBatch:
        """The step's samples (scored once the reward stage has run)."""
        return self._state(step).batch

    def rollout_table(self, step: int) -> pa.Table:
        """The step's samples as one table (a row per sample, ROLLOUT_SCHEMA): what the run store persists."""
        return self._state(step).batch.to_arrow()

    def replay_rollout(self, step: int) -> dict[str, float]:
        """Take step's batch from the replayed run's store, exactly as that run generated it."""
        table = self.replay.load_rollout(step)
        if table is None:
            raise FileNotFoundError(
                f"debug.replay_run: run {self.replay.run!r} has no committed rollout batch for step {step} "
                f"({self.replay.uri('steps', step, 'rollout.parquet')}); a run keeps its batches with "
                "checkpoint.keep_rollouts: true (rollout_only runs always do)")
        return self.restore_rollout(step, table) | {"rollout/replayed": 1.0}

    def restore_rollout(self, step: int, table: pa.Table) -> dict[str, float]:
        """Take a persisted batch as this step's rollout; the data cursor moves exactly as a fresh rollout would."""
        group = self.cfg.rollout.samples_per_prompt
        batch = RolloutBatch.from_arrow(table, group)
        if self.cfg.rollout.dynamic_sampling.enabled:
            self.prompts.restore_dynamic(step, batch.metadata)
            rows = [{"prompt": batch.prompt[i], "label": batch.label[i]} for i in batch.group_starts()]
        else:
            rows = self.prompts.take(step)
        expected = [r["prompt"] for r in rows]
        if len(batch.group_starts()) != len(rows) or batch.prompt != [
                expected[g] if g < len(expected) else None for g in batch.group]:
            raise RuntimeError(f"step {step}: the stored rollout batch was made from other prompts (data changed?)")
        self._open(StepState(step, rows, batch))
        return batch.metrics()

    def reward(self, step: int) -> dict[str, float]:
        healed = self.replace_dead_reward_workers()
        st = self._state(step)
        b = st.batch
        responses = self._responses(b.split("output_ids"), b.text)
        metas = [st.rows[g].get("meta", {}) for g in b.group]  # the rows' other columns, for the reward
        st.batch = b.with_rewards(responses, self._rewards(b.prompt, responses, b.label, b.fn_reward, metas))
        all_rewards = torch.tensor(st.batch.reward, dtype=torch.float32)
        rewards = all_rewards[torch.as_tensor(~b.baseline)]  # ReMax's greedy baselines are not the policy's samples
        metrics = {
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "rollout/accuracy": float((rewards >= 1.0).float().mean()),
        }
        if b.baseline.any():
            metrics["rollout/greedy_reward_mean"] = float(all_rewards[torch.as_tensor(b.baseline)].mean())
        return metrics | self.rewards.take_metrics() | healed

    def replace_dead_reward_workers(self) -> dict[str, float]:
        """Restart every reward-model worker that no longer answers. A worker holds a frozen model and nothing
        else, so a fresh actor in the same bundle is the same worker; a dead one would otherwise fail this and
        every later reward stage, the stage's retries included."""
        for group in self.workers.reward.values():
            for rank, ok in enumerate(group.alive()):
                if not ok:
                    group.restart(rank)
                    self.reward_workers_restarted += 1
        n = self.reward_workers_restarted
        return {"reward/workers_restarted": float(n)} if n else {}

    def teacher(self, step: int) -> dict[str, float]:
        """On-policy distillation: the teacher's per-token logprobs of the step's sampled tokens (its own stage,
        beside the reference pass of the advantages stage), kept for the train stage's distillation term.

        distill/kl is the mean over the trained tokens of log p - log q at the policy that sampled them: the k1
        estimate of the per-token reverse KL(student || teacher), which falls as the student learns."""
        if self.teacher_group is None:
            return {}
        st = self._state(step)
        batch = self._pack(st, torch.zeros(len(st.batch)))
        if self.cfg.distill.uses_top_k:
            return self._teacher_topk(st, batch)
        st.teacher_logprobs = self._group_logprobs(self.teacher_group, batch)
        mask, student = batch["loss_mask"], batch["old_logprobs"]
        return {
            "distill/kl": float(algorithms.masked_mean(student - st.teacher_logprobs, mask)),
            "distill/teacher_logprob_mean": float(algorithms.masked_mean(st.teacher_logprobs, mask)),
            "distill/student_logprob_mean": float(algorithms.masked_mean(student, mask)),
        }

    def _teacher_topk(self, st: StepState, batch: TrainBatch) -> dict[str, float]:
        """distill.loss forward_kl / jsd: the teacher's top_k tokens at each position, each worker on its slice.
        distill/teacher_topk_mass: how much of the teacher's distribution the k cover; distill/sampled_in_topk:
        the share of the student's sampled tokens among them (rises as the student learns)."""
        n, k = len(self.teacher_group), self.cfg.distill.top_k
        per = batch_size(batch) // n
        parts = self.teacher_group.call_each(TeacherBackend.forward_topk,
                                             [(select(batch, slice(w * per, (w + 1) * per)), k) for w in range(n)])
        ids, logprobs = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        st.teacher_topk = (ids, logprobs)
        mask = batch["loss_mask"]
        sampled = (ids == batch["input_ids"][..., None]).any(-1).float()
        return {"distill/teacher_topk_mass": float(algorithms.masked_mean(logprobs.exp().sum(-1), mask)),
                "distill/sampled_in_topk": float(algorithms.masked_mean(sampled, mask))}

    def advantages(self, step: int) -> dict[str, float]:
        """Rewards -> advantages: overlong shaping and KL-in-reward first, then the recipe's estimator.

        KL in the reward needs per-token logprobs of the reference (and, with IS correction, of the train
        engine): the train workers compute them here, and the train stage reuses the train engine's. With a
        critic, its workers compute the values of the batch here, and GAE turns them into advantages and into
        the returns the critic trains on.
        """
        st = self._state(step)
        algo, groups = self.cfg.algorithm, torch.as_tensor(st.batch.group)
        rewards = scored = torch.tensor(st.batch.reward, dtype=torch.float32)
        metrics = {}
        if algo.overlong_buffer and algo.overlong_penalty:
            lengths = torch.as_tensor(st.batch.lengths)
            pen = algorithms.overlong_penalty(lengths, self.cfg.rollout.max_new_tokens, algo.overlong_buffer,
                                              algo.overlong_penalty)
            rewards = rewards + pen
            metrics |= {"adv/overlong_penalty": float(pen.mean()), "adv/overlong_frac": float((pen < 0).float().mean())}
        kl_in_reward = algo.kl_in == "reward" and algo.kl_coef > 0
        token_level = algo.advantage in TOKEN_ADVANTAGES or self.critic_group is not None
        st.train_logprobs, st.keep, st.is_weights, mask, penalty = None, None, None, None, None
        if kl_in_reward or token_level or algo.corrects_rollout:
            batch = self._pack(st, torch.zeros(len(rewards)))
            mask = batch["loss_mask"]
            penalty = torch.zeros_like(mask)
            if algo.corrects_rollout:  # the train engine's logprobs become PPO's old policy (with_train_logprobs)
                st.train_logprobs = self._train_logprobs(batch)
                metrics |= self._rollout_correction(st, batch)
                mask = mask * st.keep
            if kl_in_reward:
                # the behaviour policy: the rollout engine's, or with correction the train engine's, which PPO's
                # ratio is also taken against
                policy = batch["old_logprobs"] if st.train_logprobs is None else st.train_logprobs
                ref = self._train_logprobs(batch, reference=True)
                kl = algorithms.kl_reward_penalty(policy, ref, mask, 1.0, algo.kl_estimator)
                metrics |= self._kl_in_reward(st, kl, mask)
                penalty = st.kl_coef * kl
                metrics["adv/kl_penalty"] = float(penalty.sum(-1).mean())
        if token_level:
            token_rewards = algorithms.outcome_token_rewards(rewards, mask) - penalty
        if self.critic_group is not None:
            st.values = self._critic_values(batch)
            gae, st.returns = algorithms.gae_advantages(token_rewards, st.values, mask, algo.gamma, algo.lam)
            metrics |= {
                "critic/values_mean": float(algorithms.masked_mean(st.values, mask)),
                "critic/returns_mean": float(algorithms.masked_mean(st.returns, mask)),
                "critic/vf_explained_var": float(algorithms.explained_variance(st.values, st.returns, mask)),
            }
        if kl_in_reward and algo.advantage not in ("reinforce_pp", "gae"):  # those take the per-token penalty
            rewards = rewards - penalty.sum(-1)
        if algo.advantage in TOKEN_ADVANTAGES:  # [B, T]
            if algo.advantage == "gae":  # whitened over the batch's response tokens, as verl does
                st.advantages = algorithms.masked_whiten(gae, mask)
            elif algo.advantage == "reinforce_pp":
                st.advantages = algorithms.reinforce_pp_advantages(token_rewards, mask, algo.gamma)
            else:
                st.advantages = algorithms.reinforce_pp_baseline_advantages(rewards, groups, mask)
            abs_mean = float(algorithms.masked_mean(st.advantages.abs(), mask))
        else:
            st.advantages = self._sequence_advantages(st, rewards, groups)
            abs_mean = float(st.advantages.abs().mean())
        if rewards is not scored:
            metrics["adv/shaped_reward_mean"] = float(rewards.mean())
        return metrics | self.gpu.take_metrics() | {
            "adv/abs_mean": abs_mean,
            "adv/zero_std_groups": float(algorithms.equal_reward_groups(rewards, groups).float().mean()),
        }

    def _sequence_advantages(self, st: StepState, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        algo = self.cfg.algorithm
        if algo.advantage in ("grpo", "dr_grpo"):
            normalize = algo.normalize_std if algo.normalize_std is not None else algo.advantage == "grpo"
            return algorithms.group_advantages(rewards, groups, normalize)
        if algo.advantage == "passk":
            return algorithms.passk_advantages(rewards, groups, algo.passk_k, algo.passk_threshold)
        if algo.advantage == "grpo_passk":
            return algorithms.grpo_passk_advantages(rewards, groups, algo.normalize_std is not False)
        if algo.advantage == "rloo":
            return algorithms.rloo_advantages(rewards, groups)
        if algo.advantage == "remax":
            return algorithms.remax_advantages(rewards, groups, torch.as_tensor(st.batch.baseline))
        if algo.advantage == "opo":  # lengths: the response tokens each sample trains on
            trained = torch.from_numpy(st.batch.loss_mask.astype(np.float32))
            sample = torch.from_numpy(np.repeat(np.arange(len(st.batch)), st.batch.lengths))
            lengths = torch.zeros(len(st.batch)).index_add_(0, sample, trained)
            return algorithms.opo_advantages(rewards, groups, lengths)
        return algorithms.reinforce_pp_baseline_seq_advantages(rewards, groups)

    def _rollout_correction(self, st: StepState, batch: TrainBatch) -> dict[str, float]:
        """Rejection mask and importance weights of the step over its whole batch (batch normalisation needs
        all of it; a micro-batch would give another mean): the train stage hands both to the workers."""
        algo = self.cfg.algorithm
        mask, rollout = batch["loss_mask"], batch["old_logprobs"]
        st.keep, metrics = algorithms.rejection_mask(st.train_logprobs, rollout, mask, algo.rejection,
                                                     algo.reject_low, algo.reject_high)
        if algo.is_correction != "none":
            st.is_weights, is_metrics = algorithms.importance_weights(
                st.train_logprobs, rollout, mask * st.keep, algo.is_correction, algo.tis_cap, algo.icepop_low,
                algo.icepop_high, level=algo.is_level, batch_normalize=algo.is_batch_normalize)
            metrics |= is_metrics
        return {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}

    def _kl_in_reward(self, st: StepState, kl: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """Fix the step's KL-in-reward coefficient and, with adaptive kl_ctrl, move the next step's by the KL
        measured here (mean over samples of the per-token mean). A retried stage reuses the step's coefficient,
        so the controller moves once per step."""
        algo = self.cfg.algorithm
        if st.kl_coef is None:
            st.kl_coef = self.kl_coef
        out = {"adv/kl_coef": st.kl_coef}
        if algo.kl_ctrl == "adaptive":
            current = float((kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean())
            self.kl_coef = algorithms.adaptive_kl_coef(st.kl_coef, current, algo.kl_target, algo.kl_horizon,
                                                       len(kl))
            out["adv/kl_mean"] = current
        return out

    def train(self, step: int) -> dict[str, float]:
        st = self._state(step)
        b = st.batch
        known = b.weight_version >= 0
        staleness = self.weight_version - np.where(known, b.weight_version, self.weight_version)
        # dynamic sampling's carried groups are older by design; samples without logprobs are trained on-policy
        checked = ~b.carried & b.has_logprobs
        fresh = staleness[checked]
        if fresh.size and fresh.max() > self.cfg.rollout.max_staleness:
            raise RuntimeError(
                f"step {step}: samples from weight version {b.weight_version.min()} are "
                f"{staleness.max()} updates behind the trainer (version {self.weight_version}); "
                f"rollout.max_staleness allows {self.cfg.rollout.max_staleness}"
            )
        self.gpu.for_training()  # colocated: the rollout engine releases its memory, the trainer onloads
        batch = self._pack(st, st.advantages)
        if st.train_logprobs is not None:
            batch = with_train_logprobs(batch, st.train_logprobs)
        if st.keep is not None:  # rejected tokens leave the loss mask (and every denominator)
            batch["loss_mask"] = batch["loss_mask"] * st.keep
        if st.is_weights is not None:
            batch["is_weights"] = st.is_weights
        if self.teacher_group is not None:
            if st.teacher_logprobs is None and st.teacher_topk is None:
                raise RuntimeError(f"step {step}: distill.teacher_path is set but the teacher stage has not scored "
                                   "this step's samples (run it before train)")
            if st.teacher_topk is not None:
                batch[TEACHER_TOPK_IDS], batch[TEACHER_TOPK_LOGPROBS] = st.teacher_topk
            else:
                batch[TEACHER_LOGPROBS] = st.teacher_logprobs
        t0 = time.perf_counter()
        critic = self._submit_critic_step(st, batch)  # the critic trains beside the policy (other actors)
        metrics = {"train/staleness_mean": float(staleness.mean()), "train/staleness_max": float(staleness.max())}
        if step >= self.cfg.critic.freeze_policy_steps or self.critic_group is None:
            if self._dp_ranks is None:  # ranks of one tensor/pipeline-parallel group train on the same shard
                self._dp_ranks = self.train_group.call(TrainBackend.data_parallel_rank)
            shards = shard_for_workers(batch, max(self._dp_ranks) + 1, self.cfg.train.mini_batches)
            results = self.train_group.call_each(TrainBackend.train_step, [(shards[r],) for r in self._dp_ranks])
            metrics["time/train_worker"] = results[0].pop("worker_s")
            metrics |= {f"train/{k}": v for k, v in results[0].items()}
        if critic is not None:
            result = self.critic_group.wait(critic)[0]
            result.pop("value_mean")  # the values being trained; critic/values_mean is the ones GAE used
            metrics["time/critic_worker"] = result.pop("worker_s")
            metrics |= {f"critic/{k}": v for k, v in result.items()}
        tokens = float(batch["attention_mask"].sum())
        return metrics | self.gpu.take_metrics() | {"train/tokens_per_s": tokens / (time.perf_counter() - t0)}

    def sync_weights(self, step: int) -> dict[str, float]:
        """Send the trainer's weights to every rollout worker as version step+1, by the recipe's transport."""
        if self.weight_transport is None:  # train_only: no rollout workers; the version still counts updates
            self.weight_version = step + 1
            return {"sync/weight_version": float(self.weight_version)}
        self.replace_dead_rollout_workers(probe=True)
        self.gpu.before_sync()  # colocated: the optimizer state leaves the GPU before the rollout weights come
        t0 = time.perf_counter()
        version = step + 1
        # max_staleness >= 2: rollouts of later steps generate meanwhile; paused, they continue after the update
        # with the new weights (a transport sends a version in several parts: none is decoded with half of one)
        paused = self.cfg.rollout.max_staleness >= 2
        if paused:
            self.rollout_group.call(RolloutBackend.pause_generation)
        try:
            nbytes = self.weight_transport.update(version)  # what each rollout worker received, in its own dtype
        finally:
            if paused:
                self.rollout_group.call(RolloutBackend.continue_generation)
        self.weight_version = version
        self._fresh_adapter_due = False  # the trained adapter is served
        dt = time.perf_counter() - t0
        self.gpu.for_rollout()  # ... and the weights after: evaluation and the next rollout get the memory
        return {"sync/weight_version": float(version), "sync/bytes": float(nbytes),
                "sync/gb_per_s": nbytes / dt / 1e9} | self.gpu.take_metrics()

    def evaluate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """Held-out reward with eval.temperature (greedy by default); also returns a few sample rows."""
        rows = self.eval_rows[: self.cfg.eval.max_prompts]
        if not rows:
            return {}, []
        self.replace_dead_rollout_workers()
        self._serve_fresh_adapter()
        self.gpu.for_rollout()
        prompts = self._prompt_samples(rows, 1, 2**62 + self._seed(step))  # seeds apart from training's
        groups = self.runner.run(prompts, self._sampling(self.cfg.eval.temperature))
        b = RolloutBatch.from_samples(prompts, [g[:1] for g in groups])
        responses = self._responses(b.split("output_ids"), b.text)
        rewards = self._rewards(b.prompt, responses, b.label, b.fn_reward, [r.get("meta", {}) for r in rows],
                                record=False)
        samples = [
            {"step": step, "prompt": r["prompt"], "response": s, "label": str(r["label"]), "reward": w}
            for r, s, w in zip(rows, responses, rewards, strict=True)
        ]
        scored = score(rewards, b.lengths, n=1)
        metrics = {f"eval/{k}": scored[k] for k in ("reward_mean", "accuracy", "response_len_mean")}
        return metrics | self.gpu.take_metrics(), samples

    def sample_rows(self, step: int, k: int) -> list[dict]:
        """The first sample of each of the step's first k prompts, for the samples table."""
        st = self._state(step)
        b = st.batch
        return [
            {"step": step, "prompt": st.rows[g]["prompt"], "response": b.response[i],
             "label": str(st.rows[g]["label"]), "reward": float(b.reward[i])}
            for i, g in ((int(i), int(b.group[i])) for i in b.group_starts()[:k])
        ]

    def replace_dead_rollout_workers(self, probe: bool = False) -> dict[str, float]:
        """Restart every rollout worker that died: the router marked its server unreachable (its requests
        were retried on the others), or, with `probe`, its actor no longer answers. The new worker gets the
        current weights and takes the old one's place behind the router."""
        if self.router is None:
            return {}
        with self._heal_lock:
            alive = self.rollout_group.alive() if probe else [True] * len(self.rollout_group)
            dead = [i for i, w in enumerate(self.router.workers) if not alive[i] or not w.healthy]
            dead = [i for i in dead if not alive[i] or not _answers(self.router.workers[i].url)]
            for i in dead:
                self.rollout_group.restart(i)
                host, token = self.workers.rollout_host(i), self.workers.control_token
                url = self.rollout_group.call_one(i, RolloutBackend.start_server, host, 0, token)
                self.router.replace(i, url)
                self.runner.worker_urls[i] = url  # control requests the router does not forward go to each worker
            if dead:
                self.gpu.resident()  # the resend reads the trainer's weights
                self.weight_transport.reconnect()  # a connected transport connects again, the new worker included
                self.weight_transport.resend(self.weight_version)
                self.workers_restarted += len(dead)
        return {"rollout/workers_restarted": float(self.workers_restarted)} if self.workers_restarted else {}

    # ---- checkpoints ---------------------------------------------------------------------------------
    def save(self, path: str | Path, step: int, storage: StorageConfig | None = None, background: bool = False
             ) -> dict:
        """Every worker saves its state into `path`; returns the controller state to store beside it.

        With `storage`, `path` is the checkpoint's folder in that run store (s3:// too) and every worker writes
        there itself (tasks/run_context.py commits it after this returns). The cursor is saved as it was after
        `step` took its prompts: with asynchronous training (rollout.max_staleness) later steps have already
        taken their own, and a resumed run reuses their batches from the store. `background`
        (checkpoint.async_save): the workers return once their state is in host memory and write it from threads,
        each leaving one of `written_markers()` when done."""
        self.gpu.resident()  # the next rollout parks the state again
        how = {"background": True} if background else {}
        self.train_group.call(TrainBackend.save, *worker_target(path, "", storage), **how)
        save_tokenizer(self.tokenizer, path, storage)  # so model/ loads with transformers as it is
        if self.critic_group is not None:
            self.critic_group.call(CriticBackend.save, *worker_target(path, "critic", storage), **how)
        state = self.prompts.state_after(step) | {"weight_version": self.weight_version}
        if self.cfg.algorithm.kl_ctrl == "adaptive":  # the controller's state: resume must continue from it
            state["kl_coef"] = self.kl_coef
        return state

    def written_markers(self) -> list[str]:
        """The files a background save leaves in the checkpoint's folder, one a worker, once its write is done
        (fsdp.BackgroundSave); a worker whose write failed leaves the same name with `failed` for `written`."""
        critic = len(self.critic_group) if self.critic_group is not None else 0
        return ([f"written_rank{r}.json" for r in range(len(self.train_group))]
                + [f"critic/written_rank{r}.json" for r in range(critic)])

    def drain_saves(self) -> None:
        """Wait for every worker's background checkpoint write to end (a failure was reported by its marker)."""
        for group, protocol in self._savers():
            group.call(protocol.wait_saved, raise_error=False)

    def save_problem(self) -> str | None:
        """Why a background checkpoint's markers may never all come, asked while the run waits for them: a worker
        gone, or a writer that failed (its own marker may be what failed). None while they may still come."""
        try:
            states = [state for group, protocol in self._savers() for state in group.call(protocol.save_state)]
        except Exception as exc:  # a dead actor's call raises
            return f"a worker is gone ({type(exc).__name__}: {exc})"
        failed = [state for state in states if state.startswith("failed")]
        return failed[0] if failed else None

    def _savers(self) -> list[tuple[WorkerGroup, type]]:
        """The worker groups that write checkpoints, each with its protocol: the policy's, and the critic's."""
        critic = [(self.critic_group, CriticBackend)] if self.critic_group is not None else []
        return [(self.train_group, TrainBackend), *critic]

    def load(self, path: str | Path, controller_state: dict, storage: StorageConfig | None = None) -> None:
        """Every worker loads its state from `path` (with `storage`: straight from that run store's folder)."""
        self.gpu.resident()
        self.train_group.call(TrainBackend.load, *worker_target(path, "", storage))
        if self.critic_group is not None:
            self.critic_group.call(CriticBackend.load, *worker_target(path, "critic", storage))
        self.prompts.load_state(controller_state)
        self.weight_version = controller_state["weight_version"]
        self.kl_coef = controller_state.get("kl_coef", self.cfg.algorithm.kl_coef)
        if self.weight_transport is not None:
            # by the transport's own route, connecting first as at a run's first sync: not through Ray's object
            # store, where 1.5B's fp32 weights were one 6 GB object, spilled to disk (2.5 min, bench/gpu_fault.py)
            self.weight_transport.update(self.weight_version)
            self._fresh_adapter_due = False  # the checkpoint's adapter is served

    def _serve_fresh_adapter(self) -> None:
        """A LoRA run's first generation: push the fresh adapters (once; a resumed run's load pushed its own)."""
        if self._fresh_adapter_due:
            self._fresh_adapter_due = False
            self.weight_transport.update(self.weight_version)

    # ---- trace timeline ------------------------------------------------------------------------------
    def stage_span(self, stage: str, step: int) -> AbstractContextManager[None]:
        """Record the stage as a span on its lane of the driver's timeline (free when tracing is off)."""
        return self.timeline.span(stage, step)

    def trace_events(self, step: int) -> dict:
        """The Chrome trace of `step`: the driver's stage spans and every rollout worker's events."""
        return self.timeline.trace(step, self.rollout_group.call(RolloutBackend.drain_trace))

    # ---- helpers -------------------------------------------------------------------------------------
    def _open(self, st: StepState) -> None:
        """Make `st` the step's state. The step that trains while this one generates is at most
        max(max_staleness, 1) behind (one behind is also kept synchronously, as always); older ones are
        finished and dropped."""
        behind = st.step - max(self.cfg.rollout.max_staleness, 1)
        with self._states_lock:
            self._states[st.step] = st
            for old in [k for k in self._states if k < behind]:
                del self._states[old]
        self.prompts.forget_before(behind)

    def _pack(self, st: StepState, advantages: torch.Tensor) -> TrainBatch:
        has_logprobs = st.batch.has_logprobs
        batch = st.batch.to_train_batch(self.tokenizer.pad_token_id, advantages)
        if not has_logprobs.all():  # a rollout function gave none: the samples count as on-policy
            if st.behaviour_logprobs is None:
                st.behaviour_logprobs = self._train_logprobs(batch)
            missing = torch.as_tensor(~has_logprobs)
            batch["old_logprobs"][missing] = (st.behaviour_logprobs * batch["loss_mask"])[missing]
        return batch

    def _train_logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs [N, L] of the train engine's policy (or reference), each worker on its slice."""
        self.gpu.for_training()
        return self._group_logprobs(self.train_group, batch, reference)

    @staticmethod
    def _group_logprobs(group: WorkerGroup[TrainBackend], batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs [N, L] of `group`'s model (the policy, its reference, or the distillation teacher),
        each worker on its slice (one call per worker)."""
        n = len(group)
        per = batch_size(batch) // n
        parts = [(select(batch, slice(w * per, (w + 1) * per)), reference) for w in range(n)]
        return torch.cat(group.call_each(TrainBackend.forward_logprobs, parts))

    def _critic_values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values [N, L] of the batch, each critic worker on its slice (one call per worker)."""
        n = len(self.critic_group)
        per = batch_size(batch) // n
        return torch.cat(self.critic_group.call_each(
            CriticBackend.forward_values, [(select(batch, slice(w * per, (w + 1) * per)),) for w in range(n)]))

    def _submit_critic_step(self, st: StepState, batch: TrainBatch):
        """Start the critic's train step on the step's returns (handles for critic_group.wait), or None."""
        if self.critic_group is None:
            return None
        values = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}
        values |= {"returns": st.returns, "old_values": st.values}
        shards = shard_for_workers(values, len(self.critic_group), self.cfg.train.mini_batches)
        return self.critic_group.submit_each(CriticBackend.train_step, [(s,) for s in shards])

    def _state(self, step: int) -> StepState:
        if step not in self._states:
            raise RuntimeError(f"step {step}: no rollout in flight (run the rollout stage first)")
        return self._states[step]

    def _encode(self, prompt: str | list[dict]) -> list[int]:
        with self._tokenizer_lock:
            return encode_prompt(self.tokenizer, prompt, self.cfg.data.chat_template)

    def _sampling(self, temperature: float) -> dict:
        """SGLang sampling_params for a rollout function."""
        r = self.cfg.rollout
        return {"max_new_tokens": r.max_new_tokens, "temperature": temperature, "top_p": r.top_p,
                "top_k": r.top_k or -1, "stop": list(r.stop)}

    def _prompt_samples(self, rows: list[dict], n: int, seed: int) -> list[PromptSample]:
        samples = [PromptSample(index=i, prompt=r["prompt"], label=r["label"], prompt_ids=self._encode(prompt_input(r)),
                                n=n, seed=seed + i * n, row=r, tokenizer=self._fn_tokenizer)
                   for i, r in enumerate(rows)]
        for s in samples:
            if len(s.prompt_ids) >= self.context_len:
                raise DataError(f"{self._data_row(s.row)}: the prompt is {len(s.prompt_ids)} tokens; a rollout "
                                f"sequence holds {self.context_len} ({self._context_source}), the response "
                                "included: shorten or drop the prompt, or use a model with a longer context")
        return samples

    def _data_row(self, row: dict) -> str:
        """'<file>: row <n>' of a row this session loaded (the first equal one: searched only on the error path;
        rows are normalized anew each time they are read, so identity would not find it)."""
        for path, rows in ((self.cfg.data.train_path, self.prompts.rows), (self.cfg.data.eval_path, self.eval_rows)):
            pos = next((i for i, r in enumerate(rows or []) if r == row), None)
            if pos is not None:
                return f"{path}: row {pos + 1}"
        return f"{self.cfg.data.train_path}: a row carried over by dynamic sampling"

    def _responses(self, output_ids: list, texts: list[str | None]) -> list[str]:
        """The text the reward sees: what the rollout function gave, else the decoded response tokens."""
        todo = [i for i, t in enumerate(texts) if t is None]
        if not todo:
            return list(texts)
        with self._tokenizer_lock:
            decoded = self.tokenizer.batch_decode([output_ids[i] for i in todo], skip_special_tokens=True)
        out = list(texts)
        for i, text in zip(todo, decoded, strict=True):
            out[i] = text
        return out

    def _rewards(self, prompts: list[str], responses: list[str], labels: list, given: np.ndarray,
                 metas: list[dict], record: bool = True) -> list[float]:
        """The recipe's reward for every sample whose rollout function did not score it (NaN in `given`); `metas`:
        each sample's row's other columns. `record`: the sources' figures count in the step's reward metrics."""
        todo = np.flatnonzero(np.isnan(given)).tolist()
        out = given.astype(float).tolist()
        if todo:
            scored = self.rewards.score([prompts[i] for i in todo], [responses[i] for i in todo],
                                        [labels[i] for i in todo], [metas[i] for i in todo], record=record)
            for i, r in zip(todo, scored, strict=True):
                out[i] = r
        return out

    def _seed(self, step: int) -> int:
        return self.cfg.seed * 1_000_003 + step * 7919


def worker_target(path: str | Path, sub: str, storage: StorageConfig | None) -> tuple:
    """The arguments of a worker's save/load: a local folder, or a run store folder's URI and the storage
    settings the worker reaches it with (endpoint, credentials)."""
    target = f"{str(path).rstrip('/')}/{sub}" if sub else str(path)
    return (target,) if storage is None else (target, storage)


def save_tokenizer(tokenizer, path: str | Path, storage: StorageConfig | None) -> None:
    """The tokenizer's files into the checkpoint's model/ (uploaded when the checkpoint is in a run store)."""
    if storage is None:
        tokenizer.save_pretrained(Path(path) / "model")
        return
    store = RunStore.at(storage, str(path))
    with tempfile.TemporaryDirectory(prefix="rlflow-tokenizer-") as tmp:
        for f in tokenizer.save_pretrained(tmp):
            store.upload_file(f, "model", Path(f).name)


def _answers(url: str) -> bool:
    """Whether a rollout server answers /health now (the router may have seen a passing failure)."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False





