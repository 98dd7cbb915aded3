"""Everything a running post-training flow holds: config, engines, run store, tracker.

Made once per flow run by `open_run`. Starting a run whose name has a committed checkpoint in the store
continues from it (same MLflow run, same data cursor, same weights and optimizer).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.runtime import flow_run

from rlflow.engines.core.config import RecipeError, RLConfig, public_tree
from rlflow.engines.core.health import Finding, HealthMonitor
from rlflow.engines.session.rl import RLSession
from rlflow.engines.session.workers import prepare_data, prepare_model
from rlflow.engines.store.lease import RunLease
from rlflow.engines.store.run_store import RunStore, worker_storage, workers_write_checkpoints
from rlflow.tasks.artifacts import TrainingArtifacts
from rlflow.tasks.attempts import automatic_resumes, close_earlier_attempts
from rlflow.tasks.checkpoint_commit import PendingCommit
from rlflow.tasks.run_logs import send_to_prefect, step_log, step_summary
from rlflow.tasks.tracking import Tracker

log = logging.getLogger("rlflow")

# Callables (step, metrics) told about every finished step, e.g. the CLI's progress bar. Kept out of the
# flow's parameters so the parameter schema is the config tree alone.
STEP_LISTENERS: list[Callable[[int, dict], None]] = []

# The runs this process has open, by name. Stage tasks take (run name, step) as parameters and look the
# run up here: a task's parameters stay two plain values (what the Prefect UI shows, and cheap for
# Prefect to record) instead of an object graph of engines it would walk on every call.
_OPEN: dict[str, RunContext] = {}


def active_run(name: str) -> RunContext:
    """The open run `name`, for a stage about to run: LeaseLost if another process took the run over."""
    if name not in _OPEN:
        raise RuntimeError(f"run {name!r} is not open in this process (open_run starts it)")
    _OPEN[name].lease.check()
    return _OPEN[name]


@dataclass
class RunContext:
    cfg: RLConfig
    session: RLSession  # or an rlflow.engines.session.sft.SFTSession, which has the same stage, save and load methods
    store: RunStore
    lease: RunLease  # this process's claim to write the run (engines/store/lease.py), released by close()
    tracker: Tracker
    workdir: Path
    start_step: int = 0
    artifacts: TrainingArtifacts | None = None  # Prefect artifacts, when running as a flow
    stop_logs: Callable[[], None] = lambda: None  # ends the rlflow logger's link to the Prefect run's logs
    pending: PendingCommit | None = None  # a checkpoint written in the background, not yet committed
    health: HealthMonitor | None = None  # the run-health checks (tasks/health.py); their windows go into checkpoints
    health_findings: dict[str, Finding] = field(default_factory=dict)  # the latest finding of each check that fired

    def notify(self, step: int, metrics: dict) -> None:
        """A step is done: its summary line to the Prefect run's logs, then the listeners."""
        step_log.info(step_summary(step, self.cfg.train.steps, metrics))
        for listener in STEP_LISTENERS:
            listener(step, metrics)

    def log_step(self, step: int, metrics: dict[str, float], held_out: dict[str, float]) -> dict[str, float]:
        """Log a step's metrics at `step` and its held-out evaluation, if any (the policy after step + 1 updates),
        at step + 1: eval/* at step v is always the policy after v updates. Returns both, for the listeners."""
        self.tracker.log_metrics(metrics, step)
        self.tracker.log_metrics(held_out, step + 1)
        return metrics | held_out

    def checkpoint(self, step: int) -> dict[str, float]:
        """Save every worker's state, commit it to the store (marker last), prune old ones.

        Metrics are written synchronously (tasks/tracking.py), so a committed step never lacks its metrics. With
        checkpoint.async_save the workers write in the background and a PendingCommit commits the checkpoint when
        they are done; this first waits for the previous one (and raises if it was not committed).
        """
        self._await_commit()
        t0 = time.perf_counter()
        self.tracker.flush()
        meta = {"step": step, "next_step": step + 1, "mlflow_run_id": self.tracker.run_id}
        if self.health is not None:  # the health windows as of this step: a resume goes on counting from here
            meta["health"] = self.health.state()
        background = self.cfg.checkpoint.async_save
        if background:  # a failed attempt of this stage may have left writers running: none may write below
            self.session.drain_saves()
        if workers_write_checkpoints(self.cfg):  # the workers write their shards into the store themselves
            target = self.store.begin_checkpoint(step)
            controller = self.session.save(target, step, storage=worker_storage(self.cfg.storage),
                                           background=background)

            def commit() -> str:  # only once every worker has returned, or written
                self.lease.check()
                return self.store.finish_checkpoint(step, meta | controller)

            def exists(name: str) -> bool:
                return self.store.exists("checkpoints", step, name)

            def read_error(name: str) -> str:
                return self.store.read_json("checkpoints", step, name).get("error", "")
        else:
            tmp = Path(tempfile.mkdtemp(dir=self.workdir))
            try:
                controller = self.session.save(tmp, step, background=background)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise

            def commit() -> str:
                try:
                    self.lease.check()
                    return self.store.commit_checkpoint(step, tmp, meta | controller)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)

            def exists(name: str) -> bool:
                return (tmp / name).exists()

            def read_error(name: str) -> str:
                return json.loads((tmp / name).read_text()).get("error", "")
        if background:
            self.pending = PendingCommit(step, self.session.written_markers(), exists, read_error,
                                         lambda: self._committed(step, commit()))
        else:
            self._committed(step, commit())
        self.tracker.log_metrics({"time/checkpoint": time.perf_counter() - t0}, step)
        return {"checkpoint/step": float(step)}

    def _committed(self, step: int, uri: str) -> None:
        pruned = self.store.prune(self.cfg.checkpoint.keep_last)
        if not self.cfg.checkpoint.keep_rollouts:
            self.store.prune_rollouts(before_step=step)  # only now: a resume before the commit still reads them
        log.info("checkpoint step %d committed at %s (pruned %s)", step, uri, pruned or "none")

    def _await_commit(self) -> None:
        """The background checkpoint in flight, if any: wait for its commit and log how long its write took after
        the stage returned (time/checkpoint_write, at its step); RuntimeError if it was not committed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.tracker.log_metrics({"time/checkpoint_write": pending.result(self.session.save_problem)},
                                     pending.step)

    @property
    def name(self) -> str:
        return self.cfg.name

    def close(self, status: str) -> None:
        """End the run: a finished one first waits for its last checkpoint's commit (and fails if that was not
        committed); a failed one leaves a background write uncommitted. The run's records and workers are closed
        whatever happens here, and the lease released last (a run taken over by another process writes no status)."""
        _OPEN.pop(self.cfg.name, None)
        error = None
        try:
            if self.pending is not None and status == "FINISHED":
                self._await_commit()
            elif self.pending is not None:
                self.pending.cancel()
                if self.pending.seconds is not None:  # committed before the run failed: its write time counts
                    try:
                        self.tracker.log_metrics({"time/checkpoint_write": self.pending.seconds}, self.pending.step)
                    except Exception as exc:  # a failed run reports its own error, not a dead tracker's
                        log.warning("could not log the last checkpoint's write time: %s", exc)
        except Exception as exc:
            error, status = exc, "FAILED"
        finally:
            try:
                if self.lease.held:
                    self.store.write_json({"status": status.lower(), "mlflow_run_id": self.tracker.run_id},
                                          "status.json")
                self.tracker.finish(status)
                self.session.shutdown()
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.stop_logs()
            finally:
                self.lease.release()
        if error is not None:
            raise error


class RunAlreadyFinished(RecipeError):
    """Starting a run whose committed steps already reach `train.steps`: nothing would train. A RecipeError, so
    `rlflow run` prints it as one plain line naming the field."""


class NothingToResume(Exception):
    """An automatic resume of a run that has finished: the flow ends Completed without starting anything."""


def refuse_finished_run(cfg: RLConfig, next_step: int, status: str | None, steps: tuple[str, int],
                        automatic: bool = False) -> None:
    """A run name whose checkpoints already reach its step count (`steps`: the field that sets it and its value)
    is refused, saying how to start a new run or extend this one, instead of "completing" with no step. The
    exception: the last step was committed but the attempt died before it wrote its finished status (a retry then
    only closes the run). An automatic resume of a finished run (the automation acting on a late report of an
    earlier attempt's death, e.g. a hung process killed after another attempt finished the run) is NothingToResume,
    so the run stays finished rather than Failed."""
    field, total = steps
    if next_step < total or (next_step == total and status != "finished"):
        return
    if automatic:
        raise NothingToResume(f"run {cfg.name!r} already finished its {next_step} steps: nothing to resume (an "
                              "auto-resume automation rescheduled it after an earlier attempt's late crash report)")
    raise RunAlreadyFinished(f"run {cfg.name!r} in {cfg.storage.uri}", [
        f"{field}: {total}, but the run already {'finished' if status == 'finished' else 'committed'} step "
        f"{next_step - 1}, the last of its {next_step} steps, so no step is left to train. To start a new run, give "
        f"it another name (--set name={cfg.name}-2, or the run form's `name`); to train this one further, raise "
        f"{field} above {next_step}" + ("" if " " in field else
                                        f" (e.g. rlflow resume {cfg.name} --set {field}={2 * next_step})")])


class AutoResumeExhausted(RuntimeError):
    """The run crashed more often than checkpoint.auto_resume lets the automations resume it."""


def refuse_exhausted_auto_resume(cfg: RLConfig) -> int:
    """A flow run rescheduled by the auto-resume automations (flows/auto_resume.py) more than checkpoint.auto_resume
    times fails here, before it starts anything: Failed, which no automation reschedules, so a run that crashes
    every time stops; Retry in the UI still resumes it (a human retry is not counted). Returns how many automatic
    resumes this attempt is (0: not one)."""
    if flow_run.id is None or flow_run.run_count <= 1:
        return 0
    resumes = automatic_resumes(flow_run.id)
    if resumes > cfg.checkpoint.auto_resume:
        raise AutoResumeExhausted(
            f"run {cfg.name!r}: the auto-resume automation rescheduled this flow run {resumes} times after crashes, "
            f"more than checkpoint.auto_resume ({cfg.checkpoint.auto_resume}) allows; look at why its attempts "
            "crash (its logs), then Retry it from the UI or raise checkpoint.auto_resume")
    if resumes:
        log.info("run %s: auto-resume %d of %d after a crash", cfg.name, resumes, cfg.checkpoint.auto_resume)
    return resumes


def shared_dir(cfg: RLConfig) -> str | None:
    """Where the run's working folder goes: cluster.shared_dir (made if missing), else the system's temp."""
    if cfg.cluster.shared_dir:
        Path(cfg.cluster.shared_dir).mkdir(parents=True, exist_ok=True)
    return cfg.cluster.shared_dir


def stored_config(cfg: RLConfig) -> dict:
    """The resolved recipe as persisted and logged: credentials are left out, never written anywhere."""
    return public_tree(cfg)


def open_run(cfg: RLConfig, make_session: Callable[[RLConfig, str], Any] = RLSession.create,
             steps: tuple[str, int] | None = None) -> RunContext:
    """Open (or resume) the run `cfg.name`. make_session starts the engines: an RLSession for post_train, an
    SFTSession (engines/session/sft.py) for the SFT and rejection-sampling flows; both save and load the same way.
    `steps`: the field that sets the run's step count and its value (default: train.steps); a run whose committed
    steps already reach it is refused (RunAlreadyFinished)."""
    stop_logs = send_to_prefect()  # from here on, what the run logs shows in the Prefect UI too
    try:
        automatic = refuse_exhausted_auto_resume(cfg) > 0
        return _open_run(cfg, make_session, stop_logs, steps or ("train.steps", cfg.train.steps), automatic)
    except BaseException:
        stop_logs()
        raise


def _open_run(cfg: RLConfig, make_session: Callable[[RLConfig, str], Any], stop_logs: Callable[[], None],
              steps: tuple[str, int], automatic: bool = False) -> RunContext:
    store = RunStore(cfg.storage, cfg.name)  # a name whose folder would leave the store is refused here
    store.probe()  # a missing bucket or a dead endpoint stops the run now, before data and model are prepared
    store.claim()  # the RUN marker: a folder that is not this run's is refused, and never cleaned
    lease = RunLease(store)  # one writer per run: another live process holding it is named and refused ...
    lease.acquire(wait_for_stale=automatic)  # ... after its lease went stale, for an automatic resume
    try:
        return _open_leased(cfg, make_session, stop_logs, store, lease, steps, automatic)
    except BaseException:
        lease.release()
        raise


def _open_leased(cfg: RLConfig, make_session: Callable[[RLConfig, str], Any], stop_logs: Callable[[], None],
                 store: RunStore, lease: RunLease, steps: tuple[str, int], automatic: bool) -> RunContext:
    torn = store.clean_torn()
    if torn:
        log.warning("removed uncommitted leftovers of an interrupted attempt: %s", ", ".join(torn))
    latest = store.latest_step()
    meta = store.read_json("checkpoints", latest, "meta.json") if latest is not None else None
    earlier = store.read_json("status.json") if store.exists("status.json") else {}
    if meta is not None:
        refuse_finished_run(cfg, meta["next_step"], earlier.get("status"), steps, automatic)
    workdir = Path(tempfile.mkdtemp(prefix=f"rlflow-{cfg.name}-", dir=shared_dir(cfg)))
    prepare_data(cfg)
    model_dir = workdir / "model"
    model_path = prepare_model(cfg, model_dir)
    if meta is None:
        store.write_json(stored_config(cfg), "config.json")
    # an earlier attempt's MLflow run continues, also when it died before its first checkpoint
    run_id = meta["mlflow_run_id"] if meta else earlier.get("mlflow_run_id")
    tracker = Tracker.for_training(cfg, run_id=run_id)
    if run_id is not None:  # steps after the checkpoint run again: what they logged before is not logged twice
        tracker.resume_after(latest if meta is not None else -1)
    session = make_session(cfg, model_path)
    store.write_json({"status": "running", "mlflow_run_id": tracker.run_id}, "status.json")
    ctx = RunContext(cfg, session, store, lease, tracker, workdir, stop_logs=stop_logs)
    _OPEN[cfg.name] = ctx
    if meta is not None and workers_write_checkpoints(cfg):
        session.load(store.uri("checkpoints", latest), meta, storage=worker_storage(cfg.storage))
    elif meta is not None:
        session.load(store.download_checkpoint(latest, workdir / f"resume-{latest}"), meta)
    if meta is not None:
        ctx.start_step = meta["next_step"]
        log.info("resuming run %s from committed step %d", cfg.name, latest)
    ctx.health = HealthMonitor(cfg.health, ctx.start_step, cfg.rollout.samples_per_prompt,
                               meta.get("health") if meta is not None else None)
    earlier = tracker.record_attempt(ctx.start_step)
    if flow_run.id is not None:  # the lease is ours: what earlier attempts left running in Prefect is dead
        close_earlier_attempts(flow_run.id, earlier)
    return ctx
