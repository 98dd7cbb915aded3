"""An MlflowClient whose calls go through rlflow's one retry layer, with a total deadline.

MLflow's own HTTP retries (7, with backoff: about 4.5 minutes against an unreachable server, longer with its
120 s request timeout) are turned off for this process, so `tracking.deadline_s` bounds how long a dead or
failing tracking server holds a run. Retrying a log_batch is safe: its metrics carry their timestamps, and an
identical point is stored once.

Once a call has used up its retries, the server is taken for down: later calls get one attempt each until one
succeeds. A server that died mid-run then costs one retry budget, not one per call that follows (the run's
clean-up: its final status, a last metric), and the error the run reports stays the first one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from mlflow.tracking import MlflowClient

from rlflow.engines.core.retry import RetriesExhausted, RetryPolicy, ServiceError

T = TypeVar("T")
ONE_ATTEMPT = RetryPolicy(retries=0)


def one_attempt_http(timeout_s: float) -> None:
    """MLflow tries each HTTP request once, for at most `timeout_s` seconds (its env settings, read per request)."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, round(timeout_s)))


class RetryingClient(MlflowClient):
    """The MlflowClient calls rlflow makes, each retried on transient errors under `policy`."""

    def __init__(self, uri: str, policy: RetryPolicy, timeout_s: float = 30):
        one_attempt_http(timeout_s)
        super().__init__(uri)
        self.policy = policy
        self.down: RetriesExhausted | None = None  # the call that used up its retries, until a call succeeds
        self._inside = threading.local()  # MLflow's log_table calls get_run: one retry layer, the outer one

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        if getattr(self._inside, "call", False):
            return fn()
        self._inside.call = True
        policy = self.policy if self.down is None else ONE_ATTEMPT
        try:
            result = policy.call(f"MLflow {what} at {self.tracking_uri}", fn)
        except RetriesExhausted as e:
            self.down = self.down or e
            raise
        finally:
            self._inside.call = False
        self.down = None
        return result

    def get_experiment_by_name(self, name: str) -> Any:
        return self._call("get_experiment_by_name", lambda: super(RetryingClient, self).get_experiment_by_name(name))

    def create_experiment(self, name: str, *args: Any, **kwargs: Any) -> str:
        return self._call(
            "create_experiment", lambda: super(RetryingClient, self).create_experiment(name, *args, **kwargs)
        )

    def set_experiment_tag(self, *args: Any, **kwargs: Any) -> None:
        self._call("set_experiment_tag", lambda: super(RetryingClient, self).set_experiment_tag(*args, **kwargs))

    def search_experiments(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("search_experiments", lambda: super(RetryingClient, self).search_experiments(*args, **kwargs))

    def create_run(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("create_run", lambda: super(RetryingClient, self).create_run(*args, **kwargs))

    def get_run(self, run_id: str) -> Any:
        return self._call("get_run", lambda: super(RetryingClient, self).get_run(run_id))

    def get_metric_history(self, run_id: str, key: str) -> Any:
        return self._call("get_metric_history", lambda: super(RetryingClient, self).get_metric_history(run_id, key))

    def update_run(self, *args: Any, **kwargs: Any) -> None:
        self._call("update_run", lambda: super(RetryingClient, self).update_run(*args, **kwargs))

    def set_terminated(self, *args: Any, **kwargs: Any) -> None:
        self._call("set_terminated", lambda: super(RetryingClient, self).set_terminated(*args, **kwargs))

    def log_batch(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("log_batch", lambda: super(RetryingClient, self).log_batch(*args, **kwargs))

    def log_text(self, *args: Any, **kwargs: Any) -> None:
        self._call("log_text", lambda: super(RetryingClient, self).log_text(*args, **kwargs))

    def log_table(self, *args: Any, **kwargs: Any) -> None:
        self._call("log_table", lambda: super(RetryingClient, self).log_table(*args, **kwargs))

    def list_artifacts(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("list_artifacts", lambda: super(RetryingClient, self).list_artifacts(*args, **kwargs))

    def download_artifacts(self, *args: Any, **kwargs: Any) -> str:
        return self._call("download_artifacts",
                          lambda: super(RetryingClient, self).download_artifacts(*args, **kwargs))


class TrackingUnavailable(ServiceError):
    """The tracking URI cannot take runs; the message names it."""


def probe_tracking(uri: str, policy: RetryPolicy, timeout_s: float = 10) -> None:
    """Raise if runs cannot be tracked at `uri`; the message names the URI. A server gets one cheap API call; a
    sqlite file is not opened (that would create it and run MLflow's migrations): its folder must be writable."""
    if uri.startswith("sqlite:///") or uri.startswith("file:") or "://" not in uri:
        path = Path(uri.removeprefix("sqlite:///").removeprefix("file://").removeprefix("file:"))
        folder = path.parent if uri.startswith("sqlite:") else path
        existing = next((p for p in [folder, *folder.parents] if p.exists()), Path("."))
        if not os.access(existing, os.W_OK):
            raise TrackingUnavailable(f"tracking.uri {uri}: {existing} is not writable")
        return
    try:
        RetryingClient(uri, policy, timeout_s).search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 - whatever it is, say where
        msg = str(e) if uri in str(e) else f"tracking.uri {uri}: {e}"
        raise TrackingUnavailable(f"MLflow is not reachable: {msg}") from e
