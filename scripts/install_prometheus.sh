#!/usr/bin/env bash
# Install real Prometheus and promtool (2.42) into .tools/bin/ for the alert and dashboard tests.
#
# Both come from Debian 12's `prometheus` package at one pinned version: `apt-get download`
# fetches the .deb (no root, nothing installed on the system), its sha256 must be the one below,
# and `dpkg-deb -x` unpacks it into a temporary folder of which only usr/bin/prometheus and
# usr/bin/promtool are kept (Go binaries that need only libc). Idempotent: a stamp file records
# the version and sha256, and a changed pin reinstalls.
#
#   usage: scripts/install_prometheus.sh      (from anywhere; installs into <repo>/.tools/bin)
set -euo pipefail

VERSION="2.42.0+ds-5+deb12u1"
SHA256="81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${ROOT}/.tools"
BIN="${TOOLS}/bin"
STAMP="${TOOLS}/.hotload-prometheus-installed"
STAMP_TEXT="prometheus ${VERSION} sha256:${SHA256}"

say() { echo "install_prometheus: $*"; }
fail() {
    echo "install_prometheus: ERROR: $*" >&2
    exit 1
}

if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${STAMP_TEXT}" && -x "${BIN}/prometheus" && -x "${BIN}/promtool" ]]; then
    say "${STAMP_TEXT} already installed in ${BIN}; nothing to do"
    exit 0
fi

HINT="install Prometheus 2.42 yourself and put its prometheus and promtool binaries in ${BIN}"
[[ "$(uname -s)-$(uname -m)" == "Linux-x86_64" ]] \
    || fail "the pinned package is Debian's linux-amd64 build; on $(uname -s)-$(uname -m) ${HINT}"
for tool in apt-get dpkg-deb sha256sum; do
    command -v "${tool}" >/dev/null || fail "${tool} not found (not a Debian system?); ${HINT}"
done

rm -f "${STAMP}"
mkdir -p "${BIN}"
DOWNLOAD="$(mktemp -d "${TOOLS}/download.XXXXXX")"
trap 'rm -rf "${DOWNLOAD}"' EXIT

say "downloading Debian's prometheus ${VERSION} (about 19 MB)"
(cd "${DOWNLOAD}" && apt-get download -q "prometheus=${VERSION}" >/dev/null 2>"${DOWNLOAD}/apt.log") \
    || fail "apt-get download prometheus=${VERSION} failed ($(tail -n 1 "${DOWNLOAD}/apt.log")): run 'apt-get update' (Debian 12 bookworm's lists), or ${HINT}"
DEB=("${DOWNLOAD}"/prometheus_*.deb)
[[ -f "${DEB[0]}" ]] || fail "apt-get download left no .deb in ${DOWNLOAD}"
GOT="$(sha256sum "${DEB[0]}" | cut -d' ' -f1)"
[[ "${GOT}" == "${SHA256}" ]] || fail "$(basename "${DEB[0]}") has sha256 ${GOT}, the pin says ${SHA256}"

say "extracting prometheus and promtool into ${BIN}"
dpkg-deb -x "${DEB[0]}" "${DOWNLOAD}/root" || fail "dpkg-deb could not unpack $(basename "${DEB[0]}")"
for name in prometheus promtool; do
    install -m 0755 "${DOWNLOAD}/root/usr/bin/${name}" "${BIN}/.${name}.partial"
    mv -f "${BIN}/.${name}.partial" "${BIN}/${name}" # atomic: a concurrent reader never sees half a binary
done

"${BIN}/prometheus" --version >/dev/null 2>&1 || fail "${BIN}/prometheus does not run"
"${BIN}/promtool" --version >/dev/null 2>&1 || fail "${BIN}/promtool does not run"
echo "${STAMP_TEXT}" >"${STAMP}"
say "done: $("${BIN}/promtool" --version 2>&1 | head -n 1)"
