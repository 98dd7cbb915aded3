"""tracking: where MLflow metrics go, and how long an unreachable tracking server is retried."""

from __future__ import annotations

from pydantic import Field, field_validator

from rlflow.engines.core.config.base import Section
from rlflow.engines.core.retry import RetryPolicy


class TrackingConfig(Section):
    uri: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI (sqlite:///file.db, http(s)://host:port, "
                     "or a folder); leave the key out for the default, an empty value is an error.")
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
                             "folder), or leave the key out for the default sqlite:///mlflow.db")
        return v
