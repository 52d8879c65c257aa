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

# Formatted with `ruff format` and type-checked with mypy --strict: every file of app/ and stages/.
# Triton kernel bodies keep their own layout (# fmt: off) and their untyped decorator and
# parameters (a targeted type: ignore: Triton reads a kernel's annotations).
FORMATTED := app/__init__.py app/autoscaling.py app/bench app/cli.py app/dashboard.py \
	app/engine.py app/gguf_checkpoint.py app/merged.py app/messages.py app/metrics.py \
	app/model_cost.py app/models_cache.py app/openai/availability.py app/openai/calls.py \
	app/pipeline.py \
	app/prefix_router.py app/prefix_routing.py app/scheduler stages/__init__.py stages/actor.py \
	stages/channels.py stages/copy_channel.py stages/decode_graphs.py stages/forward_batch.py \
	stages/kernels/__init__.py stages/kernels/cudnn_attention.py stages/kernels/indexer_select.py \
	stages/kernels/moe_tuning.py stages/output_ring.py stages/partition.py stages/protocol.py \
	stages/sync_guard.py stages/timing.py tests/unit/scheduler_configs.py \
	tests/unit/test_control_plane_imports.py tests/unit/test_options.py \
	tests/unit/test_dashboard.py tests/unit/test_bench_layout.py \
	tests/unit/test_request_data_never_executed.py tests/unit/test_docs_links.py \
	tests/unit/test_merged_streams.py tests/unit/test_output_ring.py \
	app/openai/__init__.py app/openai/chat_output.py app/openai/structured_fields.py \
	app/openai/tools.py app/structured.py app/tool_parsers.py stages/models/__init__.py \
	stages/models/deepseek_v4 stages/models/qwen3_moe.py \
	app/request.py app/tokenizer.py app/openai/body.py app/openai/choices.py app/openai/openapi.py \
	app/openai/responses.py stages/kernels/torch_ref.py stages/model_config.py \
	stages/models/llama.py stages/sampler.py \
	app/coordinator.py app/server.py app/openai/ingress.py app/openai/protocol.py \
	app/request_stream.py app/config.py stages/models/stage.py stages/stage_context.py \
	stages/models/layers.py \
	stages/models/moe.py stages/models/families.py stages/models/deepseek_config.py \
	stages/models/mla_cache.py stages/kv_cache.py \
	stages/kernels/registry.py stages/kernels/fp8_latent.py stages/kernels/fp8_ref.py \
	stages/kernels/mxfp4.py stages/kernels/flash_mla.py stages/models/deepseek.py \
	stages/models/mla.py stages/models/dsa.py stages/loader.py \
	stages/runner.py stages/output_slots.py stages/attention_warmup.py \
	stages/kernels/hyper_connection.py app/options.py app/server_config.py \
	stages/kernels/flash_mla_v4.py stages/kernels/fp8_gemm.py stages/kernels/fp8_indexer.py \
	stages/kernels/fp8_v4.py stages/kernels/fp8_v4_layout.py stages/kernels/moe_routing.py \
	stages/kernels/triton_fp8_act.py stages/kernels/triton_fp8_latent.py \
	stages/kernels/triton_gemm.py stages/kernels/triton_hyper.py stages/kernels/triton_indexer.py \
	stages/kernels/triton_moe.py stages/kernels/triton_moe_fp8.py \
	stages/kernels/triton_paged_decode.py stages/shared_counters.py stages/kernels/fallbacks.py
TYPED := app/__init__.py app/autoscaling.py app/bench app/cli.py app/config.py app/dashboard.py \
	app/engine.py app/gguf_checkpoint.py app/merged.py app/messages.py app/metrics.py \
	app/model_cost.py app/models_cache.py app/pipeline.py app/prefix_router.py \
	app/prefix_routing.py \
	app/request.py app/scheduler app/tokenizer.py stages/__init__.py stages/actor.py \
	stages/channels.py stages/copy_channel.py stages/decode_graphs.py stages/forward_batch.py \
	stages/kernels/__init__.py stages/kernels/cudnn_attention.py stages/kernels/indexer_select.py \
	stages/kernels/moe_tuning.py stages/output_ring.py stages/partition.py stages/protocol.py \
	stages/sync_guard.py stages/timing.py \
	app/openai/__init__.py app/openai/calls.py app/openai/chat_output.py \
	app/openai/structured_fields.py app/openai/tools.py app/structured.py app/tool_parsers.py \
	stages/models/__init__.py stages/models/deepseek_v4 stages/models/qwen3_moe.py \
	app/openai/availability.py app/openai/body.py app/openai/choices.py app/openai/openapi.py \
	app/openai/responses.py stages/kernels/torch_ref.py stages/model_config.py \
	stages/models/llama.py stages/sampler.py \
	app/openai/ingress.py app/openai/protocol.py app/request_stream.py \
	app/coordinator.py app/server.py stages/models/stage.py stages/stage_context.py \
	stages/models/layers.py \
	stages/models/moe.py stages/models/families.py stages/models/deepseek_config.py \
	stages/models/mla_cache.py stages/kv_cache.py \
	stages/kernels/registry.py stages/kernels/fp8_latent.py stages/kernels/fp8_ref.py \
	stages/kernels/mxfp4.py stages/kernels/flash_mla.py stages/models/deepseek.py \
	stages/models/mla.py stages/models/dsa.py stages/loader.py \
	stages/runner.py stages/output_slots.py stages/attention_warmup.py \
	stages/kernels/hyper_connection.py app/options.py app/server_config.py \
	stages/kernels/flash_mla_v4.py stages/kernels/fp8_gemm.py stages/kernels/fp8_indexer.py \
	stages/kernels/fp8_v4.py stages/kernels/fp8_v4_layout.py stages/kernels/moe_routing.py \
	stages/kernels/triton_fp8_act.py stages/kernels/triton_fp8_latent.py \
	stages/kernels/triton_gemm.py stages/kernels/triton_hyper.py stages/kernels/triton_indexer.py \
	stages/kernels/triton_moe.py stages/kernels/triton_moe_fp8.py \
	stages/kernels/triton_paged_decode.py stages/shared_counters.py stages/kernels/fallbacks.py

lint: install
	$(VENV)/bin/ruff check app stages tests
	$(VENV)/bin/ruff format --check $(FORMATTED)
	$(VENV)/bin/mypy $(TYPED)

# CI: lint, then everything but GPU tests and the slow soak; the fuzz run at its small CI size.
test: install lint
	$(PY) -m pytest tests -m "not gpu and not slow" -q -p no:cacheprovider $(PYTEST_ARGS)

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
