#!/usr/bin/env bash
# Build .whl/ (git-ignored): the wheels the lent GPU machines lack to run rlflow's benches, and .whl/setup.sh
# that installs them there. The GPU machines have torch + CUDA, Triton, transformers, numpy, httpx and Python 3.12,
# but no registry access and no pydantic, fastapi, Ray, Prefect or MLflow; a call carries at most 64 MiB.
#
#   bash bench/device_wheels.sh            # the engines' needs: pydantic, the server's stack, megatron-core, liger
#   bash bench/device_wheels.sh --ray      # also Ray, slimmed to fit (the RL loop's actors: bench/e2e/rl.py)
#   bash bench/device_wheels.sh --all      # also Prefect and MLflow: the whole flow (`rlflow run`, bench/e2e/fault.py)
#
# Then, on the device (run tool, carry [".whl"]): `source .whl/setup.sh; python -m bench.<script> ...`.
# --all's wheels are 105 MB, over a call's 64 MiB: they are installed here for CPython 3.12 and carried as one
# xz-compressed folder (.whl/site.tar.xz, about 55 MB; compiled libraries compress far better with xz than in a
# wheel's zip), which setup.sh unpacks.
# Versions come from constraints.txt; megatron-core is the one exception (below).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${WHL_DIR:-.whl}
py=${PYTHON:-.venv/bin/python}  # the project's environment: pins not in constraints.txt are read from it
mkdir -p "$out"
pin() {  # the version constraints.txt pins for a package
    grep -i "^$1==" constraints.txt | cut -d= -f3
}
fetch() {  # name==version for CPython 3.12 on manylinux x86_64, no dependencies (each is listed here)
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$out" "$1"
}
installed() {  # the version installed in the project's environment (for what constraints.txt leaves to pip)
    "$py" -c "import importlib.metadata as m; print(m.version('$1'))"
}
for p in pydantic annotated-types typing-inspection fastapi starlette uvicorn h11 opentelemetry-api zipp orjson \
         liger-kernel peft zstandard xxhash; do
    fetch "$p==$(pin $p)"
done
fetch "pydantic-core==$(installed pydantic-core)"
fetch "importlib-metadata==$(installed importlib-metadata)"
# megatron-core: the GPU figures in docs/benchmarks.md were measured with 0.19.2 (torch 2.11 there); the CPU
# suite pins constraints.txt's version, which the GPU machines run too but no figure was taken with
fetch "megatron-core==${MEGATRON_CORE:-0.19.2}"

if [[ "${1:-}" == "--ray" || "${1:-}" == "--all" ]]; then
    # Ray's wheel is 79 MB; without ray/jars (Java workers only, 32 MB) it fits a call. Ray's own needs the
    # machines lack: jsonschema and its three.
    for p in jsonschema jsonschema-specifications referencing rpds-py; do fetch "$p==$(pin $p)"; done
    # the session reads its prompt files through HF datasets (pyarrow, xxhash, fsspec are there already)
    for p in datasets dill multiprocess; do fetch "$p==$(pin $p)"; done
    tmp=$(mktemp -d)
    fetch "ray==$(pin ray)" && mv "$out"/ray-*.whl "$tmp/"
    (cd "$tmp" && python3 - <<'EOF'
import glob, zipfile
src = glob.glob("ray-*.whl")[0]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile("slim-" + src, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if not item.filename.startswith("ray/jars/"):
            zout.writestr(item, zin.read(item.filename))
EOF
    )
    mv "$tmp"/slim-ray-*.whl "$out/$(basename "$tmp"/ray-*.whl)"
    rm -rf "$tmp"
fi

if [[ "${1:-}" == "--all" ]]; then
    # the flow's own needs beyond the machines' packages and the above: Prefect (its server included: asyncpg and
    # greenlet are imported with SQLite too), prefect-ray, MLflow's client (mlflow-skinny; SQLite through
    # SQLAlchemy and alembic, which Prefect needs anyway); versions as installed here, from constraints.txt
    for p in prefect prefect-ray aiosqlite alembic sqlalchemy greenlet mako amplitude-analytics apprise \
             requests-oauthlib oauthlib asgi-lifespan sniffio asyncpg cachetools coolname cryptography cffi pycparser \
             cyclopts docstring-parser rich-rst dateparser pytz tzlocal docker exceptiongroup graphviz griffe \
             griffecli griffelib jinja2-humanize-extension jsonpatch jsonpointer pendulum tzdata pydantic-extra-types \
             pydantic-settings python-dotenv pydocket burner-redis cronsim py-key-value-aio beartype redis \
             python-json-logger uncalled-for python-slugify text-unidecode readchar rfc3339-validator ruamel-yaml-clib \
             ruamel-yaml semver toml websockets mlflow-skinny mlflow-tracing databricks-sdk google-auth \
             pyasn1-modules pyasn1 gitpython gitdb smmap opentelemetry-proto opentelemetry-sdk \
             opentelemetry-semantic-conventions sqlparse; do
        fetch "$p==$(installed $p)"
    done
    rm -rf "$out/site" "$out/site.tar.xz"
    "$py" -m pip install -q --no-index --no-deps --no-compile --ignore-requires-python --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --target "$out/site" "$out"/*.whl
    tar -C "$out" -cf - site | xz -9 -T0 > "$out/site.tar.xz"
    rm -rf "$out/site" "$out"/*.whl
fi

cat > "$out/setup.sh" <<'EOF'
# source .whl/setup.sh (on the device, in the repository root): install the carried wheels (or unpack --all's
# folder) into /tmp/site and make `rlflow.*` importable from this checkout (the shim maps the package's four
# folders, as the editable install does here).
if [[ -f .whl/site.tar.xz ]]; then
    rm -rf /tmp/site && tar -C /tmp -xJf .whl/site.tar.xz
    sed -i '1s|^#!.*python.*|#!/usr/bin/env python3|' /tmp/site/bin/*  # installed here: shebangs named this venv
else
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
fi
export PYTHONPATH=/tmp/site:$PWD/shim:$PWD PATH=/tmp/site/bin:$PATH
mkdir -p shim/rlflow && for d in flows tasks engines examples; do ln -sfn "$PWD/$d" "shim/rlflow/$d"; done
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
EOF
du -sh "$out"
