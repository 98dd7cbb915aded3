"""The step's samples packed as the train workers take them, and forward passes over that batch, each worker on
its slice: the policy's (or its reference's) logprobs, the teacher's, the critic's values. The teacher, advantages
and train stages share them."""

from __future__ import annotations

import torch

from rlflow.engines.core.batch import TrainBatch, batch_size, select
from rlflow.engines.core.protocols import CriticBackend, TrainBackend, WorkerGroup
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.session.step_state import StepState


def pack(s: RunEngines, st: StepState, advantages: torch.Tensor) -> TrainBatch:
    """The step's samples as a TrainBatch with `advantages`. Samples whose rollout function gave no logprobs count
    as on-policy: their old logprobs are the train engine's (computed once a step)."""
    has_logprobs = st.batch.has_logprobs
    batch = st.batch.to_train_batch(s.tokenizer.pad_token_id, advantages)
    if not has_logprobs.all():  # a rollout function gave none: the samples count as on-policy
        if st.behaviour_logprobs is None:
            st.behaviour_logprobs = train_logprobs(s, batch)
        missing = torch.as_tensor(~has_logprobs)
        batch["old_logprobs"][missing] = (st.behaviour_logprobs * batch["loss_mask"])[missing]
    return batch


def train_logprobs(s: RunEngines, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
    """Per-token logprobs [N, L] of the train engine's policy (or reference), each worker on its slice."""
    s.gpu.for_training()
    return group_logprobs(s.train_group, batch, reference)


def group_logprobs(group: WorkerGroup[TrainBackend], batch: TrainBatch, reference: bool = False) -> torch.Tensor:
    """Per-token logprobs [N, L] of `group`'s model (the policy, its reference, or the distillation teacher),
    each worker on its slice (one call per worker)."""
    n = len(group)
    per = batch_size(batch) // n
    parts = [(select(batch, slice(w * per, (w + 1) * per)), reference) for w in range(n)]
    return torch.cat(group.call_each(TrainBackend.forward_logprobs, parts))


def critic_values(critic_group: WorkerGroup[CriticBackend], batch: TrainBatch) -> torch.Tensor:
    """The critic's values [N, L] of the batch, each critic worker on its slice (one call per worker)."""
    n = len(critic_group)
    per = batch_size(batch) // n
    return torch.cat(critic_group.call_each(
        CriticBackend.forward_values, [(select(batch, slice(w * per, (w + 1) * per)),) for w in range(n)]))
