# The two commands of the README: `make demo` (install + the main job on the tiny default) and `make test`.
.PHONY: setup demo test test-all test-fast lint lock-cpu lock-cuda

setup:
	@bash scripts/setup.sh

demo: setup
	@bash -c 'source scripts/env.sh && .venv/bin/python launch/pipeline.py $(ARGS)'

# CI's tier: everything but the `extended` tests (pyproject.toml's markers); test-all adds them (run it before a
# release: the launchers, the multi-process syncs and engines, the benchmark smoke runs).
test: setup
	@bash scripts/run_tests.sh -m "not extended" $(ARGS)

test-all: setup
	@bash scripts/run_tests.sh $(ARGS)

test-fast: setup
	@bash scripts/run_tests.sh -m "not slow and not extended" $(ARGS)

lint: setup
	@.venv/bin/ruff check .

# Regenerate the full locks from their top-level files (requirements.txt, requirements/cuda.txt); metadata only for
# CUDA (no GPU needed; PYTHON=path for a Python 3.12 not on PATH). tests/foundation/test_requirements.py checks both.
lock-cpu:
	@bash scripts/lock_cpu.sh

lock-cuda:
	@bash scripts/lock_cuda.sh
