"""Recipes: YAML read, `--set` overrides applied, validated into a tree with every problem named; the flows'
merge of recipe, config and overrides; and the credential-free tree that is stored and logged."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from rlflow.engines.core.config.run import RLConfig

M = TypeVar("M", bound=BaseModel)


class RecipeError(ValueError):
    """A recipe that cannot run; the message lists every problem, one per line, each naming its field."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))


def _model_at(model: type[BaseModel] | None, loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that holds the field at `loc` (list indices skipped), where the path names one."""
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        models = [t for t in (field.annotation, *typing.get_args(field.annotation))
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        models += [t for a in typing.get_args(field.annotation) for t in typing.get_args(a)
                   if isinstance(t, type) and issubclass(t, BaseModel)]  # list[Section] / Section | None
        model = models[0] if len(models) == 1 else None
    return model


def unknown_key_message(model: type[BaseModel] | None, loc: tuple) -> str:
    """'unknown key', with the closest known key at that place ("did you mean 'steps'?") when there is one."""
    parent = _model_at(model, loc[:-1])
    if parent is None or not loc:
        return "unknown key"
    close = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields), n=1, cutoff=0.6)
    return f"unknown key; did you mean '{close[0]}'?" if close else "unknown key"


def _format_errors(err: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    out = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<recipe>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = unknown_key_message(model, tuple(e["loc"]))
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and e["type"] not in ("value_error",):
            msg = f"{msg} (got {e['input']!r})"
        out.append(f"{field}: {msg}")
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=c' -> (['a', 'b'], value), the value parsed as YAML so numbers and lists keep their types."""
    if "=" not in text:
        raise RecipeError("--set", [f"{text!r}: expected KEY.PATH=VALUE"])
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise RecipeError("--set", [f"{text!r}: the value is not valid YAML ({e.problem}); quote a string: "
                                    f"{key}='{raw}'"]) from None
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError("--set", [f"{text!r}: {part} is not a section"])
        node[path[-1]] = value
    return raw


def load_recipe(path: str | Path, overrides: list[str] | None = None, model: type[M] | None = None) -> M:
    """Read a YAML recipe, apply `--set` overrides, validate. Raises RecipeError naming every bad field.

    `model` is the tree the recipe is for: RLConfig (the default), EvaluationConfig or PipelineConfig."""
    return config_from_dict(read_recipe(path, overrides), source=str(path), model=model)


def read_recipe(path: str | Path, overrides: list[str] | None = None) -> dict:
    """A YAML recipe as a dict with `--set` overrides applied, not yet validated (`rlflow validate` checks the
    valid sections of an invalid one too). Raises RecipeError for a missing file or bad YAML."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(str(path), ["recipe file not found"])
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(str(path), [f"not valid YAML: {e}"]) from None
    if not isinstance(raw, dict):
        raise RecipeError(str(path), ["top level must be a mapping of sections"])
    return apply_overrides(raw, overrides or [])


def valid_sections(raw: dict) -> tuple[RLConfig, set[str]]:
    """An RLConfig of the sections of `raw` that are valid on their own (defaults where a section is absent), not
    checked as a whole, and the names of the invalid or missing required sections: checks that need only valid
    sections can run on a recipe that fails validation."""
    good: dict[str, BaseModel] = {}
    bad: set[str] = set()
    for name, field in RLConfig.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue
        if name not in raw:
            if field.is_required():
                bad.add(name)
            continue
        try:
            good[name] = section.model_validate(raw[name])
        except ValidationError:
            bad.add(name)
    return RLConfig.model_construct(**good), bad


def config_from_dict(raw: dict, source: str = "<config>", model: type[M] | None = None) -> M:
    try:
        return (model or RLConfig).model_validate(raw)
    except ValidationError as e:
        raise RecipeError(source, _format_errors(e, model or RLConfig)) from None


def resolve_config(model: type[M], config: M | dict | None, recipe: str | None, overrides: list[str] | None) -> M:
    """A flow's configuration from its parameters, by the merge rule of docs/deployments.md: the recipe file
    (`recipe`, relative to the working directory, read with the CLI's loader) is the base; a given `config` (the
    whole tree, as the UI's run form sends it, or any part of it, as an API call may) is deep-merged over it:
    mappings key by key, any other value (a list too) replacing the recipe's; `overrides` ('a.b=value', as
    `--set`) apply last. The flows take their parameters unvalidated (a part of the tree is not a valid tree),
    so each parameter's type is checked here."""
    if recipe is not None and not isinstance(recipe, str):
        raise RecipeError("parameters", [f"recipe: expected a recipe file path (a string), got {recipe!r}"])
    if overrides is not None and not (isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)):
        raise RecipeError("parameters", [f"overrides: expected a list of KEY.PATH=VALUE strings, got {overrides!r}"])
    if isinstance(config, model) and not recipe and not overrides:
        return config
    if config is None and not recipe:
        raise RecipeError("parameters", ["config or recipe: one of them is required"])
    raw = read_recipe(recipe) if recipe else {}
    if config is not None:
        raw = deep_merge(raw, _tree(config))
    source = " + ".join(filter(None, [recipe, None if config is None else "config"]))
    return config_from_dict(apply_overrides(raw, overrides or []), source=source, model=model)


def deep_merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`: where both hold a mapping, key by key; otherwise `over`'s value."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _tree(config: BaseModel | dict) -> dict:
    """A `config` parameter as a plain tree: a model dumped whole, its credentials kept (model_dump masks them)."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, BaseModel):
        raise RecipeError("parameters", [f"config: expected a mapping of sections (the configuration tree), "
                                         f"got {type(config).__name__} {config!r}"])
    raw = config.model_dump(mode="json", exclude_unset=False, round_trip=True)
    for section, secret_fields in _secrets(config).items():
        raw[section].update(secret_fields)
    return raw


def public_tree(config: BaseModel) -> dict:
    """A config as JSON without credentials: what is stored, logged, and given as a flow's `config` parameter
    (a deployment's default, a pipeline's stage run); the worker's environment gives the credentials."""
    return config.model_dump(mode="json", exclude={"storage": {"key", "secret"}})


def _secrets(config: BaseModel) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name in type(config).model_fields:
        section = getattr(config, name)
        if isinstance(section, BaseModel):
            found = {k: v.get_secret_value() for k, v in section if isinstance(v, SecretStr)}
            if found:
                out[name] = found
    return out
