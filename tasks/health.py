"""Publishing the run-health checks (engines/core/health.py) of a post-training flow run.

After a step's metrics are logged the flow hands them to `check_step`: each finding is logged (the Prefect run's
logs show it), set as the MLflow tag `health.<check>` ("warn at step 3: ..."), and listed in the run's `health`
table artifact in Prefect; then a failing one is raised as HealthCheckFailed, which fails the flow run before the
step's checkpoint. Nothing already written is touched: earlier checkpoints and the step's persisted rollout batch
stay for a look (and a resume once the cause is fixed, or the check set to warn).
"""

from __future__ import annotations

import logging
from dataclasses import asdict

from rlflow.engines.core.health import Finding, HealthCheckFailed
from rlflow.tasks.run_context import RunContext

log = logging.getLogger("rlflow")

TAG_PREFIX = "health."


def tag_value(f: Finding) -> str:
    """The MLflow tag's value: what fired, when, by how much."""
    extra = f" ({f.detail})" if f.detail else ""
    return f"{f.action} at step {f.step}: {f.metric} = {f.value:.6g}, allowed {f.threshold}{extra}"


def check_step(run: RunContext, step: int, metrics: dict[str, float]) -> list[Finding]:
    """Run the health checks on `step`'s metrics and publish what fired; HealthCheckFailed for a failing one."""
    if run.health is None:
        return []
    findings = run.health.observe(step, metrics)
    if not findings:
        return []
    for f in findings:
        (log.error if f.action == "fail" else log.warning)("%s", f.message)
    run.tracker.set_tags({f"{TAG_PREFIX}{f.check}": tag_value(f) for f in findings})
    new = [f for f in findings if f.check not in run.health_findings]
    run.health_findings |= {f.check: f for f in findings}  # the latest finding of each check
    failed = [f for f in findings if f.action == "fail"]
    if run.artifacts is not None and (new or failed):  # a table when a check starts firing, not every step
        run.artifacts.health(step, [_row(f) for f in run.health_findings.values()])
    if failed:
        raise HealthCheckFailed(failed[0])
    return findings


def _row(f: Finding) -> dict:
    row = asdict(f)
    row["value"] = f"{f.value:.6g}"  # NaN and Inf are not JSON: the table shows them as text
    return row
