"""A user's project directory: `rlflow init` writes it, `rlflow serve` (a subprocess, on free ports) deploys it and
runs its flows there; the post-train deployment's run form, driven in Chromium, opens with the recipe and a run
started from it uses the recipe plus the one field changed; SIGTERM on `rlflow serve` stops every service it started,
and so do their guards when it is SIGKILLed (that test starts a `rlflow serve --no-deploy` of its own).

One `rlflow serve` serves the module (a Prefect server, an MLflow server, a deploy and a worker take most of a
minute to start on a loaded 2-core machine); the SIGTERM test stops it, so it comes last. Its pool takes one
run at a time (the init's prefect.yaml), so the module's runs queue behind each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.config import EvaluationConfig, PipelineConfig, RLConfig, load_recipe, public_tree
from tests.browser import CHROMIUM, browser_page, need_chromium, screenshot
from tests.test_deployments import wait_final

RECIPES = {
    "post-train/post-train": ("deployments/sort-tiny.yaml", RLConfig),
    "evaluate/evaluate": ("deployments/eval-sort-tiny.yaml", EvaluationConfig),
    "pipeline/pipeline": ("deployments/pipeline-sort-tiny.yaml", PipelineConfig),
}


def rlflow(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`rlflow ARGS` as a user types it (the environment's script)."""
    script = Path(sys.executable).with_name("rlflow")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "rlflow.flows.cli"]
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_init_writes_a_project_and_never_overwrites(tmp_path):
    done = rlflow("init", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert written == {"prefect.yaml", *(recipe for recipe, _ in RECIPES.values())}
    for recipe, model in RECIPES.values():
        load_recipe(tmp_path / recipe, model=model)  # each is a valid recipe of its flow
    deployments = yaml.safe_load((tmp_path / "prefect.yaml").read_text())["deployments"]
    assert [d["entrypoint"] for d in deployments] == [
        "rlflow.flows.post_train:post_train",
        "rlflow.flows.evaluate:evaluate",
        "rlflow.flows.pipeline:pipeline",
    ]

    (tmp_path / "prefect.yaml").write_text("# mine\n")
    (tmp_path / "deployments/eval-sort-tiny.yaml").unlink()
    again = rlflow("init", cwd=tmp_path)
    assert again.returncode == 2 and "not overwriting" in again.stderr and "prefect.yaml" in again.stderr, again.stderr
    assert (tmp_path / "prefect.yaml").read_text() == "# mine\n"
    assert not (tmp_path / "deployments/eval-sort-tiny.yaml").exists()  # nothing written when it refuses


def test_serve_without_a_project_says_to_init(tmp_path):
    done = rlflow("serve", "--prefect-port", str(free_port()), "--mlflow-port", str(free_port()), cwd=tmp_path)
    assert done.returncode == 2 and "rlflow init" in done.stderr and str(tmp_path) in done.stderr, done.stderr


def tiny_train_recipe(project: Path, mlflow_uri: str) -> None:
    """The init's post-train recipe cut to a two-step run of a one-layer model, tracked in serve's MLflow."""
    path = project / "deployments/sort-tiny.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["model"] |= {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1}
    raw["data"] |= {"eval_path": None, "generate": {"task": "sort", "num_digits": 4, "num_train": 200}}
    raw["rollout"] |= {"prompts_per_step": 4, "samples_per_prompt": 2}
    raw["train"] |= {"steps": 2, "mini_batches": 1, "epochs": 1, "threads": 1}
    raw |= {"name": "form-run", "cluster": {"use_ray": False}, "tracking": {"uri": mlflow_uri}}
    path.write_text(yaml.safe_dump(raw))


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a container's PID 1 may never reap an orphan)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_serve(project: Path, prefect_port: int, mlflow_port: int, *flags: str,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """`rlflow serve` in `project` (its output in serve.log there), once it says every service is up; `env`: more
    environment for it."""
    env = os.environ | {
        "PREFECT_HOME": str(project / ".prefect"),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PYTHONUNBUFFERED": "1",
    } | (env or {})
    env.pop("PREFECT_API_URL", None)
    log = project / "serve.log"
    script = Path(sys.executable).with_name("rlflow")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "rlflow.flows.cli"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*cmd, "serve", "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port), *flags],
            cwd=project,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while "Ctrl-C stops all" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"rlflow serve did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    return proc


def wait_gone(pids: set[int], ports: tuple[int, ...], timeout: float) -> dict[int, bytes]:
    """Wait up to `timeout` s for the processes to end and the ports to close; the command lines of those left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and ([p for p in pids if alive(p)] or any(map(port_open, ports))):
        time.sleep(0.2)
    return {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for pid in pids if alive(pid)}


def test_sigkill_on_serve_leaves_no_service_behind(tmp_path):
    """`rlflow serve` SIGKILLed runs no handler: each service's guard stops it, so within the services' stop grace
    (20 s, then SIGKILL) and a margin every process serve started is gone, guards included, and the ports are free.
    Before, 12 processes lived on, holding their ports."""
    ports = (free_port(), free_port())
    proc = start_serve(tmp_path, *ports, "--no-deploy")
    tree = descendants(proc.pid)
    try:
        assert len(tree) >= 6 and all(map(port_open, ports)), tree  # 3 services (and their children), 3 guards
        proc.kill()
        proc.wait()
        left = wait_gone(tree, ports, timeout=60)
        assert not left, f"still running after rlflow serve was SIGKILLed: {left}"
        assert not [p for p in ports if port_open(p)], "a service port is still open"
    finally:
        for pid in tree | descendants(proc.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# A lost machine is declared after 75 s without a flow heartbeat (not 150; serve's workers beat every 30 s, Prefect's
# least), and a run's lease goes stale after 120 s without its heartbeat (not 300): the heartbeat test's times.
SERVED_ENV = {"RLFLOW_HEARTBEAT_LOST_S": "75", "RLFLOW_LEASE_TIMEOUT_S": "120"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`rlflow init` + `rlflow serve` in a fresh project directory, the way a user starts them."""
    project = tmp_path_factory.mktemp("project")
    assert rlflow("init", cwd=project).returncode == 0
    prefect_port, mlflow_port = free_port(), free_port()
    mlflow_uri = f"http://127.0.0.1:{mlflow_port}"
    tiny_train_recipe(project, mlflow_uri)
    proc = start_serve(project, prefect_port, mlflow_port, env=SERVED_ENV)
    log = project / "serve.log"
    tree = descendants(proc.pid)
    yield {
        "proc": proc,
        "project": project,
        "api": f"http://127.0.0.1:{prefect_port}/api",
        "ui": f"http://127.0.0.1:{prefect_port}",
        "ports": (prefect_port, mlflow_port),
        "log": log,
    }
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    for pid in tree | descendants(proc.pid):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_init_project_deploys_with_each_recipe_as_the_default_config(served, monkeypatch):
    """`prefect deploy` (run by serve) accepts the init's prefect.yaml from a directory that is not the checkout,
    and each deployment's default `config` is its recipe, the run form's prefill, tracked in serve's MLflow where
    the recipe names no tracking.uri. The pipeline's deployment is on the pool without a limit, so it never waits
    behind the runs it starts; the automations of auto-resume watch the post-train deployment."""
    from prefect.client.orchestration import SyncPrefectClient

    monkeypatch.setenv("RLFLOW_TRACKING_URI", f"http://127.0.0.1:{served['ports'][1]}")

    with SyncPrefectClient(served["api"]) as client:
        for name, (recipe, model) in RECIPES.items():
            d = client.read_deployment_by_name(name)
            assert d.parameters["recipe"] == recipe and not d.enforce_parameter_schema
            assert d.parameters["config"] == public_tree(load_recipe(served["project"] / recipe, model=model)), name
            assert d.entrypoint.startswith("rlflow.flows.")
            assert d.work_pool_name == ("rlflow-control" if name.startswith("pipeline") else "rlflow-process")
        assert client.read_work_pool("rlflow-process").concurrency_limit == 1
        assert client.read_work_pool("rlflow-control").concurrency_limit is None
        assert {q.name: q.priority for q in client.read_work_queues("rlflow-process")} == {"urgent": 1, "default": 10}
        names = {a.name for a in client.read_automations()}
        assert {f"rlflow auto-resume post-train/post-train: {kind}" for kind in ("process killed", "crashed",
                                                                                   "heartbeat lost")} <= names


def form_field(scope, *labels: str):
    """The run form's field under the nested labels (e.g. "Train", "Steps"): each a property of the one before."""
    for label in labels:
        scope = scope.locator(
            f"xpath=.//span[@class='schema-form-property__label' and normalize-space()='{label} (Optional)']"
            "/ancestor::div[contains(concat(' ', @class, ' '), ' schema-form-property ')][1]"
        ).first
    return scope


def drive_run_form(ui: str, deployment_id: str, created: Callable[[], bool]) -> None:
    """Open the deployment's Custom run form, check it shows the recipe, set train.steps 2 -> 1 and submit, until
    `created()` says the flow run exists. Under a full CI's load a Submit click was at times followed by no run
    (the page showed nothing 150 s later): while no run exists and the form is idle again (its request failed or
    never went), Submit is clicked again, so the form's run is never made twice; what the page said and the
    server answered is in the failure."""
    from playwright.sync_api import expect

    seen: list[str] = []  # console errors, create_flow_run answers, toasts: what the failure reports
    with browser_page(height=1200) as page:
        page.on("console", lambda m: m.type == "error" and seen.append(f"console: {m.text[:300]}"))
        page.on("requestfailed", lambda r: seen.append(f"failed: {r.method} {r.url} {r.failure}"))
        page.on("response", lambda r: "create_flow_run" in r.url and seen.append(f"{r.status} {r.url}"))
        page.goto(f"{ui}/deployments/deployment/{deployment_id}/run", timeout=60_000)
        steps = form_field(page, "Train", "Steps").locator("input")
        expect(steps).to_have_value("2", timeout=60_000)  # the recipe's, not RLConfig's default (100)
        expect(form_field(page, "Name").locator("textarea, input").first).to_have_value("form-run")
        expect(form_field(page, "Model", "Hidden Size").locator("input")).to_have_value("32")
        expect(form_field(page, "Rollout", "Prompts Per Step").locator("input")).to_have_value("4")
        screenshot(page, "prefect-run-form.png")
        steps.fill("1")
        expect(steps).to_have_value("1")
        submit = page.get_by_role("button", name="Submit")
        expect(submit).to_be_enabled(timeout=60_000)
        submit.click()
        clicked, deadline = time.monotonic(), time.monotonic() + 240
        toasts = page.locator("[role=alert], .p-toast, .p-message, .schema-form-property__errors")
        while not created():
            seen.extend(t for t in toasts.all_inner_texts() if t and t not in seen)
            if time.monotonic() > deadline:
                raise AssertionError(f"the form did not submit; the page and the server said {seen}")
            if time.monotonic() - clicked > 30 and page.url.endswith("/run") and submit.is_enabled():
                seen.append(f"Submit clicked again at {time.monotonic() - clicked:.0f} s")
                submit.click()  # the last click made no run and the form is idle: once more
                clicked = time.monotonic()
            page.wait_for_timeout(500)


def test_run_form_opens_with_the_recipe_and_runs_it_with_one_change(served):
    """Chromium on the post-train deployment's Custom run: the form shows the recipe's values; train.steps 2 -> 1 is
    submitted; the run's stored config is the recipe with that one change."""
    need_chromium()
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import DeploymentFilter

    project = served["project"]
    with SyncPrefectClient(served["api"]) as client:
        deployment = client.read_deployment_by_name("post-train/post-train")
        by_deployment = DeploymentFilter(id={"any_": [deployment.id]})
        drive_run_form(served["ui"], str(deployment.id),
                       created=lambda: bool(client.read_flow_runs(deployment_filter=by_deployment)))
        runs = client.read_flow_runs(deployment_filter=by_deployment)
        assert len(runs) == 1, runs  # the form's
        run = wait_final(client, runs[0].id, timeout=240)
    assert run.state.is_completed(), (run.state, (project / ".rlflow-serve/worker.log").read_text()[-3000:])
    assert run.parameters["recipe"] == "deployments/sort-tiny.yaml" and run.parameters["config"]["train"]["steps"] == 1
    stored = json.loads((project / "runs/form-run/config.json").read_text())
    assert stored == public_tree(load_recipe(project / "deployments/sort-tiny.yaml", ["train.steps=1"]))
    assert (project / "runs/form-run/checkpoints/0/COMMITTED").is_file()  # one step, the last one, checkpointed


TINY_RUN = {"train": {"steps": 6}, "checkpoint": {"every": 2}}  # over the served recipe (tiny_train_recipe)


def start_run(api: str, name: str, **changes) -> str:
    """A post-train run of the served deployment (its tiny recipe, TINY_RUN and `changes` deep-merged over it, as
    the flow merges a deployment's `config`), not waited for."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    config = TINY_RUN | {"name": name} | changes
    with temporary_settings({PREFECT_API_URL: api}):
        return str(run_deployment("post-train/post-train", parameters={"config": config}, timeout=0).id)


def committed_steps(store: Path) -> list[int]:
    """The steps of the run's committed checkpoints (retention prunes the older ones)."""
    return sorted(int(c.parent.name) for c in (store / "checkpoints").glob("*/COMMITTED"))


def wait_committed(client, run_id: str, store: Path, step: int = 1, timeout: float = 240) -> int:
    """Wait for a checkpoint of `step` or later to be committed in `store` (a fast run's checkpoint `step` may be
    pruned within half a second); the pid of its flow process."""
    deadline = time.monotonic() + timeout
    while not any(s >= step for s in committed_steps(store)):
        assert time.monotonic() < deadline, client.read_flow_run(run_id).state
        time.sleep(0.5)
    return int(client.read_flow_run(run_id).infrastructure_pid)


def mlflow_metrics(uri: str, run_name: str) -> dict:
    """{key: {step: value}} of the MLflow run `run_name`, timings and rates left out (they differ between any two
    runs; tests/test_resume.py leaves out the same)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("rlflow").experiment_id],
                               f"attributes.run_name = '{run_name}'")
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            for key in run.data.metrics if not key.startswith("time/") and "_per_s" not in key}


def flow_run_state_badge(page):
    return page.locator(".page-heading-flow-run__meta .state-badge")


def ui_shows_the_run_queued(page, ui: str, queued: str) -> None:
    """The Prefect UI while the pool's one slot is taken: the queued run's page (opened as the runs were submitted,
    so that a slow page load cannot outlast the first run) shows it waiting, Scheduled (Late once its start time
    has passed). With RLFLOW_SCREENSHOTS set, the pool's page is saved too: the queued run under the running one."""
    from playwright.sync_api import expect

    expect(flow_run_state_badge(page)).to_have_text(re.compile("Scheduled|Late"), timeout=30_000)
    screenshot(page, "ui-queued-run.png")
    if os.environ.get("RLFLOW_SCREENSHOTS"):
        page.goto(f"{ui}/work-pools/work-pool/rlflow-process", timeout=60_000)
        expect(page.locator(f".state-list-item a[href='/runs/flow-run/{queued}']")).to_be_visible(timeout=30_000)
        screenshot(page, "ui-pool-one-slot.png")


def ui_shows_the_auto_resumed_attempt(ui: str, run_id: str, name: str, from_step: int) -> None:
    """The Prefect UI on a run the automation resumed: Completed, the automation named in its heading, Run Count 2
    (Details), and its Logs tab has both attempts' lines, the second saying it is auto-resume 1 and which committed
    step it resumed from."""
    from playwright.sync_api import expect

    with browser_page(height=1100) as page:
        page.goto(f"{ui}/runs/flow-run/{run_id}", timeout=60_000)
        expect(flow_run_state_badge(page)).to_have_text("Completed", timeout=30_000)
        expect(page.get_by_text("rlflow auto-resume post-train/post-train: process killed")).to_be_visible()
        resumed = page.locator(".log-row__content", has_text=f"resuming run {name} from committed step {from_step}")
        rows = page.locator(".log-row__content")
        expect(rows.first).to_be_visible(timeout=30_000)
        rows.first.hover()  # the wheel scrolls the list under the pointer
        deadline, step = time.monotonic() + 90, 400
        while not resumed.count() and time.monotonic() < deadline:  # the log list renders what is scrolled to:
            at = rows.last.inner_text() if rows.count() else ""  # down to its end, then back up, and again
            page.mouse.wheel(0, step)
            page.wait_for_timeout(300)
            if rows.count() and rows.last.inner_text() == at:
                step = -step
        assert resumed.count(), "the resumed attempt's line is not in the run's Logs; rendered rows: " + " | ".join(
            rows.all_inner_texts())[-2000:]
        resumed.scroll_into_view_if_needed(timeout=30_000)
        expect(page.locator(".log-row__content", has_text=f"run {name}: auto-resume 1 of ")).to_be_visible()
        screenshot(page, "ui-auto-resumed-run.png")
        page.get_by_text("Details", exact=True).click()
        expect(page.locator(".p-key-value", has_text="Run Count")).to_contain_text("2", timeout=30_000)


def test_a_full_pool_queues_a_run_and_a_killed_run_resumes_on_its_own(served):
    """The init's pool `rlflow-process` takes one run at a time (prefect.yaml's definitions.pools): of two runs
    submitted together, the second waits Scheduled until the first ends. Its flow process is then SIGKILLed (a
    preempted machine) after its first checkpoint: the auto-resume automation reschedules the same flow run, which
    resumes from the checkpoint with no one in the loop and ends with the uninterrupted first run's metrics, in its
    own MLflow run, which lists both attempts; no task run of the killed attempt is left Running (tests/
    test_operations.py checks that the attempt marks a stuck one Crashed). In Chromium, the Prefect UI shows the
    queued run waiting while the first holds the slot, and the resumed run Completed with Run Count 2 and the
    auto-resume in its logs (where no chromium binary is installed those two checks are left out)."""
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter

    project, mlflow_uri = served["project"], f"http://127.0.0.1:{served['ports'][1]}"
    waited = killed = False
    # 20 steps, not TINY_RUN's 6: the second run must still be running after its first checkpoint once the UI check
    # of the queue (done while the first one runs) is over, however slow the machine, or the kill below is missed
    longer = {"train": {"steps": 20}}
    first, second = start_run(served["api"], "queued-a", **longer), start_run(served["api"], "queued-b", **longer)
    # (submitted before the browser starts:
    with SyncPrefectClient(served["api"]) as client, contextlib.ExitStack() as browser:  # its loop makes Prefect async)
        page = browser.enter_context(browser_page()) if CHROMIUM else None
        if page is not None:
            page.goto(f"{served['ui']}/runs/flow-run/{second}", timeout=60_000)
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            a, b = client.read_flow_run(first), client.read_flow_run(second)
            if a.state.is_running():
                assert b.state.type.value == "SCHEDULED", b.state  # queued behind the run that holds the slot
                if not waited and page is not None:
                    ui_shows_the_run_queued(page, served["ui"], second)
                    browser.close()
                waited = True
            if not killed and b.state.is_running() and committed_steps(project / "runs/queued-b"):
                assert a.state.is_completed()
                os.killpg(os.getpgid(int(b.infrastructure_pid)), signal.SIGKILL)
                killed = True
                time.sleep(0.5)  # (the group is gone: nothing commits now) the step the resume starts after
                resumed_from = committed_steps(project / "runs/queued-b")[-1]
            if killed and b.state.is_final() and not b.state.is_crashed():
                break
            time.sleep(0.5)
        b = client.read_flow_run(second)
        log = (project / ".rlflow-serve/worker-rlflow-process.log").read_text()[-3000:]
        assert waited and killed and b.state.is_completed(), (b.state, log)
        assert b.run_count == 2
        history = [(st.name, st.message) for st in client.read_flow_run_states(second)]
        assert ("AwaitingRetry", "rlflow auto-resume: rescheduled after a crash") in history, history
        # nothing left Running: the killed attempt's task is Crashed (or Completed, when the kill came just after
        # it, its last state events still on their way to the server)
        settle = time.monotonic() + 60
        while True:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [second]}))
            states = {t.state.type.value for t in tasks}
            if states <= {"COMPLETED", "CRASHED"} or time.monotonic() > settle:
                break
            time.sleep(1)
        assert states <= {"COMPLETED", "CRASHED"}, [(t.name, t.state.name) for t in tasks]
    if CHROMIUM:
        ui_shows_the_auto_resumed_attempt(served["ui"], second, "queued-b", from_step=resumed_from)
    assert mlflow_metrics(mlflow_uri, "queued-b") == mlflow_metrics(mlflow_uri, "queued-a")
    client = MlflowClient(mlflow_uri)
    [run] = client.search_runs([client.get_experiment_by_name("rlflow").experiment_id],
                               "attributes.run_name = 'queued-b'")
    assert run.data.tags["rlflow.attempts"] == "2"
    assert json.loads(run.data.tags["rlflow.attempt.2"])["start_step"] == resumed_from + 1  # after that checkpoint
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # served over HTTP, readable from elsewhere


@pytest.mark.slow  # about four minutes: 75 s to call the machine lost, then the wait for its lease
def test_a_run_whose_heartbeats_stop_is_resumed_once_its_lease_goes_stale(served):
    """A lost machine, as Prefect sees one: the flow's processes SIGSTOPped after its first checkpoint send no
    heartbeat and report nothing. The heartbeat automation marks the run Crashed (75 s here, SERVED_ENV), the crashed
    automation reschedules it, and the new attempt waits for the stopped process's lease to go stale (120 s), takes
    the run over and finishes it. The stopped process is killed then: its worker's late report of that exit
    reschedules the finished run once more, which ends Completed, with nothing to resume, instead of Failed."""
    from prefect.client.orchestration import SyncPrefectClient

    from rlflow.tasks.attempts import AUTO_RESUME_MESSAGE

    project = served["project"]
    store = project / "runs/heartbeat-lost"
    run_id = start_run(served["api"], "heartbeat-lost")
    with SyncPrefectClient(served["api"]) as client:
        group = os.getpgid(wait_committed(client, run_id, store))
        os.killpg(group, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 420
            while not client.read_flow_run(run_id).state.is_completed():
                assert time.monotonic() < deadline, client.read_flow_run(run_id).state
                time.sleep(1)
            history = [(st.name, st.message) for st in client.read_flow_run_states(run_id)]
            assert ("Crashed", "crashed: no heartbeat for 75 s (its machine or process is gone)") in history, history
            assert ("AwaitingRetry", AUTO_RESUME_MESSAGE) in history, history
            assert json.loads((store / "status.json").read_text())["status"] == "finished"
            assert (store / "checkpoints/5/COMMITTED").is_file()
            log = (project / ".rlflow-serve/worker-rlflow-process.log").read_text()
            assert "waiting up to" in log, log[-3000:]  # for the stopped process's lease
        finally:
            os.killpg(group, signal.SIGKILL)
        resumes = len([h for h in history if h[0] == "AwaitingRetry"])
        deadline = time.monotonic() + 120  # the worker reports the kill; the automation reschedules; it completes
        while True:
            states = sorted(client.read_flow_run_states(run_id), key=lambda st: st.timestamp)
            again = [st for st in states if st.name == "AwaitingRetry"][resumes:]
            if again and states[-1].is_final() or time.monotonic() > deadline:
                break
            time.sleep(1)
        run = client.read_flow_run(run_id)
        assert run.state.is_completed(), [(st.name, st.message) for st in states]
        if again:  # rescheduled by the late report: the attempt said there was nothing to resume
            assert "nothing to resume" in (run.state.message or ""), run.state
    assert json.loads((store / "status.json").read_text())["status"] == "finished"


def test_cancel_in_the_ui_ends_the_run_and_keeps_its_checkpoints(served):
    """The run page's Cancel, confirmed, in Chromium, on a run in progress: Prefect sets it Cancelling and its
    worker signals the flow's process group; the run closes its engines, writes its status as failed and releases
    its lease, keeping its committed checkpoints; it ends Cancelled, stays Cancelled (no auto-resume automation
    takes a cancel for a crash), and no process of it is left."""
    need_chromium()
    from playwright.sync_api import expect
    from prefect.client.orchestration import SyncPrefectClient

    project = served["project"]
    store = project / "runs/cancelled-in-ui"
    run_id = start_run(served["api"], "cancelled-in-ui", train={"steps": 100000})
    with SyncPrefectClient(served["api"]) as client:
        flow_pid = wait_committed(client, run_id, store)
        tree = {flow_pid} | descendants(flow_pid)
        with browser_page() as page:
            page.goto(f"{served['ui']}/runs/flow-run/{run_id}", timeout=60_000)
            expect(flow_run_state_badge(page)).to_have_text("Running", timeout=30_000)
            page.get_by_role("button", name="Cancel", exact=True).click()
            page.get_by_role("button", name="Confirm").click()
            expect(flow_run_state_badge(page)).to_have_text("Cancelled", timeout=120_000)
        left = wait_gone(tree, (), timeout=60)
        assert not left, f"still running after the run was cancelled: {left}"
        time.sleep(5)  # what an automation would do to it, it has done by now (the kill test: 4-50 s, see its docs)
        states = [st.name for st in client.read_flow_run_states(run_id)]
        assert client.read_flow_run(run_id).state.is_cancelled() and "AwaitingRetry" not in states, states
    assert json.loads((store / "status.json").read_text())["status"] == "failed"  # closed by the run itself
    assert any((store / "checkpoints").glob("*/COMMITTED"))  # the latest ones (retention prunes the oldest)
    assert json.loads((store / "LEASE").read_text()).get("released"), "the run's lease is still held"


def test_sigterm_stops_the_runs_and_every_service_serve_started(served):
    """SIGTERM (then an impatient Ctrl-C during the shutdown) on `rlflow serve` with a run in progress: the run is
    cancelled through Prefect (what the UI's Cancel does) and ends its engines and process, keeping its committed
    checkpoints, and is left Crashed for Retry or auto-resume; serve exits 0 having stopped the Prefect server, the
    MLflow server (and its uvicorn and job runner) and the workers; their ports are closed. Before, SIGTERM killed
    serve alone and its services kept their ports, and a run went on training with no server."""
    import sqlite3

    from prefect.client.orchestration import SyncPrefectClient

    project, proc = served["project"], served["proc"]
    run_id = start_run(served["api"], "stopped-by-serve", train={"steps": 100000})
    with SyncPrefectClient(served["api"]) as client:
        flow_pid = wait_committed(client, run_id, project / "runs/stopped-by-serve")
    tree = descendants(proc.pid)
    assert len(tree) >= 3 and all(port_open(p) for p in served["ports"])
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # must not cut the shutdown short
    try:
        code = proc.wait(240)  # a run's own SIGTERM handling may take its 60 s grace on a loaded machine
    except subprocess.TimeoutExpired:
        pytest.fail("rlflow serve did not exit within 240 s of SIGTERM; it printed:\n"
                    + served["log"].read_text()[-4000:])
    assert code == 0, served["log"].read_text()[-3000:]
    print(f"rlflow serve stopped {len(tree)} processes in {time.monotonic() - t0:.1f} s")
    left = wait_gone(tree | {flow_pid}, served["ports"], timeout=5)
    assert not left, f"still running after rlflow serve exited: {left}"
    assert not [p for p in served["ports"] if port_open(p)], "a service port is still open"
    assert "stopped 1 run(s)" in served["log"].read_text()
    store = project / "runs/stopped-by-serve"
    assert json.loads((store / "status.json").read_text())["status"] == "failed"  # closed by the run itself
    assert any((store / "checkpoints").glob("*/COMMITTED"))
    with sqlite3.connect(project / ".prefect/prefect.db") as db:  # the server is gone: its database says
        states = [name for (name,) in db.execute(
            "SELECT name FROM flow_run_state WHERE flow_run_id = ? ORDER BY timestamp", (run_id,))]
    assert "Cancelling" in states and states.index("Crashed") > states.index("Cancelling"), states
    assert states[-1] in ("Crashed", "AwaitingRetry"), states  # for Retry, or auto-resume once serve runs again
