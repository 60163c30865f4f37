#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels that `tests/gpu/run.sh --system-python --wheels DIR` installs
# on a GPU machine without one: qbuild's dependencies that an image with CUDA torch and transformers (python3 3.12)
# usually lacks, pinned to the versions this checkout's venv runs. About 6 MB; add --pyarrow for an image whose
# pyarrow is older than datasets needs (50 MB more).
#   tests/gpu/fetch_wheels.sh [DIR] [--pyarrow]        (default DIR: .whl, which .git/info/exclude should ignore)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR=".whl"; PYARROW=0
for a in "$@"; do
  case "$a" in
    --pyarrow) PYARROW=1 ;;
    -h|--help) sed -n 2,6p "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fetch_wheels.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
    *) DIR="$a" ;;
  esac
done
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || { echo "fetch_wheels.sh: no $PY (run scripts/install.sh dev, or set PYTHON)" >&2; exit 2; }
version() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }

PINS=()
for dist in pydantic pydantic-core annotated-types typing-inspection junitparser gguf loguru llmcompressor \
            compressed-tensors auto-round datasets dill multiprocess; do
  PINS+=("$dist==$(version "$dist")")
done
[ "$PYARROW" = 1 ] && PINS+=("pyarrow==$(version pyarrow)")
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d "$DIR" "${PINS[@]}"
echo "fetch_wheels.sh: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1), in $DIR"
