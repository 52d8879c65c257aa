# ppserve: `make serve` runs the demo endpoint, `make test` runs the CI suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install download serve lint test test-slow test-unit test-gpu test-reliability fuzz soak bench clean

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

# Formatted with `ruff format` and type-checked with mypy --strict: every file of app/ and stages/
# (the unit tests' files below are formatted too). Triton kernel bodies keep their own layout
# (# fmt: off) and their untyped decorator and parameters (a targeted type: ignore: Triton reads
# a kernel's annotations).
TYPED := app stages
FORMATTED := $(TYPED) tests/unit/scheduler_configs.py tests/unit/test_control_plane_imports.py \
	tests/unit/test_options.py tests/unit/test_dashboard.py tests/unit/test_bench_layout.py \
	tests/unit/test_request_data_never_executed.py tests/unit/test_docs_links.py \
	tests/unit/test_merged_streams.py tests/unit/test_output_ring.py

lint: install
	$(VENV)/bin/ruff check app stages tests
	$(VENV)/bin/ruff format --check $(FORMATTED)
	$(VENV)/bin/mypy $(TYPED)

# CI: lint, then everything but GPU tests and the slow soak; the fuzz run at its small CI size.
# The Triton kernels' interpreter tests run apart: TRITON_INTERPRET must be set before triton is
# imported, and it changes what every @triton.jit builds. A crash prints every thread's stack;
# the slowest tests are listed at the end (the suite must stay under 30 minutes on 2 cores).
test: export PYTHONFAULTHANDLER = 1
test: install lint
	$(PY) -m pytest tests -m "not gpu and not slow and not interpreter" -q -p no:cacheprovider \
		--durations=25 $(PYTEST_ARGS)
	TRITON_INTERPRET=1 $(PY) -m pytest tests/cpu -m "interpreter and not slow" -q \
		-p no:cacheprovider $(PYTEST_ARGS)

# The exhaustive matrices `make test` leaves out (PP x chunk sizes x skip modes per family, the
# 200-client cancellation burst sizes, the soak): tens of minutes on 2 cores.
test-slow: install
	$(PY) -m pytest tests -m "slow and not gpu" -q -p no:cacheprovider $(PYTEST_ARGS)

# schemathesis against /openapi.json, 500 generated cases per POST endpoint (a few minutes).
fuzz: install
	PPSERVE_FUZZ_EXAMPLES=500 $(PY) -m pytest tests/serve/test_fuzz_openapi.py -q -s \
		-p no:cacheprovider

# 256 concurrent streaming requests of 1-2K prompt tokens (a few minutes on 2 cores).
soak: install
	$(PY) -m pytest tests/serve/test_soak_http.py -q -s -p no:cacheprovider

# Bad input, fuzz (full), overload, soak, faults (stage and replica killed), startup failures,
# CORS and the no-code-from-data scan: slow tests included (`make test` skips those).
test-reliability: install
	PPSERVE_FUZZ_EXAMPLES=500 $(PY) -m pytest -q -s -p no:cacheprovider \
		tests/unit/test_request_validation.py tests/unit/test_request_data_never_executed.py \
		tests/serve/test_bad_input_http.py tests/serve/test_fuzz_openapi.py \
		tests/serve/test_overload_http.py tests/serve/test_soak_http.py \
		tests/ray/test_stage_failure.py tests/serve/test_faults_http.py \
		tests/ray/test_startup_failures.py tests/serve/test_openai_api.py

test-unit: install
	$(PY) -m pytest tests/unit -q

test-gpu:
	python3 -m pytest tests/gpu -q -m gpu

bench: install
	$(VENV)/bin/ppserve bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
