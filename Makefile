# `make demo` and `make test` bootstrap .venv themselves on a fresh machine (Python >= 3.12, pip,
# make). jax 0.11 needs Python 3.12: PYTHON is the first of python3, python3.12, python3.13 and
# pyenv's 3.12+ that is new enough; a .venv made with an older Python is made again.
NEW_ENOUGH = import sys; sys.exit(sys.version_info < (3, 12))
PYTHON ?= $(firstword $(foreach p,python3 python3.12 python3.13 $(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3),$(if $(shell $(p) -c '$(NEW_ENOUGH)' >/dev/null 2>&1 && echo y),$(p))) python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS ?= dev,notebooks,tfds,tb,cluster

.PHONY: setup test test-fast lint demo notebooks bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -c '$(NEW_ENOUGH)' 2>/dev/null || { rm -rf $(VENV); $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

# the formatter check and the linter first, then the whole suite; each test file runs on one
# worker (--dist loadfile), so its module fixtures are built once, not once per worker
test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

lint: $(STAMP)  # the formatter check and the linter (configured in pyproject.toml)
	$(VENV)/bin/ruff format --check mhc_jax tests benchmarks examples
	$(VENV)/bin/ruff check mhc_jax tests benchmarks examples

demo: $(STAMP)
	$(VENV)/bin/mhc-jax sweep configs/sweeps/quickstart.yaml

notebooks: $(STAMP)  # train notebooks/sweep.yaml, execute notebooks 01-03 in place (outputs saved)
	$(PY) notebooks/execute.py

bench: $(STAMP)  # measurements, not tests: each prints medians after warm-up
	$(PY) benchmarks/step_bench.py --mode compile --width 64 --seq-len 64
	$(PY) benchmarks/sinkhorn_bench.py
	$(PY) benchmarks/population_bench.py
	$(PY) benchmarks/layer_bench.py
	$(PY) benchmarks/step_bench.py
	$(PY) benchmarks/step_bench.py --mode dots

clean:
	rm -rf $(VENV) .pytest_cache
