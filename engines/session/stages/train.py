"""The train stage: the staleness check, the packed batch with what earlier stages left for the loss (train
logprobs, rollout correction, the teacher's scores), one train step per data-parallel shard, and the critic's
step on GAE's returns beside it (other actors)."""

from __future__ import annotations

import time

import numpy as np

from rlflow.engines.core.batch import (
    TEACHER_LOGPROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    TrainBatch,
    shard_for_workers,
)
from rlflow.engines.core.on_policy import check_on_policy
from rlflow.engines.core.protocols import CriticBackend, TrainBackend
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.session.stages.train_batch import pack
from rlflow.engines.session.step_state import StepState
from rlflow.engines.train.torch_backend import with_train_logprobs


def run(s: RunEngines, st: StepState) -> dict[str, float]:
    step, b = st.step, st.batch
    known = b.weight_version >= 0
    staleness = s.weight_version - np.where(known, b.weight_version, s.weight_version)
    # dynamic sampling's carried groups are older by design; samples without logprobs are trained on-policy
    checked = ~b.carried & b.has_logprobs
    fresh = staleness[checked]
    if fresh.size and fresh.max() > s.cfg.rollout.max_staleness:
        raise RuntimeError(
            f"step {step}: samples from weight version {b.weight_version.min()} are "
            f"{staleness.max()} updates behind the trainer (version {s.weight_version}); "
            f"rollout.max_staleness allows {s.cfg.rollout.max_staleness}"
        )
    s.gpu.for_training()  # colocated: the rollout engine releases its memory, the trainer onloads
    batch = pack(s, st, st.advantages)
    if st.train_logprobs is not None:
        batch = with_train_logprobs(batch, st.train_logprobs)
    if st.keep is not None:  # rejected tokens leave the loss mask (and every denominator)
        batch["loss_mask"] = batch["loss_mask"] * st.keep
    if st.is_weights is not None:
        batch["is_weights"] = st.is_weights
    if s.teacher_group is not None:
        if st.teacher_logprobs is None and st.teacher_topk is None:
            raise RuntimeError(f"step {step}: distill.teacher_path is set but the teacher stage has not scored "
                               "this step's samples (run it before train)")
        if st.teacher_topk is not None:
            batch[TEACHER_TOPK_IDS], batch[TEACHER_TOPK_LOGPROBS] = st.teacher_topk
        else:
            batch[TEACHER_LOGPROBS] = st.teacher_logprobs
    t0 = time.perf_counter()
    critic = _submit_critic_step(s, st, batch)  # the critic trains beside the policy (other actors)
    metrics = {"train/staleness_mean": float(staleness.mean()), "train/staleness_max": float(staleness.max())}
    if step >= s.cfg.critic.freeze_policy_steps or s.critic_group is None:
        if s.dp_ranks is None:  # ranks of one tensor/pipeline-parallel group train on the same shard
            s.dp_ranks = s.train_group.call(TrainBackend.data_parallel_rank)
        shards = shard_for_workers(batch, max(s.dp_ranks) + 1, s.cfg.train.mini_batches)
        results = s.train_group.call_each(TrainBackend.train_step, [(shards[r],) for r in s.dp_ranks])
        metrics["time/train_worker"] = results[0].pop("worker_s")
        metrics |= {f"train/{k}": v for k, v in results[0].items()}
        if s.cfg.rollout.true_on_policy:  # ratio exactly 1, or the step stops here (engines/core/on_policy.py)
            check_on_policy(step, metrics)
    if critic is not None:
        result = s.critic_group.wait(critic)[0]
        result.pop("value_mean")  # the values being trained; critic/values_mean is the ones GAE used
        metrics["time/critic_worker"] = result.pop("worker_s")
        metrics |= {f"critic/{k}": v for k, v in result.items()}
    tokens = float(batch["attention_mask"].sum())
    return metrics | s.gpu.take_metrics() | {"train/tokens_per_s": tokens / (time.perf_counter() - t0)}


def _submit_critic_step(s: RunEngines, st: StepState, batch: TrainBatch):
    """Start the critic's train step on the step's returns (handles for critic_group.wait), or None."""
    if s.critic_group is None:
        return None
    values = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}
    values |= {"returns": st.returns, "old_values": st.values}
    shards = shard_for_workers(values, len(s.critic_group), s.cfg.train.mini_batches)
    return s.critic_group.submit_each(CriticBackend.train_step, [(sh,) for sh in shards])
