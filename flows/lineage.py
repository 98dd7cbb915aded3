"""Lineage of registered model versions: the tags registration writes, and `rlflow lineage` reading them back.

Every version the pipeline registers carries where it came from (docs/operations.md, "Promotion and lineage"):
content hashes of its data files, the recipe's hash, the code commit and rlflow version, the parent model (the
training recipe's model.path: an HF directory or hub id, a run-store checkpoint, a registered version as
name@version, or the built-in tiny model), the run store, the committed step and the weight version.
`rlflow lineage NAME@VERSION` (or NAME@ALIAS) prints that chain back to a base model that is not registered,
following the parent whenever it names another registered version or a checkpoint some version was made from.

No Prefect here: the CLI imports this module alone (MLflow and fsspec).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from rlflow.engines.core.config import StorageConfig
from rlflow.engines.store.run_store import RunStore, StorageError, locate_checkpoint

DATA_TAG = "rlflow.lineage.data."  # + train / eval / sft: sha256 of the file's bytes
FILE_TAG = "rlflow.lineage.file."  # + the same name: the path the recipe gave
DATA_FILES = (("train", ("data", "train_path")), ("eval", ("data", "eval_path")), ("sft", ("sft", "train_path")))
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
CHUNK = 1 << 20


class LineageError(LookupError):
    """A model, version or alias that is not in the registry: the message names it."""


# ---- what registration records -------------------------------------------------------------------------------
def file_sha256(path: str, storage: StorageConfig) -> str:
    """sha256 of a file's bytes, local or any fsspec URL (s3:// with the run's endpoint and credentials)."""
    digest = hashlib.sha256()
    with fsspec.open(path, "rb", **storage.fsspec_options(path)) as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def data_tags(recipe: dict, storage: StorageConfig) -> dict[str, str]:
    """`rlflow.lineage.data.<name>` (sha256) and `rlflow.lineage.file.<name>` (path) of each data file the
    training recipe names: train_path, eval_path, sft.train_path. A file that cannot be read is tagged so, not
    skipped: its absence is part of the record."""
    tags = {}
    for name, (section, key) in DATA_FILES:
        path = (recipe.get(section) or {}).get(key)
        if not path:
            continue
        try:
            tags[DATA_TAG + name] = file_sha256(str(path), storage)
        except (OSError, ValueError) as e:
            tags[DATA_TAG + name] = f"unreadable ({type(e).__name__})"
        tags[FILE_TAG + name] = str(path)
    return tags


def rlflow_version() -> str:
    try:
        return importlib.metadata.version("rlflow")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def builtin_model(model: dict, seed: int) -> str:
    """The name of the tiny model a recipe without model.path builds from its `model:` settings and seed."""
    return (f"builtin:{model.get('arch', 'llama')}-{model.get('hidden_size')}x{model.get('num_layers')} "
            f"seed={seed}")


def registered_ref(text: str) -> tuple[str, str] | None:
    """(name, version or alias) when `text` names a registered model: models:/NAME/VERSION, models:/NAME@ALIAS,
    or NAME@VERSION / NAME@ALIAS (no '/' in it, not an existing path); else None."""
    if text.startswith("models:/"):
        rest = text.removeprefix("models:/")
        if "@" in rest:
            name, alias = rest.rsplit("@", 1)
            return name, alias
        name, _, version = rest.rpartition("/")
        return (name, version) if name and version.isdigit() else None
    if "@" in text and "/" not in text and not Path(text).exists():
        name, ref = text.rsplit("@", 1)
        return (name, ref) if name and ref else None
    return None


def checkpoint_uri(text: str, storage: StorageConfig) -> str | None:
    """The canonical URI (`RunStore.uri`) of a run-store checkpoint named by `text` (<store>/<run>/checkpoints/<step>,
    optionally its model/ folder), as registration tags rlflow.checkpoint; None if it is not one."""
    path = text.rstrip("/").removesuffix("/model")
    if "/checkpoints/" not in path:
        return None
    try:
        store, step = locate_checkpoint(path, storage)
    except (StorageError, ValueError, OSError):
        return None
    return store.uri("checkpoints", step)


def parent_model(recipe: dict, client: MlflowClient, storage: StorageConfig) -> str:
    """The training run's base model as lineage names it: name@version for a registered model (an alias resolved
    to the version it points at now), a checkpoint's canonical URI, an HF directory's absolute path or hub id, or
    builtin:<arch>-<hidden>x<layers> seed=<seed> for the tiny model built from `model:`."""
    model = recipe.get("model") or {}
    path = model.get("path")
    if not path:
        return builtin_model(model, int(recipe.get("seed", 0)))
    ref = registered_ref(path)
    if ref is not None:
        name, version = ref
        if not version.isdigit():
            try:
                version = client.get_model_version_by_alias(name, version).version
            except MlflowException:
                return path  # unresolvable now: recorded as given
        return f"{name}@{version}"
    if (uri := checkpoint_uri(path, storage)) is not None:
        return uri
    local = Path(path)
    return str(local.resolve()) if local.is_dir() else path


def lineage_tags(store: RunStore, step: int, client: MlflowClient, storage: StorageConfig, recipe_hash: str,
                 code_commit: str | None) -> dict[str, str]:
    """Every lineage tag of a version made from checkpoint `step` of `store`'s run, read from the run's stored
    config.json (what it trained with) and the checkpoint's meta.json; the recipe hash and code commit are given
    (flows/register.py takes them from the training run's MLflow tags where it can)."""
    recipe = store.read_json("config.json") if store.exists("config.json") else {}
    meta = store.read_json("checkpoints", step, "meta.json")
    return data_tags(recipe, storage) | {
        "rlflow.recipe_hash": recipe_hash,
        "rlflow.code_commit": code_commit or "unknown",
        "rlflow.version": rlflow_version(),
        "rlflow.parent_model": parent_model(recipe, client, storage),
        "rlflow.run_store": store.uri(),
        "rlflow.step": str(step),
        "rlflow.weight_version": str(meta.get("weight_version", step + 1)),
    }


# ---- reading the chain back ----------------------------------------------------------------------------------
def split_ref(text: str) -> tuple[str, str]:
    """NAME@VERSION or NAME@ALIAS (models:/ forms too) -> (name, version or alias)."""
    ref = registered_ref(text) if text.startswith("models:/") else None
    if ref is None and "@" in text:
        name, version = text.rsplit("@", 1)
        ref = (name, version) if name and version else None
    if ref is None:
        raise LineageError(f"{text!r}: expected NAME@VERSION or NAME@ALIAS (e.g. sort-tiny@3, sort-tiny@champion)")
    return ref


def resolve_version(client: MlflowClient, name: str, ref: str) -> ModelVersion:
    """The version `ref` (a number or an alias) of model `name`; LineageError naming what is missing."""
    try:
        client.get_registered_model(name)
    except MlflowException as e:
        raise LineageError(f"no registered model {name!r} in {client.tracking_uri}") from e
    try:
        return client.get_model_version(name, ref) if ref.isdigit() else client.get_model_version_by_alias(name, ref)
    except MlflowException as e:
        what = f"version {ref}" if ref.isdigit() else f"alias {ref!r}"
        aliases = client.get_registered_model(name).aliases
        known = f" (aliases: {', '.join(f'{a}={v}' for a, v in aliases.items())})" if aliases else " (no aliases)"
        raise LineageError(f"model {name!r} has no {what} in {client.tracking_uri}{known}") from e


def version_from_checkpoint(client: MlflowClient, uri: str, prefer: str) -> ModelVersion | None:
    """The registered version made from checkpoint `uri` (tag rlflow.checkpoint), of model `prefer` if several."""
    try:
        found = list(client.search_model_versions(f"tags.`rlflow.checkpoint` = '{uri}'"))
    except MlflowException:
        return None
    found.sort(key=lambda v: (v.name != prefer, int(v.version)))
    return found[0] if found else None


def registered_parent(client: MlflowClient, child: ModelVersion) -> ModelVersion | None:
    """The registered version `child`'s rlflow.parent_model names, directly or through its checkpoint; None at a
    base that is not registered."""
    parent = child.tags.get("rlflow.parent_model")
    if not parent:
        return None
    ref = registered_ref(parent)
    if ref is not None:
        try:
            return resolve_version(client, *ref)
        except LineageError:
            return None
    return version_from_checkpoint(client, parent, child.name)


@dataclass
class Lineage:
    """A version, its registered ancestors in order, and the base the chain ends at (None: no parent recorded)."""

    versions: list[ModelVersion]
    root: str | None


def lineage(client: MlflowClient, text: str) -> Lineage:
    """The chain from version `text` (NAME@VERSION or NAME@ALIAS) back to its base model."""
    versions = [resolve_version(client, *split_ref(text))]
    seen = {(versions[0].name, versions[0].version)}
    while (parent := registered_parent(client, versions[-1])) is not None:
        if (parent.name, parent.version) in seen:  # a cycle can only come from hand-edited tags: stop there
            break
        seen.add((parent.name, parent.version))
        versions.append(parent)
    return Lineage(versions, versions[-1].tags.get("rlflow.parent_model"))


def describe(v: ModelVersion, aliases: list[str]) -> Iterator[str]:
    """The lines of one version in `rlflow lineage`'s output."""
    t = v.tags
    yield f"{v.name}@{v.version}  aliases: {', '.join(aliases) or '-'}"
    if "rlflow.promotion" in t:
        yield f"  promotion   {t['rlflow.promotion']}: {t.get('rlflow.promotion_reason', '-')}"
    if "rlflow.metric" in t:
        evaluation = f"  (evaluation {t['rlflow.eval_hash'][:16]})" if "rlflow.eval_hash" in t else ""
        yield f"  metric      {t['rlflow.metric']} = {t.get('rlflow.metric_value', '-')}{evaluation}"
    if "rlflow.checkpoint" in t:
        yield f"  checkpoint  {t['rlflow.checkpoint']}"
    if "rlflow.run_store" in t:
        yield (f"  run store   {t['rlflow.run_store']}  step {t.get('rlflow.step', '-')}  weight version "
               f"{t.get('rlflow.weight_version', '-')}")
    if "rlflow.recipe_hash" in t:
        yield (f"  recipe      sha256 {t['rlflow.recipe_hash']}  code {t.get('rlflow.code_commit', '-')}  rlflow "
               f"{t.get('rlflow.version', '-')}")
    for key in sorted(k for k in t if k.startswith(DATA_TAG)):
        name = key.removeprefix(DATA_TAG)
        yield f"  data        {name}: sha256 {t[key]}  {t.get(FILE_TAG + name, '')}".rstrip()
    if "rlflow.export_check" in t:
        yield f"  export      {t['rlflow.export_check']}"
    yield f"  parent      {t.get('rlflow.parent_model', '(no lineage recorded)')}"


def format_lineage(client: MlflowClient, chain: Lineage) -> str:
    """The chain as `rlflow lineage` prints it: a block per version (its parent line saying which registered
    version the parent is), then the root."""
    lines = []
    for i, v in enumerate(chain.versions):
        aliases = sorted(a for a, n in client.get_registered_model(v.name).aliases.items() if str(n) == str(v.version))
        lines += describe(v, aliases)
        if i + 1 < len(chain.versions):
            parent = chain.versions[i + 1]
            lines[-1] += f"  (registered: {parent.name}@{parent.version})"
    lines.append(f"root: {chain.root} (not a registered version)" if chain.root else "root: unknown (no parent "
                 "recorded: registered before lineage tags, or by hand)")
    return "\n".join(lines)


def print_lineage(text: str, tracking_uri: str) -> int:
    """`rlflow lineage`: print the chain, or the error naming what is missing (exit status 2)."""
    try:
        if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
            raise LineageError(f"no MLflow database at {tracking_uri} (give --tracking-uri or MLFLOW_TRACKING_URI)")
        client = MlflowClient(tracking_uri)
        print(format_lineage(client, lineage(client, text)))
    except LineageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
