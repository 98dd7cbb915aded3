#!/usr/bin/env bash
# Build .whl/ (git-ignored): the wheels the lent GPU machines lack to run rlflow's benches, and .whl/setup.sh
# that installs them there. The GPU machines have torch + CUDA, Triton, transformers, numpy, httpx and Python 3.12,
# but no registry access and no pydantic, fastapi, Ray, Prefect or MLflow; a call carries at most 64 MiB.
#
#   bash bench/device_wheels.sh            # the engines' needs: pydantic, the server's stack, megatron-core, liger
#   bash bench/device_wheels.sh --ray      # also Ray, slimmed to fit (the RL loop's actors: bench/gpu_rl.py)
#
# Then, on the device (run tool, carry [".whl"]): `source .whl/setup.sh; python -m bench.<script> ...`.
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
         liger-kernel peft; do
    fetch "$p==$(pin $p)"
done
fetch "pydantic-core==$(installed pydantic-core)"
fetch "importlib-metadata==$(installed importlib-metadata)"
# megatron-core: the GPU figures in docs/benchmarks.md were measured with 0.19.2 (torch 2.11 there); the CPU
# suite pins constraints.txt's version, which the GPU machines run too but no figure was taken with
fetch "megatron-core==${MEGATRON_CORE:-0.19.2}"

if [[ "${1:-}" == "--ray" ]]; then
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

cat > "$out/setup.sh" <<'EOF'
# source .whl/setup.sh (on the device, in the repository root): install the carried wheels into /tmp/site and
# make `rlflow.*` importable from this checkout (the shim maps the package's four folders, as the editable
# install does here).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PWD/shim:$PWD PATH=/tmp/site/bin:$PATH
mkdir -p shim/rlflow && for d in flows tasks engines examples; do ln -sfn "$PWD/$d" "shim/rlflow/$d"; done
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
EOF
du -sh "$out"
