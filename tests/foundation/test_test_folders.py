"""The tests mirror the package: each folder under tests/ is named after a package or module of ds_rlhf (it tests
that code), or is one of the project-wide folders: `foundation` (the project's own checks: layers, docs language,
requirements, the wheel), `faults` (the table of bad inputs and faults across the commands), `real_model` (runs on
SmolLM2-135M-Instruct) and `gpu` (what needs CUDA). A folder named after a package that does not exist fails here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT_WIDE = {"foundation", "faults", "real_model", "gpu"}


def unmatched_test_folders(tests: Path, package: Path) -> list[str]:
    """Folders of tests (holding a .py file) under `tests` named after neither a module or package under `package`
    nor a project-wide folder."""
    names = {p.stem for p in package.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    return sorted(d.name for d in tests.iterdir()
                  if d.is_dir() and d.name not in names | PROJECT_WIDE and any(d.glob("*.py")))


def test_test_folders_are_named_after_the_package():
    assert unmatched_test_folders(ROOT / "tests", ROOT / "ds_rlhf") == []


def test_a_folder_named_after_a_missing_package_is_caught(tmp_path):
    package, tests = tmp_path / "pkg", tmp_path / "tests"
    (package / "rollout").mkdir(parents=True)
    (package / "rollout" / "__init__.py").touch()
    (package / "config.py").touch()
    (package / "notes").mkdir()  # a folder without __init__.py is not a package
    for name in ("rollout", "config", "foundation", "trainer", "notes", "emptied"):
        (tests / name).mkdir(parents=True)
        if name != "emptied":  # a folder whose tests moved away keeps only caches
            (tests / name / "test_x.py").touch()
    assert unmatched_test_folders(tests, package) == ["notes", "trainer"]
