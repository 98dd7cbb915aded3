"""Which prompts each step trains on, and the state a checkpoint needs to take the same ones again.

A step takes its prompts from the data cursor (a seeded permutation per epoch). With dynamic sampling it
also takes the groups the last step's rollout carried over, and takes as many more prompts as it needs;
its prompts then no longer follow from the cursor alone. The source remembers, for each step still in
flight, the cursor and carry right after that step took its prompts: with asynchronous training (up to
rollout.max_staleness steps ahead) later steps have already taken their own when a step is checkpointed, and
the resumed run must start after the checkpointed step, not after the ones in flight.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

from rlflow.engines.data.prompts import PromptCursor
from rlflow.engines.rollout.dynamic_sampling import Carry


class PromptSource:
    def __init__(self, rows: list[dict], prompts_per_step: int, seed: int, shuffle: bool, tokenizer,
                 image_bytes: Callable[[str], bytes] | None = None):
        self.rows = rows
        self.cursor = PromptCursor(len(rows), prompts_per_step, seed, shuffle)
        self._tokenizer = tokenizer  # rollout functions' tokenizer, which carried samples hold
        self._image_bytes = image_bytes  # a carried image's bytes by digest (the run store), for VL prompts
        self._carry: list[Carry] = []  # groups the last step's rollout carries into the next
        self._taken: dict[int, list[dict]] = {}  # the rows of the fixed-size steps in flight
        self._next: int | None = None  # the step the cursor is at (the first take sets it)
        self._lock = threading.Lock()  # rollouts of several steps ahead take their prompts from other threads
        self._dynamic_begin: tuple[int, dict, list[dict]] | None = None  # cursor and carry before a dynamic rollout
        self._cursor_after: dict[int, dict] = {}
        self._carry_after: dict[int, list[dict]] = {}

    # ---- fixed-size steps ----------------------------------------------------------------------------
    def take(self, step: int) -> list[dict]:
        """The step's prompts_per_step rows, the same whatever order steps ask in (the rollouts of steps ahead
        run in their own threads): the cursor moves through the steps before it first. Asking again for the
        same step (a retried task) does not move the cursor."""
        with self._lock:
            if self._next is None or (step not in self._taken and step < self._next):
                self._next = step  # the first step of this session (or of a resumed run, after load_state)
            while self._next <= step:
                self._taken[self._next] = [self.rows[i] for i in self.cursor.next_batch()]
                self._cursor_after[self._next] = self.cursor.state_dict()
                self._next += 1
            return self._taken[step]

    # ---- dynamic sampling ----------------------------------------------------------------------------
    def begin_dynamic(self, step: int) -> list[Carry]:
        """Start (or restart, for a retried task) the step's dynamic rollout: the carry it starts from.
        A retry starts again from the same cursor and carry."""
        if self._dynamic_begin is None or self._dynamic_begin[0] != step:
            self._dynamic_begin = (step, self.cursor.state_dict(), [c.to_json() for c in self._carry])
        else:
            self.cursor.load_state_dict(self._dynamic_begin[1])
        return [Carry.from_json(c, self._tokenizer, self._image_bytes) for c in self._dynamic_begin[2]]

    def next_rows(self, k: int) -> list[dict]:
        """k more rows for a dynamic rollout in progress."""
        return [self.rows[i] for i in self.cursor.next_batch(k)]

    def end_dynamic(self, step: int, carry: list[Carry]) -> None:
        """The dynamic rollout of `step` is done and leaves `carry` for the next step."""
        self._carry = carry
        self._cursor_after[step] = self.cursor.state_dict()
        self._carry_after[step] = [c.to_json() for c in carry]

    def batch_metadata(self, step: int) -> dict[str, str]:
        """The state stored with a dynamic step's batch: its prompts do not follow from the cursor, so a replay
        needs both."""
        return {"rlflow.cursor": json.dumps(self._cursor_after[step]),
                "rlflow.carry": json.dumps(self._carry_after[step])}

    def restore_dynamic(self, step: int, metadata: dict[str, str]) -> None:
        """Take a stored dynamic batch as the step's: the cursor and carry move to where it left them."""
        if "rlflow.cursor" not in metadata:
            raise RuntimeError(f"step {step}: the stored rollout batch has no dynamic-sampling cursor")
        self.cursor.load_state_dict(json.loads(metadata["rlflow.cursor"]))
        self._cursor_after[step] = self.cursor.state_dict()
        self._carry_after[step] = json.loads(metadata["rlflow.carry"])
        self._carry = [Carry.from_json(c, self._tokenizer, self._image_bytes) for c in self._carry_after[step]]

    # ---- checkpoints ---------------------------------------------------------------------------------
    def state_after(self, step: int) -> dict:
        """What a checkpoint of `step` saves: the cursor and carry right after that step took its prompts."""
        return {"cursor": self._cursor_after[step], "carry": self._carry_after.get(step, []), "next_step": step + 1}

    def load_state(self, state: dict) -> None:
        self.cursor.load_state_dict(state["cursor"])
        self._taken, self._next = {}, state.get("next_step")  # checkpoints before it: the first take says
        self._carry = [Carry.from_json(c, self._tokenizer, self._image_bytes) for c in state.get("carry", [])]

    def forget_before(self, step: int) -> None:
        """Steps before `step` are finished: their state is no longer needed."""
        for old in [k for k in self._cursor_after if k < step]:
            del self._cursor_after[old]
        for old in [k for k in self._carry_after if k < step]:
            del self._carry_after[old]
        with self._lock:
            for old in [k for k in self._taken if k < step]:
                del self._taken[old]
