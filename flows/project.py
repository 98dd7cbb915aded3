"""A project directory for `rlflow serve` and `prefect deploy`: `rlflow init` writes prefect.yaml and the recipes its
deployments name, copied from the installed package (rlflow.deployments), so a plain `pip install rlflow` is enough.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import yaml

PREFECT_FILE = "prefect.yaml"


class ProjectError(RuntimeError):
    """A project directory that cannot be used or written; the message says what to do."""


def template_files() -> dict[str, str]:
    """{path relative to the project: text} of prefect.yaml and every recipe its deployments name (a pipeline's
    training recipe too), as installed with the package."""
    source = files("rlflow.deployments")
    prefect_yaml = source.joinpath(PREFECT_FILE).read_text()
    out = {PREFECT_FILE: prefect_yaml}
    for deployment in yaml.safe_load(prefect_yaml)["deployments"]:
        recipe = deployment["parameters"]["recipe"]
        text = source.joinpath(Path(recipe).name).read_text()
        out[recipe] = text
        train = (yaml.safe_load(text) or {}).get("train_recipe")
        if train:
            out[train] = source.joinpath(Path(train).name).read_text()
    return out


def init_project(directory: Path) -> list[Path]:
    """Write the template files into `directory`; refuses (writing nothing) when any of them exists."""
    templates = template_files()
    existing = [directory / name for name in templates if (directory / name).exists()]
    if existing:
        raise ProjectError(
            "rlflow init: not overwriting " + ", ".join(map(str, existing)) + " (move them away, or edit them instead)"
        )
    written = []
    for name, text in templates.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def require_prefect_file(directory: Path) -> Path:
    """The project's prefect.yaml, or an error that says how to get one."""
    path = directory / PREFECT_FILE
    if not path.is_file():
        raise ProjectError(
            f"no {PREFECT_FILE} in {directory}: run `rlflow init` there to write a starting one "
            "(prefect.yaml and the demo recipes), or start with --no-deploy"
        )
    return path
