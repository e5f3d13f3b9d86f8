"""The learning benchmark's inputs and child processes (`bench/learn.py`): the task files (`task_files`), their
prompt stores (`prep_stores`), and each `ds-rlhf` command in a child process of this Python (`ds_rlhf`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from learn_tasks.tasks import write_arithmetic, write_gsm8k

HELDOUT = 500  # arithmetic: held-out problems


def ds_rlhf(*argv: str, log: Path | None = None, minutes: float = 0) -> None:
    """One `ds-rlhf` command in a child process (this Python), its output to `log` (or through). With `minutes`, a
    command still running then gets SIGTERM (the trainer finishes its step, saves and exits 128 + 15): not a
    failure."""
    cmd = [sys.executable, "-m", "ds_rlhf.entrypoints", *argv]
    with open(log, "w") if log else open(os.devnull, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink if log else None, stderr=subprocess.STDOUT if log else None)
        try:
            code = proc.wait(timeout=minutes * 60 or None)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait()
            if code == 128 + signal.SIGTERM:
                print(f"learn: stopped after the {minutes:g}-minute limit", flush=True)
                return
    if code:
        tail = log.read_text()[-3000:] if log else ""
        raise SystemExit(f"learn: `ds-rlhf {' '.join(argv[:1])}` failed (exit {code})\n{tail}")


def task_files(args, work: Path) -> dict[str, Path]:
    if args.task == "arithmetic":
        n_train = args.steps * args.prompts_per_step + 64  # an unlimited stream: never a prompt twice
        return write_arithmetic(work / "task", n_train, HELDOUT)
    if not args.gsm8k.is_file():
        raise SystemExit(f"learn: GSM8K file not found: {args.gsm8k} (pass --gsm8k PATH/test.jsonl)")
    return write_gsm8k(args.gsm8k, work / "task")


def prep_stores(files: dict[str, Path], model: str, work: Path, max_prompt_len: int,
                text: bool = False) -> dict[str, Path]:
    """The prompt stores; `text`: the prompts as plain text (no chat template), as episodes read them."""
    stores = {}
    for key, src in files.items():
        out = work / f"store_{key}{'_text' if text else ''}"
        if not (out / "manifest.json").is_file():
            ds_rlhf("prep-prompts", "--tokenizer", model, "--input", str(src), "--output", str(out), "--quiet",
                    "--max_prompt_len", str(max_prompt_len), *(["--no-apply_chat_template"] if text else []),
                    log=work / f"prep_{out.name}.log")
        stores[key] = out
    return stores
