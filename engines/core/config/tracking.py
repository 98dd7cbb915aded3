"""tracking: where MLflow metrics go, and how long an unreachable tracking server is retried."""

from __future__ import annotations

import os

from pydantic import Field, field_validator

from rlflow.engines.core.config.base import Section
from rlflow.engines.core.retry import RetryPolicy

DEFAULT_URI = "sqlite:///mlflow.db"
TRACKING_URI_ENV = "RLFLOW_TRACKING_URI"


def default_uri() -> str:
    """RLFLOW_TRACKING_URI when set (`rlflow serve` sets it to its MLflow server for the deployments and the flow
    runs of its workers), else a SQLite file in the working directory. Not MLflow's own MLFLOW_TRACKING_URI:
    mlflow.set_tracking_uri writes that variable, so in a process that has logged one run it would point the next
    recipe at the last run's tracking URI."""
    return os.environ.get(TRACKING_URI_ENV) or DEFAULT_URI


class TrackingConfig(Section):
    uri: str = Field(default_factory=default_uri, description="MLflow tracking URI (sqlite:///file.db, "
                     "http(s)://host:port, or a folder); leave the key out for the default: RLFLOW_TRACKING_URI when "
                     "set, else sqlite:///mlflow.db. An empty value is an error.")
    experiment: str = "rlflow"
    log_samples: int = Field(8, ge=0, description="Sample rollouts logged as a table each eval.")
    deadline_s: float = Field(120, gt=0, description="No retry of an MLflow call starts later than this many "
                              "seconds after its first attempt: an unreachable tracking server stops the run "
                              "within about this long.")
    timeout_s: float = Field(30, gt=0, description="Seconds one MLflow HTTP request may take.")

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(retries=8, deadline_s=self.deadline_s)

    @field_validator("uri")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        # MLflow reads an empty URI as "use the default", a ./mlruns folder in whatever directory the run starts in:
        # the metrics would land somewhere nobody looks (an unset environment variable in a template does this)
        if not v.strip():
            raise ValueError("empty; expected an MLflow tracking URI (sqlite:///mlflow.db, http://host:5000, a "
                             "folder), or leave the key out for the default (RLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
        return v
