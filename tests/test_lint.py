"""The lint step CI runs: ruff, and the import-linter contracts of pyproject.toml that keep the layers one way
(docs/architecture.md). The contracts are also shown to fail on an upward import and on an import circle, and every
import inside a function of the installed packages says why it is not at the top of its module."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


# lint-imports through this interpreter, not the script's shebang: a copied virtualenv's scripts name the
# interpreter they were installed with, which would analyse that environment's rlflow instead of this one
LINT_IMPORTS = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]


def run(tool: str, *args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [*LINT_IMPORTS, *args] if tool == "lint-imports" else [str(BIN / tool), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_ruff() -> None:
    done = run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_layer_contracts_hold() -> None:
    done = run("lint-imports", "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout
    assert "Analyzed" in done.stdout and "KEPT" in done.stdout, done.stdout


def test_layer_contracts_catch_an_upward_import_and_a_circle(tmp_path: Path) -> None:
    """A copy of the package tree with deliberate faults: core importing session (upward), two data modules
    importing each other (a circle), a store module importing Prefect and bench/, a package under engines/ that no
    layer names, two of bench's areas importing each other and bench's harness importing an area. The copy comes
    first on the path, so it is what gets analysed."""
    for folder in ("flows", "tasks", "engines", "examples"):
        shutil.copytree(REPO / folder, tmp_path / "rlflow" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "bench", tmp_path / "bench", ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    engines = tmp_path / "rlflow" / "engines"
    with (engines / "core" / "batch.py").open("a") as f:
        f.write("\nimport rlflow.engines.session.rl  # deliberately upward\n")
    with (engines / "data" / "prompts.py").open("a") as f:
        f.write("\nimport rlflow.engines.data.builtin_tasks  # one half of a deliberate circle\n")
    with (engines / "data" / "builtin_tasks.py").open("a") as f:
        f.write("\nimport rlflow.engines.data.prompts  # the other half\n")
    with (engines / "store" / "run_store.py").open("a") as f:
        f.write("\nimport prefect  # Prefect below tasks\nimport bench.harness  # the package importing bench/\n")
    bench = tmp_path / "bench"
    with (bench / "e2e" / "workload.py").open("a") as f:
        f.write("\nimport bench.cpu.sweep  # one half of a circle between two areas\n")
    with (bench / "cpu" / "sweep.py").open("a") as f:
        f.write("\nimport bench.e2e.workload  # the other half\n")
    with (bench / "harness.py").open("a") as f:
        f.write("\nimport bench.train.scale  # the floor importing an area\n")
    (engines / "extras").mkdir()
    (engines / "extras" / "__init__.py").write_text("import rlflow.engines.core.batch\n")  # a package with no layer
    env = os.environ | {"PYTHONPATH": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", "import rlflow.engines.core as m; print(m.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True)
    assert probe.stdout.startswith(str(tmp_path)), probe.stdout + probe.stderr  # the copy is what is analysed
    done = run("lint-imports", "--no-cache", cwd=tmp_path, env=env)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "rlflow.engines.core.batch -> rlflow.engines.session.rl" in out, out
    assert "No cycles are allowed in rlflow.engines.data." in out, out
    assert "- .prompts -> .builtin_tasks" in out or "- .builtin_tasks -> .prompts" in out, out
    assert "rlflow.engines.store.run_store -> prefect" in out, out
    assert "rlflow.engines is not allowed to import bench:" in out, out
    assert "rlflow.engines.store.run_store -> bench.harness" in out, out
    assert "No cycles are allowed in bench." in out, out
    assert "- .e2e -> .cpu" in out or "- .cpu -> .e2e" in out, out
    assert "bench.harness is not allowed to import bench.train:" in out, out
    assert "- rlflow.engines.extras" in out, out  # the exhaustive layers contract inside engines/


def _deferred_import_groups(tree: ast.AST) -> list[list[ast.stmt]]:
    """Runs of consecutive import statements inside functions (one run: the imports of one block, in a row)."""
    groups, seen = [], set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if not isinstance(block, list):  # absent, or an expression (lambda, if-expression)
                    continue
                run: list[ast.stmt] = []
                for stmt in [*block, None]:
                    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        run.append(stmt)
                    elif run:
                        if run[0].lineno not in seen:
                            seen.add(run[0].lineno)
                            groups.append(run)
                        run = []
    return groups


def test_function_level_imports_say_why() -> None:
    """An import inside a function is the exception (an optional dependency such as megatron-core, math-verify or
    matplotlib; the CLI's start time; an import that must follow a patch or a setting): each run of them carries a
    comment on one of its lines or on the line just above. A normal dependency belongs at the top of the module."""
    bare = []
    for folder in ("flows", "tasks", "engines", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for run in _deferred_import_groups(ast.parse("\n".join(lines), str(path))):
                first, last = run[0].lineno, run[-1].end_lineno or run[-1].lineno
                said = any("#" in line for line in lines[first - 1:last]) or lines[first - 2].strip().startswith("#")
                if not said:
                    bare.append(f"{path.relative_to(REPO)}:{first}: {lines[first - 1].strip()}")
    assert not bare, "function-level imports without a reason comment (move them up, or say why):\n" + "\n".join(bare)
