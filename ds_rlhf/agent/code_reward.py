"""The `code_tests` reward (`--reward.fn code_tests`): a response's Python code run against its row's tests in
the tool sandbox (`sandbox.py`); the reward is the fraction of tests passed.

Code: the last fenced block opened with ```python (or ```py) in the response, up to its closing fence or the end of
the response (a response cut at the token budget keeps what it wrote); a response without such a block is taken
whole as code (`extract_code`).

Tests: the row's ground truth (its `label`), JSON: a list of test sources (`["assert add(1, 2) == 3", ...]`), or an
object `{"tests": [...], "setup": "from typing import List"}` whose `setup` runs before the response's code (the
imports a problem's signature needs). A ground truth that is neither raises ValueError: a bad reward for the batch
(`reward.on_bad`), since the data set, not the model, is wrong.

One sandboxed process per response runs the code, then every test in turn in the code's namespace
(`code_harness.py`): one process start per response rather than per test (a fresh, confined process costs about
0.1 s, and a batch has many responses), while each test still gets its own outcome and its own timer
(`PER_TEST_TIMEOUT_S`). The whole call is bounded by the sandbox's wall and CPU limits (`SAMPLE_BUDGET_S`): a
response that loops and swallows the timer, forks (the sandbox's process cap), writes outside its scratch directory
(refused), opens a socket (refused) or crashes the interpreter ends as failed tests within that budget, never the
run. Responses are scored `PARALLEL` at a time (threads, each waiting on its own sandboxed process).

Per sample, besides the score (logged as `reward/code_tests/<name>` means, never in place of the reward):
`tests_passed`, `tests_total`, `timeouts` (tests cut by their timer; all of them when loading the code or the whole
call ran out of time), `errors` (tests that raised something other than AssertionError), `crashed` (1 when the code
did not load, a syntax error or an exception at import, or the process ended without a result before its budget).

Limits: the tests run in the same process as the response's code, so code written to fool them (an object whose
`__eq__` is always true, patching the harness) can pass; the sandbox bounds what code can do to the machine, not
what it can do to its own tests. Run it in-process (the default for built-in rewards); with `reward.workers` > 0
a batch's call must end within `reward.timeout`.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

from ds_rlhf.agent import code_harness
from ds_rlhf.agent.sandbox import Sandbox, SandboxResult

PER_TEST_TIMEOUT_S = 2.0  # each test's timer, and the timer on loading the response's code
SAMPLE_BUDGET_S = 10.0  # wall and CPU seconds for one response's whole call (the sandbox kills it after)
PARALLEL = max(1, min(8, os.cpu_count() or 1))  # responses scored at once
SANDBOX = Sandbox(timeout_s=SAMPLE_BUDGET_S, cpu_seconds=int(SAMPLE_BUDGET_S), memory_mb=1024, max_processes=16,
                  max_output_bytes=65_536)
_FENCED = re.compile(r"```(?:python|py)[ \t]*\r?\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    """The last ```python / ```py block of the response (to its closing fence or the response's end), else the
    whole response."""
    blocks = _FENCED.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(ground_truth) -> tuple[str, list[str]]:
    """(setup, tests) of a row's ground truth (module docstring); ValueError when it holds no test."""
    value = ground_truth
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"code_tests: the ground truth is not JSON (a list of tests or {{\"tests\": [...]}}): "
                             f"{ground_truth[:80]!r}") from None
    setup = ""
    if isinstance(value, dict):
        setup, value = value.get("setup") or "", value.get("tests")
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value) \
            or not isinstance(setup, str):
        raise ValueError(f"code_tests: the ground truth holds no list of test sources: {str(ground_truth)[:80]!r}")
    return setup, value


def _failed(total: int, result: SandboxResult) -> dict:
    """Every test failed: the call gave no outcome (its budget ran out, or the process died)."""
    timed_out = result.status in ("timeout", "cpu_limit")
    return {"score": 0.0, "tests_passed": 0.0, "tests_total": float(total),
            "timeouts": float(total if timed_out else 0), "errors": 0.0, "crashed": 0.0 if timed_out else 1.0}


def score_code(response: str, ground_truth, sandbox: Sandbox | None = None) -> dict:
    """`{"score": passed / total, "tests_passed", "tests_total", "timeouts", "errors", "crashed"}` of one response
    against its row's tests (module docstring)."""
    setup, tests = parse_tests(ground_truth)
    result = (sandbox or SANDBOX).call(code_harness.run_tests, {
        "code": extract_code(response), "setup": setup, "tests": tests, "per_test_s": PER_TEST_TIMEOUT_S})
    try:
        outcome = json.loads(result.value) if result.ok and result.value else None
    except ValueError:
        outcome = None
    if not isinstance(outcome, dict) or len(outcome.get("tests", ())) != len(tests):
        return _failed(len(tests), result)
    statuses = [status for status, _ in outcome["tests"]]
    load = outcome["load"][0]
    passed = statuses.count("pass")
    timeouts = len(tests) if load == "timeout" else statuses.count("timeout")
    return {"score": passed / len(tests), "tests_passed": float(passed), "tests_total": float(len(tests)),
            "timeouts": float(timeouts), "errors": float(statuses.count("error")),
            "crashed": float(load not in ("pass", "timeout"))}


def code_tests_reward(prompts: list[str], responses: list[str], ground_truths: list, metadatas: list[dict]
                      ) -> list[dict]:
    """Batched: each response's `score_code`, `PARALLEL` at a time; every ground truth is checked first."""
    for truth in ground_truths:
        parse_tests(truth)
    with ThreadPoolExecutor(min(PARALLEL, max(len(responses), 1))) as pool:
        return list(pool.map(score_code, responses, ground_truths))
