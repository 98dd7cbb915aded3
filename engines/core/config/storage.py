"""storage: the run store's root (local or s3://), its credentials, and its retries."""

from __future__ import annotations

from typing import Any

from pydantic import Field, SecretStr

from rlflow.engines.core.config.base import Section
from rlflow.engines.core.retry import RetryPolicy


class StorageConfig(Section):
    uri: str = Field("runs", description="Run store root: a local path, file:// or s3:// URI.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto, ...); empty: AWS.")
    profile: str | None = Field(None, description="AWS profile name; empty: the environment's credentials.")
    key: SecretStr | None = Field(None, description="Access key id (prefer the environment: AWS_ACCESS_KEY_ID).")
    secret: SecretStr | None = Field(None, description="Secret key (prefer the environment: AWS_SECRET_ACCESS_KEY).")
    region: str | None = None
    retries: int = Field(5, ge=0, description="Retries of a storage call after a transient error (backoff).")
    deadline_s: float = Field(120, gt=0, description="No retry of a storage call starts later than this many "
                              "seconds after its first attempt: an unreachable or failing store stops the run "
                              "within about this long.")
    timeout_s: float = Field(60, gt=0, description="Seconds one S3 request may take to connect, and to read.")

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(retries=self.retries, deadline_s=self.deadline_s)

    def fsspec_options(self, uri: str | None = None) -> dict[str, Any]:
        """Keyword arguments for fsspec to reach `uri` (default: the store's root): these settings serve any
        s3:// file of the run (data files too); empty for local paths. Secrets appear here and nowhere else."""
        if not (uri or self.uri).startswith(("s3://", "s3a://")):
            return {}
        opts: dict[str, Any] = {}
        client: dict[str, Any] = {}
        if self.endpoint_url:
            client["endpoint_url"] = self.endpoint_url
        if self.region:
            client["region_name"] = self.region
        if client:
            opts["client_kwargs"] = client
        if self.profile:
            opts["profile"] = self.profile
        if self.key and self.secret:
            opts["key"], opts["secret"] = self.key.get_secret_value(), self.secret.get_secret_value()
        return opts

    def run_store_options(self) -> dict[str, Any]:
        """fsspec_options for the run store: botocore tries each request once (and the run store sets s3fs's
        `retries` to 1), so the run store's RetryPolicy is the only retry layer. Data files keep the clients'
        own retries: they are read once, outside that layer."""
        opts = self.fsspec_options()
        if self.uri.startswith(("s3://", "s3a://")):
            opts["config_kwargs"] = {"retries": {"total_max_attempts": 1, "mode": "standard"},
                                     "connect_timeout": self.timeout_s, "read_timeout": self.timeout_s}
        return opts
