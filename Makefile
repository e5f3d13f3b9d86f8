# The two commands of the README: `make demo` (install + the main job on the tiny default) and `make test`.
.PHONY: setup demo test test-fast lint

setup:
	@bash scripts/setup.sh

demo: setup
	@bash -c 'source scripts/env.sh && .venv/bin/python launch/pipeline.py $(ARGS)'

test: setup
	@bash scripts/run_tests.sh $(ARGS)

test-fast: setup
	@bash scripts/run_tests.sh -m "not slow" $(ARGS)

lint: setup
	@.venv/bin/ruff check .
