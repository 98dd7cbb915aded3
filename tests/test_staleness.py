"""rollout.max_staleness: when each step's rollout starts (engines/session/schedule.py) and which prompts it
takes when the rollouts of several steps run at once (engines/session/prompt_source.py)."""

from __future__ import annotations

import pytest

from rlflow.engines.session.prompt_source import PromptSource
from rlflow.engines.session.schedule import RolloutSchedule


class _Loop:
    """The flow's order of calls, with rollouts that record when they start and when they are waited for."""

    def __init__(self, k: int, steps: int, lag: int = 0):
        self.events: list[tuple] = []
        self.version = 0  # on the rollout workers: the syncs so far
        self.k, self.steps, self.lag = k, steps, lag
        self.schedule = RolloutSchedule(k, steps - 1, self._run, self._submit, lambda: max(0, self.version - self.lag),
                                        chain=True)

    def _run(self, step: int) -> dict:
        self.events.append(("run", step, self.version))
        return {}

    def _submit(self, step: int, after):
        self.events.append(("start", step, self.version, after.step if after is not None else None))
        loop = self

        class Future:
            def __init__(self):
                self.step = step

            def result(self) -> dict:
                loop.events.append(("wait", step, loop.version))
                return {"step": float(step)}

        return Future()

    def play(self) -> list[dict]:
        out = []
        for step in range(self.steps):
            m = self.schedule.take(step)
            m |= self.schedule.before_sync(step)
            self.events.append(("sync", step))
            self.version = step + 1
            out.append(m)
        return out


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_rollout_starts_as_soon_as_the_bound_allows_and_never_earlier(k):
    loop = _Loop(k, steps=8)
    loop.play()
    started = {e[1]: e[2] for e in loop.events if e[0] in ("start", "run")}
    assert sorted(started) == list(range(8))  # every step's rollout ran once
    for step, version in started.items():
        assert version >= step - k  # the bound: weights of version step - k were on the workers
        assert version == (step if k == 0 else max(0, step - k))  # ... and not later than that (k > 0: ahead)
    if k == 0:
        assert all(e[0] != "start" for e in loop.events)  # synchronous: nothing runs beside training
    # dynamic sampling chains each rollout to the one before it, when that one is still pending
    assert all(e[3] in (None, e[1] - 1) for e in loop.events if e[0] == "start")


def test_one_step_off_syncs_after_the_rollout_in_flight_and_k2_syncs_under_it():
    one = _Loop(1, steps=4)
    history = one.play()
    for step in range(3):  # the wait for step + 1's rollout comes before step's sync, as rlflow always ran k = 1
        assert one.events.index(("wait", step + 1, step)) < one.events.index(("sync", step))
        assert "time/rollout_wait" in history[step]
    two = _Loop(2, steps=6)
    two.play()
    for step in range(1, 6):  # k = 2: a rollout is waited for only when its step begins, after the syncs before it
        wait = next(e for e in two.events if e[0] == "wait" and e[1] == step)
        assert wait[2] == step and two.events.index(wait) > two.events.index(("sync", step - 1))
        start = next(e for e in two.events if e[0] == "start" and e[1] == step)
        # ... so the syncs between its start and its end landed under it: it spans versions start .. step
        syncs_under = [s for s in range(step) if two.events.index(start) < two.events.index(("sync", s))]
        assert len(syncs_under) == step - start[2] and len(syncs_under) <= 2


def test_a_rollout_that_would_break_the_bound_is_refused():
    loop = _Loop(1, steps=4, lag=1)  # the workers are one version behind what the loop expects
    with pytest.raises(RuntimeError, match=r"step 2: its rollout would start with weight version 0 .*"
                                           r"max_staleness \(1\) needs version 1 or newer"):
        loop.play()


def test_a_steps_prompts_do_not_depend_on_the_order_steps_take_them():
    rows = [{"prompt": str(i), "label": i} for i in range(20)]
    inorder = PromptSource(rows, 3, seed=1, shuffle=True, tokenizer=None)
    expected = [inorder.take(step) for step in range(5)]
    ahead = PromptSource(rows, 3, seed=1, shuffle=True, tokenizer=None)
    got = {step: ahead.take(step) for step in (0, 2, 1, 4, 3)}  # rollouts ahead started in other threads
    assert [got[step] for step in range(5)] == expected
    assert ahead.take(2) == expected[2]  # a retried step takes the same prompts and does not move the cursor
    assert ahead.state_after(1) == inorder.state_after(1) and ahead.state_after(4) == inorder.state_after(4)
    resumed = PromptSource(rows, 3, seed=1, shuffle=True, tokenizer=None)  # from a checkpoint of step 1
    resumed.load_state(inorder.state_after(1))
    assert resumed.take(3) == expected[3] and resumed.take(2) == expected[2]


def test_dynamic_sampling_runs_two_steps_ahead_in_order(tmp_path, monkeypatch):
    """Dynamic sampling with max_staleness 2 in the bare loop (engines in this process, the real rollouts): the
    rollouts of steps s + 1 and s + 2 are handed to the loop's executor before step s trains, with version s on
    the workers; each carries prompts into the next, so each one starts only after the one before it ended; every
    step trains on samples within the bound (all but the carried ones, which are older by design: docs/rollout.md)."""
    from bench.e2e import bare_loop
    from rlflow.engines.core.config import config_from_dict
    from rlflow.engines.session.rl import RLSession
    from rlflow.engines.session.workers import prepare_data, prepare_model
    from tests.conftest import small_recipe

    cfg = config_from_dict(small_recipe(
        tmp_path, cluster={"use_ray": False}, train={"steps": 4, "threads": 1},
        rollout={"prompts_per_step": 8, "samples_per_prompt": 4, "max_staleness": 2,
                 "dynamic_sampling": {"enabled": True, "over_sample": 2.0}}))
    prepare_data(cfg)
    session = RLSession.create(cfg, prepare_model(cfg, tmp_path), use_ray=False)
    events: list[tuple] = []  # (what, step, the weight version on the rollout workers then)
    trained_versions: dict[int, list[int]] = {}  # each step's samples that were not carried: the versions they began

    def recorded(what: str, stage):
        def call(step: int) -> dict:
            events.append((what, step, session.weight_version))
            if what == "train":
                batch = session.rollout_batch(step)
                trained_versions[step] = batch.weight_version[~batch.carried].tolist()
            out = stage(step)
            events.append((f"{what} end", step, session.weight_version))
            return out
        return call

    class RecordingPool(bare_loop.ThreadPoolExecutor):  # the loop's real executor, its submissions recorded
        def submit(self, fn, step, *args):
            events.append(("submit", step, session.weight_version))
            return super().submit(fn, step, *args)

    session.rollout, session.train = recorded("rollout", session.rollout), recorded("train", session.train)
    monkeypatch.setattr(bare_loop, "ThreadPoolExecutor", RecordingPool)
    try:
        history = bare_loop.run_steps(session, cfg, log=lambda line: None)
    finally:
        session.shutdown()
    assert [m["step"] for m in history] == [0, 1, 2, 3]
    assert all(m["rollout/ds_prompts_started"] >= 8 for m in history)

    def where(kind: str) -> dict[int, int]:
        return {step: i for i, (what, step, _) in enumerate(events) if what == kind}

    submitted = {step: version for what, step, version in events if what == "submit"}
    assert submitted == {1: 0, 2: 0, 3: 1}  # two steps ahead: steps 1 and 2 with version 0, step 3 with version 1
    submits, trains, starts, ends = where("submit"), where("train"), where("rollout"), where("rollout end")
    assert all(submits[step] < trains[max(0, step - 2)] for step in (1, 2, 3))  # ... before step - 2 trains
    assert sorted(starts, key=starts.get) == [0, 1, 2, 3]
    assert all(ends[step - 1] < starts[step] for step in (1, 2, 3))  # chained: each after the one before it
    assert all(version >= step - 2 for what, step, version in events if what == "rollout")  # the bound, as it began
    assert all(versions and min(versions) >= step - 2 for step, versions in trained_versions.items())
    assert sorted(trained_versions) == [0, 1, 2, 3]
