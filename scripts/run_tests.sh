#!/usr/bin/env bash
# The test command (README, `make test`, .ci/run). Caches live inside the checkout so CI re-uses nothing from
# outside its own directory and JIT builds are paid once per run. pytest's "no tests ran" (exit 5) is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# Two pytest-xdist workers (the CI machine's two cores); idle workers steal queued tests from busy ones, and the
# slow tests are queued first (tests/conftest.py). DS_RLHF_TEST_WORKERS=0 runs in this process (pdb, -s).
workers=${DS_RLHF_TEST_WORKERS:-2}
xdist=()
[ "$workers" = 0 ] || xdist=(-n "$workers" --dist worksteal)
.venv/bin/python -m pytest "${xdist[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "run_tests: pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
