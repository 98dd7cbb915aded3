"""The screenshots of the Prefect UI in docs/, taken by the browser tests that check what they show.

    python -m bench.figures.ui_screenshot [--out docs]

Runs tests/test_serve.py with RLFLOW_SCREENSHOTS set (tests/browser.py): `rlflow init` + `rlflow serve` in a
fresh project, then Chromium on the post-train run form (prefect-run-form.png), a run queued behind another on the
pool of one slot (ui-queued-run.png, ui-pool-one-slot.png) and the run the auto-resume automation resumed after
its process was killed (ui-auto-resumed-run.png); then tests/test_promotion.py, the MLflow registry after a
promotion (ui-registry-champion.png, ui-registry-rejected.png). About six minutes on 2 cores; needs a `chromium`
binary (Debian: apt-get install -y chromium). CI runs the same tests without saving the pictures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs", help="folder the PNGs are written to")
    args = ap.parse_args()
    env = os.environ | {"RLFLOW_SCREENSHOTS": str(args.out.resolve())}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_serve.py",
                           "tests/test_promotion.py", "-k", "run_form or full_pool or champion"], cwd=REPO, env=env)
    raise SystemExit(done.returncode)


if __name__ == "__main__":
    main()
