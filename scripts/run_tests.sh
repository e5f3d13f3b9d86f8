#!/usr/bin/env bash
# The test command (README, `make test`, .ci/run). Caches live inside the checkout so CI re-uses nothing from
# outside its own directory and JIT builds are paid once per run. pytest's "no tests ran" (exit 5) is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "run_tests: pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
