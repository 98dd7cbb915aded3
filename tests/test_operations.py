"""The operations rules that need no services: work pools read from prefect.yaml, the count of automatic resumes,
a finished run started again, the reward's view of a response, the per-step log line (issue 47)."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml
from prefect.client.schemas.objects import StateType
from prefect.exceptions import PrefectHTTPStatusError

from rlflow.engines.core.config import RecipeError
from rlflow.engines.models.hf import build_char_tokenizer, decode_responses
from rlflow.flows.auto_resume import automations, heartbeat_lost_s, heartbeat_s
from rlflow.flows.pools import PoolSpec, _patient, parse_limits, project_pools
from rlflow.flows.project import ProjectError
from rlflow.tasks.attempts import AUTO_RESUME_MESSAGE, automatic_attempts
from rlflow.tasks.run_context import NothingToResume, RunAlreadyFinished, refuse_finished_run
from rlflow.tasks.run_logs import step_summary
from tests.conftest import small_recipe

REPO_PREFECT_FILE = Path(__file__).resolve().parent.parent / "deployments" / "prefect.yaml"


def test_the_shipped_pools_queue_training_and_never_the_pipeline():
    """The init's prefect.yaml: training and evaluation share one pool that runs one at a time, with an urgent queue
    ahead of the default one; the pipeline, which waits for its own training run, is on a pool without a limit."""
    assert project_pools(REPO_PREFECT_FILE) == [
        PoolSpec("rlflow-process", 1, {"urgent": 1, "default": 10}), PoolSpec("rlflow-control", None, {})]
    deployments = yaml.safe_load(REPO_PREFECT_FILE.read_text())["deployments"]
    assert {d["name"]: d["work_pool"]["name"] for d in deployments} == {
        "post-train": "rlflow-process", "evaluate": "rlflow-process", "pipeline": "rlflow-control"}
    assert project_pools(REPO_PREFECT_FILE, parse_limits(["rlflow-process=3"]))[0].concurrency_limit == 3


def test_pool_settings_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "prefect.yaml"
    for pools, needle in [({"p": {"limit": 1}}, "definitions.pools.p: unknown key(s) ['limit']"),
                          ({"p": {"concurrency_limit": -1}}, "definitions.pools.p.concurrency_limit"),
                          ({"p": {"queues": {"q": 0}}}, "definitions.pools.p.queues")]:
        path.write_text(yaml.safe_dump({"definitions": {"pools": pools},
                                        "deployments": [{"name": "d", "work_pool": {"name": "p"}}]}))
        with pytest.raises(ProjectError) as e:
            project_pools(path)
        assert str(path) in str(e.value) and needle in str(e.value), e.value
    with pytest.raises(ProjectError, match="no deployment of .* uses pool 'gpu'"):
        project_pools(REPO_PREFECT_FILE, {"gpu": 1})
    with pytest.raises(ProjectError, match="expected NAME=N"):
        parse_limits(["rlflow-process"])
    assert project_pools(tmp_path / "missing.yaml", default="rlflow-process") == [PoolSpec("rlflow-process")]


def _state(name: str, message: str | None = None) -> SimpleNamespace:
    kinds = {"Running": StateType.RUNNING, "Crashed": StateType.CRASHED, "AwaitingRetry": StateType.SCHEDULED,
             "Pending": StateType.PENDING, "Failed": StateType.FAILED}
    return SimpleNamespace(name=name, type=kinds[name], message=message)


def test_automatic_resumes_count_attempts_not_reschedules():
    """An attempt counts when the latest reschedule before it is the automation's: one Crashed event that made the
    automation fire four times (seen with Prefect 3.8.8) is one attempt; a human's Retry is none."""
    auto = _state("AwaitingRetry", AUTO_RESUME_MESSAGE)
    history = [_state("Pending"), _state("Running"), _state("Crashed"), auto, auto, auto, auto, _state("Pending"),
               _state("Running")]
    assert automatic_attempts(history) == 1
    human = _state("AwaitingRetry", "Retry from the UI")
    assert automatic_attempts([*history, _state("Failed"), human, _state("Running")]) == 1
    assert automatic_attempts([*history, _state("Crashed"), auto, _state("Running")]) == 2


def test_a_finished_run_started_again_says_how_to_go_on(tmp_path):
    from rlflow.engines.core.config import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(small_recipe(tmp_path, name="done", train={"steps": 3})))
    cfg = load_recipe(path)
    refuse_finished_run(cfg, 2, "running", ("train.steps", 3))  # steps left: goes on
    refuse_finished_run(cfg, 3, "failed", ("train.steps", 3))  # all committed, never closed: a retry closes it
    with pytest.raises(RunAlreadyFinished) as e:
        refuse_finished_run(cfg, 100, "finished", ("train.steps", 3))
    assert isinstance(e.value, RecipeError)
    [problem] = e.value.problems
    assert problem.startswith("train.steps: 3, but the run already finished step 99")
    assert "--set name=done-2" in problem and "--set train.steps=200" in problem
    # rescheduled by the auto-resume automation after it finished (a late crash report of a hung attempt that was
    # killed after another attempt finished the run): nothing to resume, the flow ends Completed, not Failed
    with pytest.raises(NothingToResume, match="'done' already finished its 100 steps: nothing to resume"):
        refuse_finished_run(cfg, 100, "finished", ("train.steps", 3), automatic=True)
    refuse_finished_run(cfg, 2, "running", ("train.steps", 3), automatic=True)  # steps left: resumes


def test_the_reward_sees_special_tokens_but_the_final_stop_token():
    """What a user of the model gets: a response cut at the budget with `<unk>` in place of EOS is no answer (the
    demo learned to emit it, the reward stripped it, and `predict` went on past the answer); the EOS that ends a
    finished response is left out."""
    tok = build_char_tokenizer()
    ids = tok("1248", add_special_tokens=False)["input_ids"]
    texts = decode_responses(tok, [ids + [tok.unk_token_id], ids + [tok.eos_token_id], ids[:2] + [tok.bos_token_id]
                                   + ids[2:]], [False, True, False])
    assert texts == ["1248<unk>", "1248", "12<bos>48"]


def test_the_step_line_counts_steps_as_the_tasks_do():
    assert step_summary(4, 5, {"rollout/reward_mean": 0.5}) == "step 4 (5 of 5): reward 0.500"


def test_a_new_attempt_marks_what_earlier_attempts_left_running_crashed():
    """A killed flow process leaves its task run (and, resumed under a new flow run, its flow run) Running forever
    on the timeline; the attempt that takes the run over marks them Crashed, and leaves finished ones alone. Against
    a real Prefect server (the temporary one flows in tests use)."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Running

    from rlflow.tasks.attempts import close_earlier_attempts

    @flow(name="killed-attempt")
    def killed() -> None: ...

    @task(name="train")
    def train() -> None: ...

    with get_client(sync_client=True) as client:
        earlier = client.create_flow_run(killed, state=Running())
        stuck = client.create_task_run(train, earlier.id, dynamic_key="2", name="train-2", state=Running())
        done = client.create_task_run(train, earlier.id, dynamic_key="1", name="train-1", state=Completed())
        current = client.create_flow_run(killed, state=Running())
        left = client.create_task_run(train, current.id, dynamic_key="0", name="train-0", state=Running())
        assert close_earlier_attempts(str(current.id), [str(earlier.id)]) == {"task_runs": 2, "flow_runs": 1}
        assert client.read_task_run(stuck.id).state.is_crashed() and client.read_task_run(left.id).state.is_crashed()
        assert client.read_task_run(done.id).state.is_completed()
        assert client.read_flow_run(earlier.id).state.is_crashed()
        assert client.read_flow_run(current.id).state.is_running()  # the attempt itself goes on


def test_the_heartbeat_automation_waits_for_two_beats_at_least(monkeypatch):
    """RLFLOW_HEARTBEAT_LOST_S sets when a silent run is called lost; serve's workers beat five times in it, but never
    more often than Prefect allows (every 30 s), so a value under two beats is refused, naming the variable."""
    monkeypatch.delenv("RLFLOW_HEARTBEAT_LOST_S", raising=False)
    assert (heartbeat_lost_s(), heartbeat_s()) == (150, 30)
    for value, beat in (("75", 30), ("300", 60)):
        monkeypatch.setenv("RLFLOW_HEARTBEAT_LOST_S", value)
        assert (heartbeat_lost_s(), heartbeat_s()) == (int(value), beat)
    lost = automations("post-train/post-train", uuid.uuid4())[2]
    assert lost.trigger.within.total_seconds() == 300 and "no heartbeat for 300 s" in lost.actions[0].message
    for bad in ("20", "1.5m", "-1"):
        monkeypatch.setenv("RLFLOW_HEARTBEAT_LOST_S", bad)
        with pytest.raises(ValueError, match=f"RLFLOW_HEARTBEAT_LOST_S={bad!r}: expected a whole number of seconds, "
                                             "at least 60"):
            heartbeat_lost_s()


def test_a_stopping_serve_asks_a_busy_prefect_server_again():
    """A Prefect server on SQLite under load answers 503 for seconds ("database is locked"): the calls a stopping
    serve makes (pause, list, cancel, mark crashed) are asked again for up to a bound; a 4xx is an answer."""
    def failing(status: int, times: int):
        calls = []

        def call():
            calls.append(1)
            if len(calls) <= times:
                request = httpx.Request("PATCH", "http://prefect/api/work_pools/p")
                raise PrefectHTTPStatusError.from_httpx_error(httpx.HTTPStatusError(
                    "busy", request=request, response=httpx.Response(status, request=request)))
            return "done"
        return call, calls

    call, calls = failing(503, 2)
    assert _patient(call, within_s=10) == "done" and len(calls) == 3
    call, calls = failing(404, 1)
    with pytest.raises(PrefectHTTPStatusError):
        _patient(call, within_s=10)
    assert len(calls) == 1
    call, calls = failing(503, 100)
    with pytest.raises(PrefectHTTPStatusError):
        _patient(call, within_s=1.2)
    assert 2 <= len(calls) <= 4
