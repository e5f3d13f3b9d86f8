"""A calculator tool and the environment that rewards a correct final number.

`calculator(expression)` evaluates arithmetic by walking its `ast`: numbers, + - * / // % **, unary signs and
parentheses only; no names, calls, attributes or subscripts, so `__import__('os')` is refused, not run (nothing
goes through `eval`). Exponents are capped and results bounded so one call cannot eat the CPU or memory.

`CalculatorEnv` is a `ToolEnvironment` over it; a row is `{"prompt": ..., "answer": ...}` and the final answer
(the turn without a tool call) scores 1.0 when its last number equals `answer` (`final_number_reward`; an answer
ending in `#### N`, as the arithmetic and GSM8K prompts ask, is scored by its N).
"""

from __future__ import annotations

import ast
import math
import operator
import re

from ds_rlhf.agent.environment import ToolEnvironment

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_ABS = 1e15

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")  # 1,200 is one number


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses.

    Args:
        expression: the arithmetic expression, e.g. "(2 + 3) * 4"
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"give the expression as a string of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents above {MAX_EXPONENT} are not allowed")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_ABS:
            raise ValueError(f"the result is not a real number within ±{MAX_ABS:g}")
        return value
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


TOOLS = [calculator]


def final_number_reward(text: str, row) -> float:
    """1.0 when the last number in `text` (thousands commas allowed: `1,200`) equals the row's `answer`. A
    `#### N` ending the text, the arithmetic and GSM8K answer format, is such a last number."""
    found = _NUMBER.findall(text)
    if not found or not isinstance(row, dict) or row.get("answer") is None:
        return 0.0
    try:
        answer = float(str(row["answer"]).replace(",", ""))
    except ValueError:
        return 0.0
    return float(math.isclose(float(found[-1].replace(",", "")), answer, abs_tol=1e-6))


class CalculatorEnv(ToolEnvironment):
    def __init__(self) -> None:
        super().__init__(TOOLS, reward_fn=final_number_reward)
