"""Regenerate engines/core/sglang_flags.py: the launch_server flags of one SGLang release, read from its source.

SGLang cannot be installed beside rlflow (it pins its own torch), so the recipe checks `rollout.sglang.args`
against this checked-in table when sglang is not importable. The table comes from the `add_argument` calls of
`sglang/srt/server_args.py` in the release's wheel, read with `ast` (nothing of SGLang is imported or run):

    pip download --no-deps sglang==0.5.10.post1 -d /tmp/sglang
    python -m bench.rollout.sglang_server_flags /tmp/sglang/sglang-0.5.10.post1-py3-none-any.whl

Releases after 0.5.10 build their parser from dataclasses (sglang/srt/arg_groups/, e.g. 0.5.23), which this
reading does not follow: the script refuses such a wheel. For them, run it with `--installed` in the SGLang
environment (with rlflow installed there too: `pip install --no-deps -e <rlflow checkout>`): the table then comes
from that sglang's own parser, as recipe validation reads it when sglang is importable.

To support a newer SGLang: regenerate, review the diff of engines/core/sglang_flags.py (a renamed flag shows up
there), then walk the checklist in docs/rollout.md ("Moving to a newer SGLang").
"""

from __future__ import annotations

import argparse
import ast
import re
import zipfile
from pathlib import Path

MIN_FLAGS = 100  # 0.5.10.post1 has 365 option strings; far fewer means the parser is built another way
OUT = Path(__file__).resolve().parents[2] / "engines" / "core" / "sglang_flags.py"
SOURCE = "sglang/srt/server_args.py"
# argparse's own actions that take no value on the command line
ARGPARSE_SWITCHES = {
    "store_true",
    "store_false",
    "store_const",
    "append_const",
    "count",
    "help",
    "version",
    "argparse.BooleanOptionalAction",
    "BooleanOptionalAction",
}


def no_value_actions(tree: ast.AST) -> set[str]:
    """The file's own Action classes that take no value: those whose __init__ defaults `nargs` to 0, as SGLang's
    DeprecatedAction and DeprecatedStoreTrueAction do (argparse then consumes nothing after the flag)."""
    found = set()
    for node in ast.walk(tree):
        init = next((f for f in getattr(node, "body", []) if isinstance(f, ast.FunctionDef) and f.name == "__init__"),
                    None) if isinstance(node, ast.ClassDef) else None
        if init is None:
            continue
        positional = [*init.args.posonlyargs, *init.args.args]
        defaults = dict(zip([a.arg for a in positional[len(positional) - len(init.args.defaults):]],
                            init.args.defaults, strict=True))
        defaults |= {a.arg: d for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults, strict=True) if d}
        nargs = defaults.get("nargs")
        if isinstance(nargs, ast.Constant) and nargs.value == 0:
            found.add(node.name)
    return found


def takes_no_value(call: ast.Call, switches: set[str]) -> bool:
    """Whether an add_argument call's flag takes no value: a switch action, or `nargs=0` given in the call."""
    keywords = {k.arg: k.value for k in call.keywords}
    action = ast.unparse(keywords["action"]).strip("'\"") if "action" in keywords else "store"
    nargs = keywords.get("nargs")
    return action in switches or (isinstance(nargs, ast.Constant) and nargs.value == 0)


def flags_from_source(source: str) -> dict[str, tuple[str, str]]:
    """Every option string of the file's add_argument calls -> (the call's first option string, "switch" or
    "value")."""
    flags: dict[str, tuple[str, str]] = {}
    tree = ast.parse(source)
    switches = ARGPARSE_SWITCHES | no_value_actions(tree)
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
        ):
            continue
        options = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        options = [o for o in options if o.startswith("--")]
        if not options:
            continue
        action = next((ast.unparse(k.value).strip("'\"") for k in node.keywords if k.arg == "action"), "store")
        kind = "switch" if takes_no_value(node, switches) else "value"
        for option in options:
            flags[option] = (options[0], kind)
            if action.endswith("BooleanOptionalAction"):
                flags["--no-" + option[2:]] = (options[0], kind)
    if len(flags) < MIN_FLAGS:
        raise SystemExit(
            f"only {len(flags)} option strings in {SOURCE}: this release builds its parser another way "
            "(sglang/srt/arg_groups/); run with --installed in an environment with it installed"
        )
    return flags


def read_wheel(wheel: Path) -> tuple[str, str]:
    """(version, server_args.py's source) of an sglang wheel."""
    match = re.match(r"sglang-([^-]+)-", wheel.name)
    if not match:
        raise SystemExit(f"{wheel}: not an sglang wheel (sglang-<version>-...whl)")
    with zipfile.ZipFile(wheel) as z:
        return match.group(1), z.read(SOURCE).decode()


def entry(option: str, canonical: str, kind: str) -> str:
    """One table line, wrapped as ruff formats a line over 120 characters (the file stays format-clean)."""
    line = f'    "{option}": ("{canonical}", "{kind}"),'
    return line if len(line) <= 120 else f'    "{option}": (\n        "{canonical}",\n        "{kind}",\n    ),'


def render(version: str, flags: dict[str, tuple[str, str]]) -> str:
    lines = [
        f'"""launch_server flags of sglang {version}, generated by bench/rollout/sglang_server_flags.py from its',
        f"{SOURCE} (do not edit: regenerate).",
        'Option string -> (its canonical option string, "switch" | "value")."""',
        "",
        f'SGLANG_VERSION = "{version}"',
        "",
        "FLAGS: dict[str, tuple[str, str]] = {",
        *(entry(option, canonical, kind) for option, (canonical, kind) in sorted(flags.items())),
        "}",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "wheel", type=Path, nargs="?", help="An sglang wheel (pip download --no-deps sglang==<version>)."
    )
    parser.add_argument("--installed", action="store_true", help="Read the flags from the sglang installed here.")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.installed:
        # only this mode needs rlflow importable (the wheel mode runs with any python): validation's own reader
        from rlflow.engines.core.sglang_args import _importable_flags

        found = _importable_flags()
        if found is None:
            raise SystemExit("sglang is not importable here, or its ServerArgs.add_cli_args failed")
        source, flags = found
        version = source.split()[1]
    elif args.wheel is None:
        raise SystemExit("give an sglang wheel, or --installed")
    else:
        version, source = read_wheel(args.wheel)
        flags = flags_from_source(source)
    args.out.write_text(render(version, flags))
    print(f"{args.out}: {len(flags)} option strings of sglang {version}")


if __name__ == "__main__":
    main()
