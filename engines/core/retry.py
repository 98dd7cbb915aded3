"""The one retry layer for external services (the run store, MLflow): attempts bounded by a count and a deadline.

The clients underneath are set to try once (s3fs `retries=1`, botocore `total_max_attempts=1`, MLflow
`MLFLOW_HTTP_REQUEST_MAX_RETRIES=0`): stacked retry layers multiply (5 x 5 x 6 attempts per call), which turns
a dead endpoint into minutes of waiting and a throttled one into more load. Here a call is retried only for
transient errors, with exponential backoff, and never starts an attempt past its deadline.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger("rlflow.retry")
T = TypeVar("T")

TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
    "TEMPORARILY_UNAVAILABLE",
    "REQUEST_LIMIT_EXCEEDED",
    "503",
    "500",
}
# by class name, so neither botocore, aiohttp, urllib3 nor requests need importing here
TRANSIENT_TYPES = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ResponseStreamingError",
    "NewConnectionError",
    "ProtocolError",
    "ConnectTimeout",
    "ReadTimeout",
    "ResponseError",
}  # urllib3's "too many 429/5xx responses" under MLflow's one-attempt retry object
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_HTTP_STATUS = re.compile(r"failed with error code (\d{3})")


def is_transient(err: BaseException, _depth: int = 0) -> bool:
    """Timeouts, connection drops, 5xx and throttling are worth retrying; missing files and denials are not.

    Looks through the exception's causes: s3fs and MLflow wrap the error that says what happened."""
    if isinstance(err, TimeoutError | ConnectionError):
        return True
    if any(c.__name__ in TRANSIENT_TYPES for c in type(err).__mro__):
        return True
    resp = getattr(err, "response", None)
    if isinstance(resp, dict):  # botocore's ClientError
        code = str(resp.get("Error", {}).get("Code", ""))
        status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or code in TRANSIENT_CODES
    if str(getattr(err, "error_code", "")) in TRANSIENT_CODES:  # MLflow's MlflowException: a 503 or a 429
        return True
    http = _HTTP_STATUS.search(str(err)) if type(err).__name__ == "MlflowException" else None
    if http and int(http.group(1)) in TRANSIENT_STATUS:  # a proxy's 502/504 page, which MLflow calls an internal error
        return True
    cause = err.__cause__ or err.__context__
    return _depth < 6 and cause is not None and is_transient(cause, _depth + 1)


class ServiceError(RuntimeError):
    """An outside service (the run store, MLflow, the Prefect API) failed for good; the message names the service
    and where it was asked. The CLI prints it as one line (no traceback) and exits 2."""


class RetriesExhausted(ServiceError):
    """A transient error outlasted the retry budget; raised from the last error."""


@dataclass(frozen=True)
class RetryPolicy:
    """At most `retries` retries after the first attempt, none started after `deadline_s` seconds from it."""

    retries: int = 5
    deadline_s: float = 120.0
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def call(self, what: str, fn: Callable[[], T], transient: Callable[[BaseException], bool] = is_transient) -> T:
        """fn() with retries on transient errors. A permanent error is raised as it is; a transient one that
        outlasts the budget as RetriesExhausted naming `what`, the attempts and the seconds spent."""
        start = time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below
                if not transient(e):
                    raise
                elapsed = time.monotonic() - start
                delay = min(self.backoff_s * 2**attempt, self.max_backoff_s)
                if attempt == self.retries or elapsed + delay > self.deadline_s:
                    raise RetriesExhausted(
                        f"{what}: transient error, gave up after {attempt + 1} attempts in {elapsed:.1f} s "
                        f"(retries {self.retries}, deadline {self.deadline_s:g} s): {type(e).__name__}: {e}"
                    ) from e
                log.warning(
                    "%s: %s: %s; retry %d/%d in %.1fs", what, type(e).__name__, e, attempt + 1, self.retries, delay
                )
                time.sleep(delay)
        raise AssertionError("unreachable")
