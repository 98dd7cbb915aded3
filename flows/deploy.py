"""`prefect deploy` from prefect.yaml, with one client fix: `python -m rlflow.flows.deploy --all`.

Arguments go to Prefect's own `prefect deploy` command unchanged (it reads prefect.yaml in the working
directory). The fix: after creating each deployment, `prefect deploy` (and `flow.deploy`) of Prefect 3.8.8
ask the API for the pool's online workers with `"offset": null, "limit": null` in the body, which the
server's FastAPI (0.154 here) rejects with a 422, so `--all` stops after the first deployment. The fix
sends the server's defaults instead. With a Prefect whose client omits them, plain `prefect deploy --all`
does the same thing.
"""

from __future__ import annotations

import functools
import sys

from prefect.client.orchestration._work_pools.client import WorkPoolAsyncClient, WorkPoolClient


def _patch_worker_query() -> None:
    for cls in (WorkPoolAsyncClient, WorkPoolClient):
        original = cls.read_workers_for_work_pool

        @functools.wraps(original)
        def read_workers(self, work_pool_name, worker_filter=None, offset=None, limit=None, _original=original):
            return _original(self, work_pool_name, worker_filter, 0 if offset is None else offset,
                             200 if limit is None else limit)

        cls.read_workers_for_work_pool = read_workers


def main(argv: list[str]) -> None:
    _patch_worker_query()
    from prefect.cli import app  # deferred until after the patch: the CLI's commands bind the clients when imported

    sys.argv = ["prefect", "--no-prompt", "deploy", *argv]
    app()


if __name__ == "__main__":
    main(sys.argv[1:])
