"""What one RL step has produced so far, and the steps in flight.

Every stage of engines/session/stages/ takes a step's `StepState`, reads the fields earlier stages filled and
fills its own. With asynchronous training (rollout.max_staleness) the rollouts of later steps run in other threads
while a step trains, so several steps are open at once: `StepsInFlight` keeps them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from rlflow.engines.core.batch import RolloutBatch


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


class StepsInFlight:
    """The states of the steps still open, by step: the rollout stage opens one, the later stages look it up."""

    def __init__(self):
        self._states: dict[int, StepState] = {}
        self._lock = threading.Lock()  # rollouts of steps ahead open theirs from other threads

    def open(self, st: StepState, drop_before: int) -> None:
        """Make `st` its step's state, and drop the finished steps before `drop_before`."""
        with self._lock:
            self._states[st.step] = st
            for old in [k for k in self._states if k < drop_before]:
                del self._states[old]

    def get(self, step: int) -> StepState:
        if step not in self._states:
            raise RuntimeError(f"step {step}: no rollout in flight (run the rollout stage first)")
        return self._states[step]
