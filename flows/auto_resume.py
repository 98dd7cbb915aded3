"""Preemption-aware auto-resume: Prefect automations that reschedule a crashed post-train flow run, which then
resumes from its last committed checkpoint with no one at the keyboard.

A flow run crashes three ways, and each has its automation (all act on the same flow run: ChangeFlowRunState to
AwaitingRetry, so it keeps its id and its MLflow run, its run count goes up, and the UI lists each attempt):
- its process dies hard (SIGKILL, the OOM killer): the worker reports a non-zero exit once it is done with the
  attempt (`prefect.worker.executed-flow-run`). Reacting to the Crashed state instead fired twice for one kill, as
  the worker reports that crash a second time some seconds later, and ran two attempts at once;
- its process is terminated from outside (SIGTERM) or a stopping `rlflow serve` ends it: Crashed with another
  message than the worker's "exited with status code";
- its whole machine goes away (a preempted node): nothing reports anything, so a proactive trigger marks a run
  Crashed when its heartbeats (the worker's PREFECT_FLOWS_HEARTBEAT_FREQUENCY) stop, and the one above takes over.

How often: `checkpoint.auto_resume` of the run's recipe, enforced by the run itself (tasks/attempts.py counts the
automation's reschedules in its state history and fails, not crashes, once they pass the limit), so one automation
serves every run of a deployment whatever its recipe says.
"""

from __future__ import annotations

import os
from datetime import timedelta
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.settings import PREFECT_API_URL, temporary_settings

from rlflow.tasks.attempts import AUTO_RESUME_MESSAGE

LOST_ENV = "RLFLOW_HEARTBEAT_LOST_S"
DEFAULT_LOST_S = 150  # no heartbeat for this long: the run's machine is gone (5 of serve's 30 s beats missed)
BEATS_PER_LOST = 5
MIN_BEAT_S = 30  # PREFECT_FLOWS_HEARTBEAT_FREQUENCY's least value


def heartbeat_lost_s() -> int:
    """RLFLOW_HEARTBEAT_LOST_S (default 150, at least 60): how long a running flow run may send no heartbeat before
    the automation marks it crashed. Read where serve deploys; serve's workers beat BEATS_PER_LOST times in it, or
    every 30 s, Prefect's least period, so at least twice."""
    text = os.environ.get(LOST_ENV, "").strip()
    if not text:
        return DEFAULT_LOST_S
    if not text.isdigit() or int(text) < 2 * MIN_BEAT_S:
        raise ValueError(f"{LOST_ENV}={text!r}: expected a whole number of seconds, at least {2 * MIN_BEAT_S} (two "
                         f"of the flow heartbeats, which Prefect sends every {MIN_BEAT_S} s at the most)")
    return int(text)


def heartbeat_s() -> int:
    """The flow heartbeat period (PREFECT_FLOWS_HEARTBEAT_FREQUENCY) of serve's workers."""
    return max(MIN_BEAT_S, heartbeat_lost_s() // BEATS_PER_LOST)


def automation_names(deployment: str) -> list[str]:
    return [f"rlflow auto-resume {deployment}: {kind}" for kind in ("process killed", "crashed", "heartbeat lost")]


def automations(deployment: str, deployment_id: UUID) -> list[AutomationCore]:
    """The three automations of one deployment (see the module's docstring)."""
    lost_s = heartbeat_lost_s()
    of_deployment = {"prefect.resource.role": "deployment",
                     "prefect.resource.id": f"prefect.deployment.{deployment_id}"}
    reschedule = [ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry", message=AUTO_RESUME_MESSAGE)]
    killed, crashed, lost = automation_names(deployment)
    return [
        AutomationCore(name=killed, description="A flow run whose process died (SIGKILL, OOM) is rescheduled.",
                       trigger=EventTrigger(
                           expect={"prefect.worker.executed-flow-run"},
                           match_related=[of_deployment, {"prefect.resource.role": "flow-run",
                                                          "prefect.infrastructure.status-code": "!0"}],
                           posture=Posture.Reactive, threshold=1),
                       actions=reschedule),
        AutomationCore(name=crashed, description="A flow run crashed from outside (SIGTERM, a stopping serve, a lost "
                       "heartbeat) is rescheduled.",
                       trigger=EventTrigger(
                           expect={"prefect.flow-run.Crashed"},
                           match={"prefect.resource.id": "prefect.flow-run.*",
                                  "prefect.state-message": "!*exited with*status code*"},
                           match_related=of_deployment, posture=Posture.Reactive, threshold=1),
                       actions=reschedule),
        AutomationCore(name=lost, description="A running flow run whose heartbeats stopped (its machine is gone) is "
                       "marked Crashed.",
                       trigger=EventTrigger(
                           after={"prefect.flow-run.heartbeat"},
                           expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed",
                                   "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                                   "prefect.flow-run.Crashed", "prefect.flow-run.Cancelling"},
                           match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=of_deployment,
                           for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                           within=timedelta(seconds=lost_s)),
                       actions=[ChangeFlowRunState(state=StateType.CRASHED, message=(
                           f"crashed: no heartbeat for {lost_s} s (its machine or process is gone)"))]),
    ]


def ensure_auto_resume(api_url: str, deployments: list[str]) -> list[str]:
    """(Re)create the auto-resume automations of each deployment ("flow/deployment" names); returns their names.
    Earlier ones of the same names are replaced, so a redeploy never doubles them."""
    made = []
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        for name in deployments:
            deployment = client.read_deployment_by_name(name)
            for automation in automations(name, deployment.id):
                for old in client.read_automations_by_name(automation.name):
                    client.delete_automation(old.id)
                client.create_automation(automation)
                made.append(automation.name)
    return made
