"""The LLM judge's rubric template and its score rule (judge.py; docs/JUDGE_REWARDS.md).

The template is a plain text file read with `str.format`: `{prompt}`, `{response}` and optionally `{reference}`
(the row's ground truth, "" when it has none) are filled in; a literal brace is written `{{` / `}}`. Any other
field (`{answer}`, `{}`, `{prompt.x}`, `{prompt!r}`, `{prompt:>9}`) is refused when the template is read.

The score rule is strict: the last non-empty line of the judge's reply must be `Score: <number>` (the word in
any case, optional spaces, a plain decimal number such as `7` or `7.5`), with the number in [0, 10]; the reward is
number / 10, in [0, 1]. Any other reply (no such line, text after it, a number out of range) is unparsable: that
item is a bad reward (`reward.on_bad`), counted as `reward/judge/unparsable`.
"""

from __future__ import annotations

import re
import string
from pathlib import Path

FIELDS = ("prompt", "response", "reference")
SCORE_LINE = re.compile(r"^\s*score\s*:\s*([+-]?\d+(?:\.\d+)?)\s*$", re.IGNORECASE)
SCORE_MAX = 10.0


def read_template(path: str) -> str:
    """The template text of `path`; ValueError in one line when the file is missing, empty or has a field other
    than {prompt}, {response}, {reference}, or lacks {response}."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"judge prompt file not found: {path}")
    text = file.read_text(encoding="utf-8")
    check_template(text, path)
    return text


def check_template(text: str, where: str = "the judge prompt") -> None:
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:  # a single `{` or `}`
        raise ValueError(f"{where}: {exc} (write a literal brace as {{{{ or }}}})") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in FIELDS or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"{where}: unknown placeholder {shown}: use {{prompt}}, {{response}} and "
                             "{reference} (a literal brace is {{ or }})")
    if not any(name == "response" for _, name, _, _ in parsed):
        raise ValueError(f"{where}: the template has no {{response}} placeholder (the judge would not see the "
                         "response)")


def render(template: str, prompt: str, response: str, reference) -> str:
    return template.format(prompt=prompt, response=response, reference="" if reference is None else str(reference))


def parse_score(reply: str) -> float | None:
    """The reward of a judge's reply by the score rule (module docstring), in [0, 1]; None when unparsable."""
    lines = [line for line in reply.splitlines() if line.strip()]
    match = SCORE_LINE.match(lines[-1]) if lines else None
    if match is None:
        return None
    number = float(match.group(1))
    return number / SCORE_MAX if 0.0 <= number <= SCORE_MAX else None
