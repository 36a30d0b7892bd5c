# One-command set-up: `make demo` trains the main job, `make test` runs the tests.
# Both create .venv and install lipdp with what it needs when missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
# make demo trains lipdp's most accurate private model (ScatterNet features at two scales,
# clipped DP-SGD; not certifiable), then its certified-robust Lipschitz network; CONFIG=...
# picks others.
CONFIG ?= configs/fashion_mnist_scatternet_multiscale_clipped.yaml configs/fashion_mnist.yaml

.PHONY: demo test data bench check-python clean

check-python:
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; \
	  sys.exit(0) if (3, 9) <= v <= (3, 11) else sys.exit( \
	  "lipdp needs Python 3.9-3.11 (TensorFlow 2.15 / deel-lip 1.5); found %d.%d at %s. " \
	  "Install python3.11 or run: make PYTHON=/path/to/python3.11 ..." % (v + (sys.executable,)))'

$(STAMP): setup.cfg pyproject.toml | check-python
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(VENV)/bin/python -m pip install -q -e ".[dev]"
	@$(VENV)/bin/python -c "import lipdp.kernels as k; print('lipdp fused kernels:', k.status())"
	@touch $(STAMP)

data: $(STAMP)
	@$(VENV)/bin/lipdp data fashion_mnist || bash scripts/install_fashion_mnist.sh

demo: data
	@for config in $(CONFIG); do echo "##### lipdp train $$config"; \
	  $(VENV)/bin/lipdp train $$config || exit 1; done

# Tests run in parallel (pytest-xdist), one worker per core up to 4, each test file on one
# worker (a file's module-scoped set-up, e.g. test_distribute's subprocesses, runs once).
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --dist loadfile tests

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/run.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
