"""What runs inside the tool sandbox for the `code_tests` reward (`code_reward.py`): the response's code, then each
test, in one process, each step under its own timer; returns the per-test outcomes as JSON.

The sandbox's process loads this file by path (`python -I`), so it imports only the standard library.

Each test is a piece of Python source (usually one `assert`) executed in the namespace the response's code defined.
A test passes when it runs to its end; it is "fail" on an AssertionError, "error" on any other exception,
"timeout" when its timer (`per_test_s`, SIGALRM) fires first. The timer's exception derives from BaseException, so
an `except Exception` in the response's code does not swallow it; code that swallows it anyway (or blocks in C) runs
on until the sandbox's wall timeout kills the whole call, which `code_reward.py` scores as every test failed.
"""

import json
import signal
import traceback

SOLUTION_NAME = "solution"  # the response's module name: its `if __name__ == "__main__":` block does not run


class TestTimeout(BaseException):
    """The per-step timer fired."""


def _alarm(_signum, _frame):
    raise TestTimeout


def _timed(source: str, name: str, namespace: dict, seconds: float) -> tuple[str, str]:
    """(status, error) of executing `source` within `seconds`: "pass", "fail", "error" or "timeout"."""
    try:
        compiled = compile(source, name, "exec")
    except BaseException as exc:  # noqa: BLE001  a SyntaxError (or a null byte) in model-written code
        return "error", f"{type(exc).__name__}: {exc}"
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        exec(compiled, namespace)  # noqa: S102  the point: run model-written code inside the sandbox
        status, error = "pass", ""
    except TestTimeout:
        status, error = "timeout", f"no end within {seconds:g} s"
    except AssertionError as exc:
        status, error = "fail", f"AssertionError: {exc}"[:300]
    except BaseException as exc:  # noqa: BLE001  anything the code raises (SystemExit too) is its outcome
        tb = traceback.format_exception_only(type(exc), exc)
        status, error = "error", "".join(tb).strip()[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return status, error


def run_tests(code: str, setup: str, tests: list, per_test_s: float) -> str:
    """JSON `{"load": [status, error], "tests": [[status, error], ...]}`: `setup` (the row's own code, e.g.
    imports) and the response's `code` executed first (`load`: "pass" or why not), then each test in turn in
    their namespace; the tests are "skipped" when the code did not load."""
    signal.signal(signal.SIGALRM, _alarm)
    namespace = {"__name__": SOLUTION_NAME}
    load = _timed(setup, "<setup>", namespace, per_test_s) if setup else ("pass", "")
    if load[0] == "pass":
        load = _timed(code, "<response>", namespace, per_test_s)
    results = [_timed(test, f"<test {i}>", namespace, per_test_s) if load[0] == "pass" else ("skipped", "")
               for i, test in enumerate(tests)]
    return json.dumps({"load": list(load), "tests": [list(r) for r in results]})
