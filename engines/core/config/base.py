"""What every section of the configuration tree shares: unknown keys refused, assignments checked, and the rule
for names that become folder or file names."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def nodes_field(workers: str) -> Any:
    return Field(1, gt=0, description=f"Ray nodes the {workers} are spread over, num_workers / nodes on each (one "
                 "placement group per node, packed on it); checked against the cluster before any worker starts.")


def _not_only_dots(name: str) -> str:
    # the pattern lets dots in (v1.2, run.a); made only of dots, a name is a path step out of its folder
    if set(name) == {"."}:
        raise ValueError(f"{name!r} is not a usable name: it becomes a folder or file name, where '.' is the folder "
                         "itself and '..' its parent (a run named so would be written outside the run store); use "
                         "letters, digits, '_', '-' and '.' with at least one character that is not a dot")
    return name


# The names a recipe gives (a run: its folder in the store; a replayed run; an evaluation, a dataset, a reward source:
# MLflow names and file names). The pattern sits on the type, not on each Field, so the JSON schema of an optional
# name keeps it; the dots rule adds nothing to the schema.
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN), AfterValidator(_not_only_dots)]
