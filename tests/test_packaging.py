"""Packaging: the repo's top-level folders install under one `rlflow` namespace, never as top-level
`engines`, `flows`, `tasks` or `examples` packages that would collide with others of those names."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"flows": "rlflow.flows", "tasks": "rlflow.tasks", "engines": "rlflow.engines", "examples": "rlflow.examples",
           "deployments": "rlflow.deployments"}


def test_every_package_folder_is_installed_under_rlflow() -> None:
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {name: folder for folder, name in FOLDERS.items()}
    found = sorted(
        f"{FOLDERS[init.relative_to(REPO).parts[0]]}{''.join('.' + p for p in init.parent.relative_to(REPO).parts[1:])}"
        for folder in FOLDERS for init in (REPO / folder).rglob("__init__.py")
    )
    assert sorted(setup["packages"]) == found, "a package folder is missing from pyproject's packages (or gone)"


def test_the_installed_names_outside_the_repo(tmp_path: Path) -> None:
    """From another directory (the repo not on sys.path), rlflow.* imports from the install and the bare folder
    names do not exist."""
    code = ("import importlib.util as u; import rlflow.engines.session.rl, rlflow.flows.cli; "
            "print([n for n in ('engines', 'flows', 'tasks', 'examples') if u.find_spec(n) is not None])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_backends_import_without_ray_prefect_or_mlflow(tmp_path: Path) -> None:
    """The GPU machines that run bench/ drive the backend classes directly and have no Ray (nor Prefect or
    MLflow): the train and rollout backends must import without them."""
    code = ("import sys; sys.modules.update(ray=None, prefect=None, mlflow=None); "
            "import rlflow.engines.train.torch_backend, rlflow.engines.rollout.torch_backend")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
