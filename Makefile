# `make demo` and `make test` bootstrap .venv themselves on a fresh machine (Python 3.11, pip, make).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS ?= dev,notebooks,tfds,tb,cluster

.PHONY: setup test test-fast lint demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

test: lint  # the formatter check and the linter first, then the whole suite
	$(PY) -m pytest -q -n 2 --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow"

lint: $(STAMP)  # the formatter check and the linter (configured in pyproject.toml)
	$(VENV)/bin/ruff format --check mhc_jax tests benchmarks
	$(VENV)/bin/ruff check mhc_jax tests benchmarks

demo: $(STAMP)
	$(VENV)/bin/mhc-jax sweep configs/sweeps/quickstart.yaml

bench: $(STAMP)  # measurements, not tests: each prints medians after warm-up
	$(PY) benchmarks/compile_time.py
	$(PY) benchmarks/sinkhorn_bench.py
	$(PY) benchmarks/population_bench.py
	$(PY) benchmarks/layer_bench.py
	$(PY) benchmarks/step_bench.py
	$(PY) benchmarks/dot_ceiling.py

clean:
	rm -rf $(VENV) .pytest_cache
