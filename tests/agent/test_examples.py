"""The built-in examples: the calculator evaluates arithmetic through `ast` and refuses everything else; the Python
tool runs code in the sandbox."""

from __future__ import annotations

import pytest

from ds_rlhf.agent.environment import load_environment
from ds_rlhf.agent.examples.calculator import calculator, final_number_reward
from ds_rlhf.agent.examples.python_sandbox import python


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("7 / 2", "3.5"), ("-2 ** 3", "-8"), ("17 // 5 % 3", "0"),
    ("1.5 * 4", "6"), ("2 ** 10", "1024"),
])
def test_calculator_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, words", [
    ("__import__('os')", "not Call"), ("().__class__", "not Attribute"), ("x + 1", "not Name"),
    ("(lambda: 1)()", "not Call"), ("[1][0]", "not Subscript"), ("2 ** 10 ** 10", "exponents above 64"),
    ("10 ** 60", "within"), ("1 / 0", "division by zero"), ("'a' * 3", "not Constant"), ("1 +", "not an arithmetic"),
    ("1" * 300, "at most 200"),
])
def test_calculator_refuses(expression, words):
    with pytest.raises(ValueError, match=words):
        calculator(expression)


def test_calculator_env_rewards_the_final_number():
    env = load_environment("ds_rlhf/agent/examples/calculator.py:CalculatorEnv")()
    env.reset({"prompt": "What is 2+3?", "answer": 5})
    assert env.step('calculator("2+3")').messages[0]["content"] == "5"
    assert env.step("The answer is 5").reward == 1.0
    assert final_number_reward("The answer is 6", {"answer": 5}) == 0.0


def test_python_tool_runs_in_the_sandbox():
    assert python("print(6 * 7)") == "42"
    assert "network access is disabled" in python("import socket\nsocket.create_connection(('127.0.0.1', 9))")
    assert "ZeroDivisionError" in python("1 / 0")
