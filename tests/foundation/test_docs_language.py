"""Docs, comments, docstrings, test names and file names describe the project as it is: no numbered rounds or
sessions of work, no references to the task text ("the brief", "the issue", issue numbers), no review anecdotes,
no commit hashes in prose and no before/after narratives. The git log keeps the history; CHANGELOG.md lists
user-facing changes per version.

The scan covers every tracked text file (``git ls-files``), the strings of the results under docs/ (JSON: their notes
are prose) and every tracked path. A legitimate use of a flagged
word (pytest's fixture scope ``"session"``, an API name) is listed in ALLOWED with the file and the exact text, so
the patterns themselves stay strict."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THIS_FILE = "tests/foundation/test_docs_language.py"

# Text files whose prose is scanned (by suffix or exact name). JSON is data (results, dashboards), not prose.
TEXT_SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini"}
TEXT_NAMES = {"Makefile", "run", ".gitignore"}

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth")

# name -> pattern (case-insensitive). Each names one way the making of the project leaks into its text.
MARKERS: dict[str, re.Pattern[str]] = {
    "numbered round": re.compile(r"(?i:\bround \d+\b)|\b(?:in|from|of) R\d+\b|\bR\d+ (?:fix|change|review)"),
    "numbered session": re.compile(
        rf"\b(?:{ORDINALS}) session\b|\bsession \d+\b|\b(?:this|that|previous|next|earlier|later|latest|"
        r"last|each|every) (?:device )?session\b|\bsessions' |\b(?:same|one) (?:[\w-]+ )?session\b", re.I),
    "the brief": re.compile(r"\bthe brief\b|\bbrief's\b", re.I),
    "the issue": re.compile(
        r"\b(?:the|this|that|an? other|GPU) issue\b|\bissues? #?\d+|\bissue's\b|\bother issues\b|\bthe issues\b|"
        r"\bdefects? (?:\d+|number)",
        re.I),
    "review anecdote": re.compile(r"\breview(?:er|ers|s)?\b(?! (?:the|your|a) )|\breviewed\b", re.I),
    "commit hash in prose": re.compile(
        r"\b(?:commit|commits|at|in|since|from|until|reverted|fixed in|code)\s+`?[0-9a-f]{7,40}\b"
        r"|`[0-9a-f]{7,40}`|\b[0-9a-f]{7,40}(?:'s|\.\.)", re.I),
    "before/after narrative": re.compile(
        r"\bused to\b|\bpreviously\b|\bwas fixed\b|\bnow fixed\b|\bno longer\b|\bfixed (?:in|after|since)\b|"
        r"\bbefore the fix\b|\bafter the fix(?:es)?\b|\bthe old (?:behaviou?r|code|default)\b|\buntil now\b|"
        r"\bnot (?:yet )?measured (?:yet|since)\b|\bstill to be measured\b|\bchanged after (?:these|the) runs\b|"
        r"\bmoved out of\b|\bcode moved\b|\bnow defaults to\b|\bas before this\b|\b(?:before|until) \d{4}-\d\d-\d\d\b",
        re.I),
}

# Path components that narrate history (before/after pairs, numbered rounds or sessions).
PATH_MARKER = re.compile(r"(?:^|[/_.-])(?:before|after|again|old|new|round\d*|session\d*|r\d+)(?:$|[/_.-])", re.I)

# (file, exact text on the line) pairs that are legitimate uses of a flagged word.
# DAPO's dynamic sampling draws a step's batch in numbered sampling rounds: a feature, not a round of work.
ALLOWED: set[tuple[str, str]] = {
    ("docs/DAPO.md", "- Each round uses its own sampling seeds (`rl_service.sampling_spec(..., round_)`); "
                     "round 0 is the seed a run without"),
    ("ds_rlhf/recipes/rl_service.py", "# index. Round 0 is every step's only round without dynamic sampling."),
}
# pytest's fixture scope and session objects of libraries.
ALLOWED_LINE_RE = re.compile(r"""scope\s*=\s*["']session["']|session-scoped|\bsession\s*=|\bSession\(""", re.I)


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def _is_text(path: str) -> bool:
    p = Path(path)
    return p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES


def _real_commits(tokens: set[str]) -> set[str]:
    """The tokens that name a commit of this repository (git cat-file --batch-check)."""
    if not tokens:
        return set()
    query = "".join(f"{t}^{{commit}}\n" for t in sorted(tokens))
    res = subprocess.run(["git", "cat-file", "--batch-check"], cwd=REPO, input=query, capture_output=True,
                         text=True, check=True)
    found = set()
    for tok, line in zip(sorted(tokens), res.stdout.splitlines()):
        if not line.endswith("missing") and " commit " in f" {line} ":
            found.add(tok)
    return found


HEX_TOKEN = re.compile(r"(?<![0-9a-zA-Z_./:-])[0-9a-f]{7,40}(?![0-9a-zA-Z_])")


def scan_text(path: str, text: str, commits: set[str] | None = None) -> list[str]:
    """Every forbidden marker in ``text`` as 'path:line: kind: line text'. ``commits`` are hex tokens known to name
    commits of the repository: those are flagged wherever they stand in a docs or comment line."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if (path, stripped) in ALLOWED or ALLOWED_LINE_RE.search(line):
            continue
        for kind, pat in MARKERS.items():
            if pat.search(line):
                hits.append(f"{path}:{n}: {kind}: {stripped[:140]}")
        if commits:
            for tok in HEX_TOKEN.findall(line):
                if tok in commits and not MARKERS["commit hash in prose"].search(line):
                    hits.append(f"{path}:{n}: commit hash: {stripped[:140]}")
    return hits


def scan_path(path: str) -> list[str]:
    stem = path.rsplit(".", 1)[0] if "." in Path(path).name else path
    return [f"{path}: file name: narrates history"] if PATH_MARKER.search(stem) else []


@pytest.fixture(scope="module")
def tracked_texts() -> dict[str, str]:
    texts = {}
    for path in _tracked():
        if path == THIS_FILE or not _is_text(path) or not (REPO / path).is_file():
            continue
        texts[path] = (REPO / path).read_text(encoding="utf-8", errors="replace")
    return texts


def test_tracked_text_describes_the_project_as_it_is(tracked_texts):
    tokens = set()
    for text in tracked_texts.values():
        tokens.update(t for t in HEX_TOKEN.findall(text) if re.search(r"[a-f]", t) and re.search(r"\d", t))
    commits = _real_commits(tokens)
    hits = [h for path, text in sorted(tracked_texts.items()) for h in scan_text(path, text, commits)]
    assert not hits, f"{len(hits)} lines speak of how the project was made:\n" + "\n".join(hits)


def json_strings(value, where: str = ""):
    """(key path, string) for every string inside a parsed JSON value."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_strings(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from json_strings(item, f"{where}[{i}]")
    elif isinstance(value, str):
        yield where, value


def scan_results(path: str, text: str) -> list[str]:
    """`scan_text` over each string of a JSON (or JSON-lines) result file, named by its key path."""
    docs = [json.loads(line) for line in text.splitlines() if line.strip()] if path.endswith(".jsonl") \
        else [json.loads(text)]
    return [hit for doc in docs for where, s in json_strings(doc) for hit in scan_text(f"{path}{where}", s)]


def test_results_under_docs_describe_their_runs():
    hits = [h for path in _tracked() if path.startswith("docs/") and path.endswith((".json", ".jsonl"))
            for h in scan_results(path, (REPO / path).read_text(encoding="utf-8"))]
    assert not hits, f"{len(hits)} strings in results speak of how the project was made:\n" + "\n".join(hits)


def test_a_result_note_narrating_its_making_is_caught():
    result = {"steps": 8, "mfu": {"value": 0.18, "note": "6*N per trained token: the issue's convention"}}
    assert scan_results("docs/perf/raw/x.json", json.dumps(result)) == [
        "docs/perf/raw/x.json.mfu.note:1: the issue: 6*N per trained token: the issue's convention"]
    assert not scan_results("docs/perf/raw/x.jsonl", '{"note": "6*N per trained token"}\n{"steps": 8}\n')


def test_tracked_file_names_describe_what_they_hold():
    hits = [h for path in _tracked() for h in scan_path(path)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("line", [
    "Measured in the twelfth session on one H200.",
    "From round 3 on the bench defaults to two engines.",
    "As the brief asks, the loader is resumable.",
    "This closes the issue's second item (issue 31).",
    "A review after these runs found the wake call.",
    "The sync no longer waits for the servers.",
    "Fixed in 349c6f1 after the runs.",
    "the last commit (`3d23406`) passed CI",
])
def test_each_kind_of_marker_is_caught(line):
    assert scan_text("docs/X.md", line), line


@pytest.mark.parametrize("line", [
    '@pytest.fixture(scope="session")',
    "The sync hands the weights over without waiting for the servers.",
    "sha256 of every file: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "Review the config with `ds-rlhf train-ppo --help` before a long run.",
    "Measured 2026-12-03 on one NVIDIA H200: 136.1 completions/s.",
])
def test_plain_descriptions_pass(line):
    assert not scan_text("docs/X.md", line), line


def test_file_names_narrating_history_are_caught():
    assert scan_path("docs/perf/2026-12-01_grpo05b_async_before.png")
    assert scan_path("tests/rollout/test_round2_fixes.py")
    assert not scan_path("docs/perf/rl_step_async_two_engines.png")
    assert not scan_path("tests/rollout/test_weight_sync.py")
