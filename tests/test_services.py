"""External services fail fast: one retry layer with a deadline, attempts counted at the server, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from rlflow.engines.cluster.addresses import free_port
from rlflow.engines.core.config import StorageConfig
from rlflow.engines.core.retry import RetriesExhausted, RetryPolicy
from rlflow.engines.store.run_store import RunStore, StorageError
from rlflow.tasks.mlflow_client import RetryingClient
from tests.conftest import small_recipe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Unavailable(BaseHTTPRequestHandler):
    """Every request gets a 503 (S3's SlowDown body, which MLflow reads as a 503 too); requests are counted."""

    hits: list[str]

    def _reply(self) -> None:
        self.hits.append(f"{self.command} {self.path}")  # the body is not read (botocore waits for 100-continue)
        self.close_connection = True
        body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _reply

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def unavailable() -> Iterator[tuple[str, list[str]]]:
    """(URL of a server answering 503 to everything, the requests it got)."""
    hits: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_Unavailable,), {"hits": hits}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hits
    server.shutdown()
    server.server_close()


def _s3(endpoint: str, **kw) -> StorageConfig:
    return StorageConfig(uri="s3://bucket/runs", endpoint_url=endpoint, **kw)


def test_a_persistent_s3_error_costs_one_request_per_retry(unavailable, monkeypatch):
    """storage.retries: 2 means 3 HTTP requests in all (before: rlflow x s3fs x botocore, 3 x 5 x 5)."""
    url, hits = unavailable
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    store = RunStore(_s3(url, retries=2), "r", backoff_s=0.01)
    with pytest.raises(StorageError, match=r"write s3://bucket/runs/r/f: transient error, gave up after 3 attempts"):
        store.write_bytes(b"x", "f")
    assert len(hits) == 3, hits


def test_the_deadline_stops_retrying(unavailable, monkeypatch):
    """Many retries allowed, a 1 s deadline: the call gives up within about a second, and every attempt the
    error counts is one request at the server."""
    url, hits = unavailable
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    store = RunStore(_s3(url, retries=1000, deadline_s=1.0), "r", backoff_s=0.05)
    # the first call also builds the S3 client (seconds on a loaded machine): warm it, then count from zero
    with pytest.raises(StorageError):
        store.write_bytes(b"x", "f")
    hits.clear()
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"gave up after (\d+) attempts in .* deadline 1 s") as err:
        store.write_bytes(b"x", "f")
    assert time.monotonic() - t0 < 10  # 1 s and one request's worth; was minutes
    attempts = int(str(err.value).split("gave up after ")[1].split()[0])
    assert 2 <= attempts == len(hits) < 100


def test_a_missing_bucket_is_named_with_its_endpoint(s3_server):
    store = RunStore(StorageConfig(uri="s3://no-such-bucket-here/runs", endpoint_url=s3_server), "r")
    with pytest.raises(
        StorageError,
        match=rf"bucket 'no-such-bucket-here' does not exist at endpoint {s3_server} "
        r"\(storage.uri s3://no-such-bucket-here/runs\)",
    ):
        store.write_json({"a": 1}, "config.json")


def test_a_failing_tracking_server_costs_one_request_per_retry(unavailable):
    """MLflow's own retries (7, with backoff: minutes) are off: retries 2 are 3 requests, then an error naming
    the tracking URI."""
    url, hits = unavailable
    client = RetryingClient(url, RetryPolicy(retries=2, deadline_s=60, backoff_s=0.01), timeout_s=5)
    with pytest.raises(
        RetriesExhausted,
        match=rf"MLflow get_experiment_by_name at {url}: transient error, "
        r"gave up after 3 attempts",
    ):
        client.get_experiment_by_name("x")
    assert len(hits) == 3, hits


def test_an_unreachable_tracking_server_fails_within_the_deadline():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    client = RetryingClient(url, RetryPolicy(retries=1000, deadline_s=1.0, backoff_s=0.05), timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(RetriesExhausted, match=rf"MLflow create_experiment at {url}: .*deadline 1 s"):
        client.create_experiment("x")
    assert time.monotonic() - t0 < 10  # was 4.5 minutes


def test_validate_probes_the_store_and_the_tracking_server(tmp_path, s3_bucket, s3_server, capsys):
    from rlflow.flows.cli import main

    def validate(storage: dict, tracking: str, *flags: str) -> tuple[int, list[str]]:
        raw = small_recipe(tmp_path, storage=storage, tracking={"uri": tracking})
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
        rc = main(["validate", str(tmp_path / "r.yaml"), *flags])
        return rc, [line[4:] for line in capsys.readouterr().err.splitlines() if line.startswith("  - ")]

    root, endpoint = s3_bucket
    assert validate({"uri": root, "endpoint_url": endpoint}, f"sqlite:///{tmp_path}/mlflow.db") == (0, [])
    assert not (tmp_path / "mlflow.db").exists()  # a sqlite URI is checked, not created
    dead = f"http://127.0.0.1:{free_port()}"
    rc, problems = validate({"uri": "s3://no-such-bucket-here/runs", "endpoint_url": s3_server}, dead)
    assert rc == 2 and [p.split(":")[0] for p in problems] == ["storage.uri", "tracking.uri"], problems
    assert f"bucket 'no-such-bucket-here' does not exist at endpoint {s3_server}" in problems[0]
    assert problems[1].startswith("tracking.uri: MLflow is not reachable") and dead in problems[1]
    assert validate({"uri": "s3://no-such-bucket-here/runs", "endpoint_url": s3_server}, dead, "--offline")[0] == 0


def test_a_run_in_a_missing_bucket_stops_before_preparing_anything(tmp_path, s3_server):
    from rlflow.engines.core.config import config_from_dict
    from rlflow.tasks.run_context import open_run

    cfg = config_from_dict(
        small_recipe(tmp_path, storage={"uri": "s3://no-such-bucket-here/runs", "endpoint_url": s3_server})
    )
    with pytest.raises(StorageError, match=rf"bucket 'no-such-bucket-here' does not exist at endpoint {s3_server}"):
        open_run(cfg)
    assert not (tmp_path / "data").exists()  # the data files were not generated yet


def test_runs_in_a_missing_folder_or_bucket_is_an_error(tmp_path, s3_bucket, s3_server, capsys):
    """`rlflow runs` said "no runs" (rc 0) for a store root that is not there; an empty one still says so."""
    from rlflow.flows.cli import main

    def runs(store: str, *flags: str) -> tuple[int, str]:
        rc = main(["runs", "--store", store, *flags])
        out = capsys.readouterr()
        return rc, out.out + out.err

    missing = tmp_path / "nowhere"
    rc, text = runs(str(missing))
    assert rc == 2 and text.startswith(f"error: run store {missing}: no such folder"), text
    (tmp_path / "empty").mkdir()
    assert runs(str(tmp_path / "empty")) == (0, f"no runs in {tmp_path / 'empty'}\n")
    rc, text = runs("s3://no-such-bucket-here/runs", "--set", f"storage.endpoint_url={s3_server}")
    assert rc == 2 and text.startswith("error: ") and (
        f"bucket 'no-such-bucket-here' does not exist at endpoint {s3_server}" in text), text
    root, endpoint = s3_bucket  # a bucket without objects under the prefix: an empty store (S3 has no folders)
    assert runs(root, "--set", f"storage.endpoint_url={endpoint}") == (0, f"no runs in {root}\n")


def test_unreachable_services_are_one_line_errors(tmp_path, capsys, monkeypatch):
    """export, resume and trace render against a store endpoint or an MLflow server where nothing listens: rc 2
    and one line naming the service and its URI (before: a traceback, rc 1)."""
    from rlflow.flows.cli import main

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    dead = f"http://127.0.0.1:{free_port()}"
    quick = ["--set", f"storage.endpoint_url={dead}", "--set", "storage.deadline_s=1"]
    for command in (["export", "r", str(tmp_path / "out"), "--store", "s3://bucket/runs", *quick],
                    ["resume", "r", "--store", "s3://bucket/runs", *quick]):
        assert main(command) == 2, command
        err = capsys.readouterr().err  # the retry layer's warnings (a retry each), then the error
        assert "Traceback" not in err, err
        last = err.splitlines()[-1]
        assert last.startswith("error: ") and "s3://bucket/runs/r/" in last and dead in last, err

    store = RunStore(str(tmp_path / "runs"), "r")  # a run whose MLflow server is gone
    store.write_json({"tracking": {"uri": dead}}, "config.json")
    store.write_json({"status": "finished", "mlflow_run_id": "0"}, "status.json")
    assert main(["trace", "render", "r", "--out", str(tmp_path / "t.png"), "--store", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"error: MLflow list_artifacts at {dead}: transient error"), err


def _rlflow_run(recipe, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlflow.flows.cli", "run", str(recipe)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_run_with_an_unreachable_prefect_api_or_mlflow_server_is_a_named_error(tmp_path):
    """`rlflow run` with PREFECT_API_URL where nothing answers stops before the flow, naming the URL; with an MLflow
    server where nothing listens the flow fails, and the CLI prints the retry layer's error (the service, its URI)
    as its last line, with no traceback from Prefect's log of the failed flow run: rc 2 both."""
    dead_api, dead_mlflow = f"http://127.0.0.1:{free_port()}/api", f"http://127.0.0.1:{free_port()}"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(small_recipe(
        tmp_path, cluster={"use_ray": False}, train={"steps": 1}, eval={"every": 0},
        tracking={"uri": dead_mlflow, "deadline_s": 1, "timeout_s": 2})))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(tmp_path / "prefect")}

    done = _rlflow_run(recipe, env | {"PREFECT_API_URL": dead_api})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: the Prefect API at {dead_api} (PREFECT_API_URL) does not answer"), (
        done.stderr)

    done = _rlflow_run(recipe, env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: MLflow get_experiment_by_name at {dead_mlflow}: transient error"), last
