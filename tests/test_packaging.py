"""Packaging: the repo's top-level folders install under one `rlflow` namespace, never as top-level
`engines`, `flows`, `tasks` or `examples` packages that would collide with others of those names."""

from __future__ import annotations

import os
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


def test_rlflow_init_from_a_plain_install(tmp_path: Path) -> None:
    """A wheel (what a plain `pip install` unpacks) carries prefect.yaml and the recipes as rlflow.deployments, and
    its `rlflow init` writes them into a project directory: nothing is read from a checkout."""
    import shutil
    import zipfile

    src = tmp_path / "src"
    for folder in FOLDERS:  # the sources a clean clone has, built outside the checkout (no build/ left in it)
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("rlflow-*.whl"))
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")  # a pure-Python wheel's install is its unpacked files
    project = tmp_path / "project"
    project.mkdir()
    code = "import rlflow.flows.cli as c, rlflow.deployments as d; print(d.__file__); c.main(['init'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0].startswith(str(tmp_path / "site"))  # the wheel's package, not the checkout
    for name in ("prefect.yaml", "deployments/sort-tiny.yaml", "deployments/eval-sort-tiny.yaml",
                 "deployments/pipeline-sort-tiny.yaml"):
        assert (project / name).read_text() == (REPO / "deployments" / Path(name).name).read_text(), name


# floors below the tested minor release, each with where it was run
FLOORS_RUN_ELSEWHERE = {
    "torch": "2.11: the GPU machine's torch (bench/ runs, docs/benchmarks.md)",
    "transformers": "5.17: the GPU machine's transformers",
    "megatron-core": "0.16: the newest for Python 3.11 here; 0.19 on the GPU machine",
}


def test_declared_lower_bounds_are_versions_that_were_tested() -> None:
    """Every dependency declares a floor, and the floor is the minor release constraints.txt pins (what CI
    installs), or one named above with where it ran: a floor nothing ran with is not declared."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (root / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = Version(version.strip())
    declared = project["dependencies"] + [d for extra in ("megatron", "math", "liger", "dev")
                                          for d in project["optional-dependencies"][extra]]
    for text in declared:
        req = Requirement(text)
        name = req.name.lower()
        if name == "rlflow":
            continue
        floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert floors, f"{text}: no lower bound"
        pin = pins[name]
        assert floors[0] <= pin, f"{text}: the floor is above what constraints.txt tests ({pin})"
        if name not in FLOORS_RUN_ELSEWHERE:
            assert floors[0].release[:2] == pin.release[:2], f"{text}: floor {floors[0]}, tested {pin}"
        assert req.specifier.contains(pin), f"{text} excludes the tested {pin}"
