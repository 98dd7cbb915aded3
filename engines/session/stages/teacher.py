"""The teacher stage (on-policy distillation, distill.teacher_path): the frozen teacher scores the step's sampled
tokens, beside the reference pass of the advantages stage, for the train stage's distillation term."""

from __future__ import annotations

import torch

from rlflow.engines.core import algorithms
from rlflow.engines.core.batch import TrainBatch, batch_size, select
from rlflow.engines.core.protocols import TeacherBackend
from rlflow.engines.session.run_engines import RunEngines
from rlflow.engines.session.stages.train_batch import group_logprobs, pack
from rlflow.engines.session.step_state import StepState


def run(s: RunEngines, st: StepState) -> dict[str, float]:
    """The teacher's per-token logprobs of the step's sampled tokens (or its top k, for distill.loss forward_kl /
    jsd), kept in the step's state.

    distill/kl is the mean over the trained tokens of log p - log q at the policy that sampled them: the k1
    estimate of the per-token reverse KL(student || teacher), which falls as the student learns."""
    if s.teacher_group is None:
        return {}
    batch = pack(s, st, torch.zeros(len(st.batch)))
    if s.cfg.distill.uses_top_k:
        return _teacher_topk(s, st, batch)
    st.teacher_logprobs = group_logprobs(s.teacher_group, batch)
    mask, student = batch["loss_mask"], batch["old_logprobs"]
    return {
        "distill/kl": float(algorithms.masked_mean(student - st.teacher_logprobs, mask)),
        "distill/teacher_logprob_mean": float(algorithms.masked_mean(st.teacher_logprobs, mask)),
        "distill/student_logprob_mean": float(algorithms.masked_mean(student, mask)),
    }


def _teacher_topk(s: RunEngines, st: StepState, batch: TrainBatch) -> dict[str, float]:
    """distill.loss forward_kl / jsd: the teacher's top_k tokens at each position, each worker on its slice.
    distill/teacher_topk_mass: how much of the teacher's distribution the k cover; distill/sampled_in_topk:
    the share of the student's sampled tokens among them (rises as the student learns)."""
    n, k = len(s.teacher_group), s.cfg.distill.top_k
    per = batch_size(batch) // n
    parts = s.teacher_group.call_each(TeacherBackend.forward_topk,
                                      [(select(batch, slice(w * per, (w + 1) * per)), k) for w in range(n)])
    ids, logprobs = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    st.teacher_topk = (ids, logprobs)
    mask = batch["loss_mask"]
    sampled = (ids == batch["input_ids"][..., None]).any(-1).float()
    return {"distill/teacher_topk_mass": float(algorithms.masked_mean(logprobs.exp().sum(-1), mask)),
            "distill/sampled_in_topk": float(algorithms.masked_mean(sampled, mask))}
