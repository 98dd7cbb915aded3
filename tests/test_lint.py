"""The lint step CI runs: ruff, and the import-linter contracts of pyproject.toml that keep the layers one way
(docs/architecture.md). The contracts are also shown to fail on an upward import and on an import circle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(tool: str, *args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / tool), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_ruff() -> None:
    done = run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_layer_contracts_hold() -> None:
    done = run("lint-imports")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_layer_contracts_catch_an_upward_import_and_a_circle(tmp_path: Path) -> None:
    """A copy of the package tree with two deliberate faults: core importing session (upward), and two data
    modules importing each other (a circle). The copy comes first on the path, so it is what gets analysed."""
    for folder in ("flows", "tasks", "engines", "examples"):
        shutil.copytree(REPO / folder, tmp_path / "rlflow" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    engines = tmp_path / "rlflow" / "engines"
    with (engines / "core" / "batch.py").open("a") as f:
        f.write("\nimport rlflow.engines.session.rl  # deliberately upward\n")
    with (engines / "data" / "prompts.py").open("a") as f:
        f.write("\nimport rlflow.engines.data.builtin_tasks  # one half of a deliberate circle\n")
    with (engines / "data" / "builtin_tasks.py").open("a") as f:
        f.write("\nimport rlflow.engines.data.prompts  # the other half\n")
    env = os.environ | {"PYTHONPATH": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", "import rlflow.engines.core as m; print(m.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True)
    assert probe.stdout.startswith(str(tmp_path)), probe.stdout + probe.stderr  # the copy is what is analysed
    done = run("lint-imports", cwd=tmp_path, env=env)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "rlflow.engines.core.batch -> rlflow.engines.session.rl" in out, out
    assert "No cycles are allowed in rlflow.engines.data." in out, out
    assert "- .prompts -> .builtin_tasks" in out or "- .builtin_tasks -> .prompts" in out, out
