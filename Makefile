# ppserve: `make serve` runs the demo endpoint, `make test` runs the CI suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install download serve lint test test-unit test-gpu bench clean

install: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes. torch goes first and pinned to the
# CPU wheel, so no dependency can pull a CUDA build of several GB.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

# The default model (SmolLM2-135M-Instruct) is fetched into ~/.cache/ppserve ($PPSERVE_CACHE) on
# first use; `make download` does it ahead of time, after which serving needs no network.
download: install
	$(VENV)/bin/ppserve download smollm2

serve: install
	$(VENV)/bin/ppserve serve $(ARGS)

# Formatted with `ruff format` and type-checked with mypy --strict: grow these lists file by file.
FORMATTED := app/scheduler stages/protocol.py app/messages.py app/dashboard.py app/bench/target.py \
	app/bench/__init__.py app/bench/__main__.py tests/unit/test_options.py \
	tests/unit/test_dashboard.py tests/unit/test_bench_layout.py
TYPED := app/scheduler stages/protocol.py app/request.py app/messages.py app/dashboard.py

lint: install
	$(VENV)/bin/ruff check app stages tests
	$(VENV)/bin/ruff format --check $(FORMATTED)
	$(VENV)/bin/mypy $(TYPED)

test: install lint
	$(PY) -m pytest tests -m "not gpu" -q -p no:cacheprovider $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest tests/unit -q

test-gpu:
	python3 -m pytest tests/gpu -q -m gpu

bench: install
	$(VENV)/bin/ppserve bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
