"""The learning benchmark's tasks as plain prompt files (`train.jsonl`, `heldout.jsonl`) any trainer can read.

Rows are OpenRLHF-style prompt rows (`prompt`, `label` = the answer, `data_source`) that `ds-rlhf prep-prompts`
reads; the reward is `rewards.py` beside this file. Both tasks ask for the final answer after `####`.

- `arithmetic`: word problems with 2-3 operands and +, - and x, seeded and deterministic. The held-out set
  (`heldout_rows`, seed 1, 500 problems) is fixed; the training stream (`training_rows`, seed 0) is as long as asked
  for and never repeats a held-out question.
      python bench/learn_tasks/tasks.py arithmetic OUT_DIR [--train 20000]
- `gsm8k`: the GSM8K *test* split (1319 rows, `{"question", "answer"}`) re-split by a seeded shuffle into 1000
  training and 319 held-out problems. This is a learning demonstration on real grade-school problems, not a GSM8K
  score: the model trains on part of the test split.
      python bench/learn_tasks/tasks.py gsm8k OUT_DIR --gsm8k PATH/gsm8k/test.jsonl
"""


from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# No example number: under GRPO, SmolLM2-135M given an instruction that showed one ("for example: #### 42")
# learned to end every response with that number, which the format reward paid for.
INSTRUCTION = "Solve the problem. Then give the final answer as a number after '####'."
NAMES = ["Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Tom", "Yuki", "Ines"]
ITEMS = ["apples", "stickers", "marbles", "books", "coins", "pencils", "cards", "shells", "stamps", "cookies"]


def _problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, answer, expression): the expression computes the answer from the question's numbers in the
    question's order (what a calculator call for it would evaluate)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    operands = rng.choice((2, 3))
    if rng.random() < 0.3:  # start with a product
        boxes, each = rng.randint(2, 9), rng.randint(2, 12)
        total, expression = boxes * each, f"{boxes} * {each}"
        parts = [f"{name} has {boxes} boxes with {each} {item} in each box."]
        operands -= 1
    else:
        total = rng.randint(5, 60)
        expression = str(total)
        parts = [f"{name} has {total} {item}."]
    for _ in range(operands - 1):
        op = rng.choice("+-x" if total <= 40 else "+-")
        if op == "+":
            n = rng.randint(2, 40)
            total += n
            expression += f" + {n}"
            parts.append(rng.choice([f"Then {name} buys {n} more {item}.", f"A friend gives {name} {n} more {item}."]))
        elif op == "-" and total > 2:
            n = rng.randint(1, total - 1)
            total -= n
            expression += f" - {n}"
            parts.append(rng.choice([f"Then {name} gives away {n} {item}.", f"Then {name} loses {n} {item}."]))
        else:
            k = rng.randint(2, 4)
            total *= k
            expression = f"({expression}) * {k}" if " " in expression else f"{expression} * {k}"
            parts.append(f"Then the number of {item} {name} has becomes {k} times as large.")
    parts.append(f"How many {item} does {name} have now?")
    return " ".join(parts), total, expression


def _rows(rng: random.Random, n: int, skip: set[str], expressions: bool = False) -> list[dict]:
    rows, seen = [], set(skip)
    while len(rows) < n:
        question, answer, expression = _problem(rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": f"{question}\n{INSTRUCTION}", "label": str(answer), "data_source": "arithmetic"}
                    | ({"expression": expression} if expressions else {}))
    return rows


def heldout_rows(n: int = 500) -> list[dict]:
    return _rows(random.Random(1), n, set())


def training_rows(n: int, heldout: list[dict], expressions: bool = False) -> list[dict]:
    """`n` training rows (seed 0), none of whose questions is in `heldout`; the first `n` rows of any longer stream.
    `expressions`: each row also has `expression`, the arithmetic computing its answer (`_problem`)."""
    return _rows(random.Random(0), n, {r["prompt"].split("\n")[0] for r in heldout}, expressions)


def write_arithmetic(out_dir: Path, n_train: int = 20000, n_heldout: int = 500) -> dict[str, Path]:
    heldout = heldout_rows(n_heldout)
    return _write(out_dir, training_rows(n_train, heldout), heldout)


N_TRAIN = 1000  # gsm8k: training rows; the rest of the 1319 are held out


def split(test_jsonl: Path, n_train: int = N_TRAIN, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rows = []
    for line in test_jsonl.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            label = item["answer"].rsplit("####", 1)[1].strip().replace(",", "")
            rows.append({"prompt": f"{item['question']}\n{INSTRUCTION}", "label": label, "data_source": "gsm8k"})
    random.Random(seed).shuffle(rows)
    return rows[:n_train], rows[n_train:]


def write_gsm8k(test_jsonl: Path, out_dir: Path, n_train: int = N_TRAIN) -> dict[str, Path]:
    return _write(out_dir, *split(test_jsonl, n_train))


def _write(out_dir: Path, train: list[dict], heldout: list[dict]) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"train": out_dir / "train.jsonl", "heldout": out_dir / "heldout.jsonl"}
    for key, rows in (("train", train), ("heldout", heldout)):
        files[key].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", choices=("arithmetic", "gsm8k"))
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--train", type=int, default=20000, help="arithmetic: training rows")
    ap.add_argument("--gsm8k", type=Path, help="gsm8k: the GSM8K test.jsonl")
    args = ap.parse_args()
    if args.task == "gsm8k" and args.gsm8k is None:
        ap.error("task gsm8k needs --gsm8k PATH/test.jsonl")
    if args.task == "arithmetic":
        print(write_arithmetic(args.out_dir, args.train))
    else:
        print(write_gsm8k(args.gsm8k, args.out_dir))
