"""Bad inputs a careless user gives the real command line: each ends with a non-zero exit status and one last stderr
line `error: ...` (or `<command>: error: ...`) naming the offending setting or path, never a traceback.

Each command is its own process running `python -m ds_rlhf.entrypoints` (a clean environment, no scripts/env.sh), a
few at a time: most stop at parse time or in the start-up checks, before any model is built. The processes are forked
from one server process that has imported the commands' modules (as `ds-rlhf` does before it runs a command), so the
import is paid once rather than once per case; each then runs the package's `__main__` with its own argv, stdout and
stderr, and exits as the command does (an uncaught exception prints its traceback and exits 1).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds_rlhf.data.synthetic import write_addition_datasets
from ds_rlhf.data.writer import write_store
from ds_rlhf.entrypoints.main import SUBCOMMANDS
from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
# `error: ...` from the training commands, `<prog>: error: ...` from argparse and the prep commands, and
# `ds-rlhf export: ...` / `ds-rlhf convert-gguf: ...` from those two
ERROR_LINE = re.compile(r"^(error: |[\w-]+: error: |ds-rlhf [\w-]+: )")
WORKERS = 3


def _tiny_run(model, store, out, *extra):
    return ["--model.path", str(model), "--data.train", str(store), "--run.output_dir", str(out),
            "--run.steps", "1", "--run.progress", "false", "--run.tensorboard", "false",
            *extra]


def make_inputs(tmp: Path, model: Path) -> None:
    """The bad (and the few good) inputs the cases name, under `tmp`."""
    write_addition_datasets(tmp / "data", model, n_prompts=16, n_sft=32, n_pref=16, seed=0, max_operand=9)
    prompts = tmp / "data" / "prompts"
    (tmp / "empty_store").mkdir()
    shutil.copytree(prompts, tmp / "no_manifest")
    (tmp / "no_manifest" / "manifest.json").unlink()
    shutil.copytree(prompts, tmp / "no_data")
    for arrow in (tmp / "no_data").glob("*.arrow"):
        arrow.unlink()
    write_store(tmp / "other_tok", "prompts", [{"input_ids": [3, 4, 5], "ground_truth": "1"}] * 4,
                tokenizer_name="other", tokenizer_fingerprint="0" * 64)
    shutil.copytree(model, tmp / "bad_tokenizer")
    (tmp / "bad_tokenizer" / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    shutil.copytree(model, tmp / "bad_weights")
    weights = tmp / "bad_weights" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (tmp / "not_a_model").mkdir()
    (tmp / "not_a_model" / "readme.txt").write_text("hi")
    (tmp / "a_file.txt").write_text("just text")
    (tmp / "bad_ds.json").write_text('{"train_batch_size": ')
    (tmp / "conflict_ds.json").write_text(json.dumps({"train_batch_size": 999}))
    (tmp / "bad.yaml").write_text("run:\n  steps: [1,\n")
    (tmp / "unknown.yaml").write_text("run:\n  stepz: 3\n")
    (tmp / "wrong_type.yaml").write_text("run:\n  steps: many\n")
    (tmp / "raising_reward.py").write_text("raise RuntimeError('reward module is broken')\n")
    (tmp / "no_fn_reward.py").write_text("def other(prompt, completion, **kw):\n    return 0.0\n")
    (tmp / "not_a_checkpoint").mkdir()
    (tmp / "not_a_checkpoint" / "notes.txt").write_text("x")
    (tmp / "rows.jsonl").write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n"
                                            for i in range(3)))
    (tmp / "wrong_cols.jsonl").write_text("".join(json.dumps({"foo": i, "bar": "x"}) + "\n" for i in range(3)))
    (tmp / "empty.jsonl").write_text("")
    (tmp / "model.gguf").write_text("this is not a gguf file")


def build_cases(tmp: Path, model: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv after `python -m ds_rlhf.entrypoints`, text the last stderr line must hold); the inputs are
    make_inputs'."""
    prompts, sft, out = tmp / "data" / "prompts", tmp / "data" / "sft", tmp / "runs"

    def ppo(name, *extra, store=prompts, model_path=model):
        return ["train-ppo", *_tiny_run(model_path, store, out / name, "--rollout.backend", "hf", "--reward.fn",
                                        "gsm8k", *extra)]

    def sft_run(name, *extra, store=sft, model_path=model):
        return ["train-sft", *_tiny_run(model_path, store, out / name, "--optim.batch_size", "4", *extra)]

    return {**_store_and_batch_cases(tmp, model, ppo, sft_run), **_model_cases(tmp, ppo, sft_run),
            **_config_reward_and_resume_cases(tmp, ppo, sft_run), **_command_cases(tmp, model)}


def _store_and_batch_cases(tmp: Path, model: Path, ppo, sft_run) -> dict[str, tuple[list[str], str]]:
    """The wrong kind of store for the command, stores that are not there or not whole, and batch sizes."""
    prompts, sft, pref = (tmp / "data" / kind for kind in ("prompts", "sft", "preference"))
    empty, no_manifest, no_data, other_tok = (tmp / n for n in ("empty_store", "no_manifest", "no_data", "other_tok"))
    conflict = tmp / "conflict_ds.json"
    return {
        # the wrong kind of store for the command
        "sft_store_to_train_ppo": (ppo("a", store=sft), str(sft)),
        "prompt_store_to_train_sft": (sft_run("b", store=prompts), str(prompts)),
        "sft_store_to_train_rm": (["train-rm", *_tiny_run(model, sft, tmp / "runs" / "c")], str(sft)),
        "preference_store_to_train_sft": (sft_run("d", store=pref), str(pref)),
        # stores that are not there or not whole
        "store_does_not_exist": (ppo("e", store=tmp / "nope"), "data.train"),
        "store_dir_empty": (ppo("f", store=empty), str(empty)),
        "store_without_manifest": (ppo("g", store=no_manifest), str(no_manifest)),
        "store_without_data_files": (ppo("h", store=no_data), str(no_data)),
        "store_of_another_tokenizer": (ppo("i", store=other_tok), str(other_tok)),
        # batch sizes
        "prompts_per_step_larger_than_store": (ppo("j", "--rl.prompts_per_step", "64"), "rl.prompts_per_step"),
        "ds_config_train_batch_size_conflict": (sft_run("k", "--ds_config", str(conflict)), "train_batch_size"),
        "batch_size_larger_than_store": (sft_run("l", "--optim.batch_size", "64"), "optim.batch_size"),
        "zero_steps_negative": (sft_run("m", "--run.steps", "-3"), "run.steps"),
        "zero_batch_size": (sft_run("n", "--optim.batch_size", "0"), "optim.batch_size"),
    }


def _model_cases(tmp: Path, ppo, sft_run) -> dict[str, tuple[list[str], str]]:
    """Model, tokenizer, reward-model and output paths that are broken, missing or of the wrong kind."""
    bad_tok, bad_weights, not_model, a_file = (tmp / n for n in ("bad_tokenizer", "bad_weights", "not_a_model",
                                                                 "a_file.txt"))
    return {
        # models
        "corrupt_tokenizer_json": (ppo("o", model_path=bad_tok), "tokenizer.json"),
        "truncated_model_safetensors": (sft_run("p", model_path=bad_weights), str(bad_weights)),
        "model_path_not_a_model": (ppo("q", model_path=not_model), str(not_model)),
        "model_path_does_not_exist": (ppo("r", model_path=tmp / "no_model"), "model.path"),
        "model_path_is_a_file": (ppo("s", model_path=a_file), str(a_file)),
        "model_hub_id_not_cached_offline": (ppo("ms", model_path="nobody-here/no-such-model"), "model.path"),
        "reward_model_does_not_exist": (ppo("mr", "--reward.model", str(tmp / "no_rm")), "reward.model"),
        "eval_store_does_not_exist": (ppo("ev", "--data.eval", str(tmp / "no_eval"), "--run.eval_every", "2"),
                                      "data.eval"),
        "reward_weights_count_mismatch": (ppo("rw", "--reward.weights", "1,2"), "reward.weights"),
        "output_dir_read_only": (ppo("ro", "--run.output_dir", "/sys/ds_rlhf_run"), "/sys/ds_rlhf_run"),
        "output_dir_behind_a_file": (ppo("bf", "--run.output_dir", str(a_file / "run")), "run.output_dir"),
        "tokenizer_path_does_not_exist": (ppo("t", "--model.tokenizer", str(tmp / "no_tok")), "model.tokenizer"),
        "lora_targets_not_in_model": (sft_run("u", "--model.lora_rank", "4", "--model.lora_targets", "qkv_proj"),
                                      "model.lora_targets"),
    }


def _config_reward_and_resume_cases(tmp: Path, ppo, sft_run) -> dict[str, tuple[list[str], str]]:
    """Config files, algorithms and rewards, and resume paths."""
    bad_json, bad_yaml, unknown_key = (tmp / n for n in ("bad_ds.json", "bad.yaml", "unknown.yaml"))
    raising, no_fn, not_ckpt = tmp / "raising_reward.py", tmp / "no_fn_reward.py", tmp / "not_a_checkpoint"
    return {
        # config files
        "ds_config_missing": (sft_run("v", "--ds_config", str(tmp / "nope.json")), "nope.json"),
        "ds_config_invalid_json": (sft_run("w", "--ds_config", str(bad_json)), str(bad_json)),
        "config_yaml_missing": (["train-ppo", "--config", str(tmp / "nope.yaml")], "nope.yaml"),
        "config_yaml_invalid": (["train-ppo", "--config", str(bad_yaml)], str(bad_yaml)),
        "config_yaml_unknown_key": (["train-ppo", "--config", str(unknown_key)], "stepz"),
        "config_yaml_wrong_type": (["train-ppo", "--config", str(tmp / "wrong_type.yaml")], "run.steps"),
        "unknown_command_line_setting": (["train-sft", "--run.stepz", "3"], "stepz"),
        # algorithms and rewards
        "unknown_rl_algo": (["train-ppo", "--rl.algo", "ppo2"], "rl.algo"),
        "unknown_reward_name": (ppo("x", "--reward.fn", "gsm9k"), "gsm9k"),
        "reward_file_does_not_exist": (ppo("y", "--reward.fn", f"{tmp}/nope.py:score"), "nope.py"),
        "reward_module_raises_at_import": (ppo("z", "--reward.fn", f"{raising}:score"), "raising_reward.py"),
        "reward_module_has_no_such_function": (ppo("aa", "--reward.fn", f"{no_fn}:score"), "score"),
        # resume
        "resume_from_nothing": (sft_run("ab", "--run.resume", str(tmp / "no_ckpt")), "no_ckpt"),
        "resume_from_a_non_checkpoint_dir": (sft_run("ac", "--run.resume", str(not_ckpt)), str(not_ckpt)),
    }


def _command_cases(tmp: Path, model: Path) -> dict[str, tuple[list[str], str]]:
    """The commands besides training: export, doctor, data prep and GGUF conversion."""
    not_model, not_ckpt = tmp / "not_a_model", tmp / "not_a_checkpoint"
    rows, wrong_cols, empty_in, fake_gguf = (tmp / n for n in ("rows.jsonl", "wrong_cols.jsonl", "empty.jsonl",
                                                               "model.gguf"))
    return {
        # export
        "export_missing_checkpoint": (["export", str(tmp / "no_ckpt"), str(tmp / "exp")], "no_ckpt"),
        "export_a_non_checkpoint_dir": (["export", str(not_ckpt), str(tmp / "exp2")], str(not_ckpt)),
        # machine checks
        "doctor_unknown_option": (["doctor", "--fast-please"], "--fast-please"),
        # data prep
        "prep_missing_input": (["prep-gsm8k", "--tokenizer", str(model), "--input", str(tmp / "no.jsonl"),
                                "--output", str(tmp / "p1"), "--quiet"], "no.jsonl"),
        "prep_wrong_columns": (["prep-gsm8k", "--tokenizer", str(model), "--input", str(wrong_cols),
                                "--output", str(tmp / "p2"), "--quiet"], "wrong_cols.jsonl"),
        "prep_empty_input": (["prep-gsm8k", "--tokenizer", str(model), "--input", str(empty_in),
                              "--output", str(tmp / "p3"), "--quiet"], "empty.jsonl"),
        "prep_tokenizer_not_a_model": (["prep-gsm8k", "--tokenizer", str(not_model), "--input", str(rows),
                                        "--output", str(tmp / "p4"), "--quiet"], str(not_model)),
        # conversion
        "convert_gguf_not_a_gguf_file": (["convert-gguf", str(fake_gguf), str(tmp / "conv")], str(fake_gguf)),
        "convert_gguf_missing_file": (["convert-gguf", str(tmp / "no.gguf"), str(tmp / "conv2")], "no.gguf"),
    }


# `python -c FORK_SERVER CASES_JSON OUT_DIR WORKERS TIMEOUT MODULE...`: imports MODULE... after the environment
# defaults every command sets, then forks one child per case, WORKERS at a time. A child points its stdout and stderr
# at OUT_DIR/<name>.out / .err and runs `ds_rlhf.entrypoints` as `__main__` with the case's argv, as `python -m` does;
# the server writes each child's exit status (negative: the signal that ended it; -9 after TIMEOUT seconds) to
# OUT_DIR/returncodes.json.
FORK_SERVER = """
import gc, importlib, json, os, runpy, signal, sys, time
from ds_rlhf.entrypoints.main import runtime_env_defaults

runtime_env_defaults()
for module in sys.argv[5:]:
    importlib.import_module(module)
gc.freeze()  # what the imports made stays out of the children's collections (as the gc docs advise before fork)


def serve():
    cases, out = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    workers, timeout = int(sys.argv[3]), float(sys.argv[4])
    todo, running, codes = list(cases), {}, {}
    while todo or running:
        while todo and len(running) < workers:
            name = todo.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return out, name, cases[name]
            running[pid] = (name, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[running.pop(pid)[0]] = os.waitstatus_to_exitcode(status)
            continue
        for child, (name, start) in running.items():
            if time.monotonic() - start > timeout:
                os.kill(child, signal.SIGKILL)
        time.sleep(0.02)
    with open(os.path.join(out, "returncodes.json"), "w") as f:
        json.dump(codes, f)
    sys.exit(0)


out, name, argv = serve()
for fd, suffix in ((1, "out"), (2, "err")):
    target = os.open(os.path.join(out, f"{name}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)
sys.argv = [sys.argv[0], *argv]
runpy.run_module("ds_rlhf.entrypoints", run_name="__main__", alter_sys=True)
"""


def run_cases(cases: dict[str, list[str]], out: Path, timeout: float = 300) -> dict[str, subprocess.CompletedProcess]:
    """Every case's `python -m ds_rlhf.entrypoints ARGV` (FORK_SERVER), WORKERS at a time: name -> finished process."""
    out.mkdir(parents=True)
    (out / "cases.json").write_text(json.dumps(cases))
    modules = sorted({SUBCOMMANDS[argv[0]][0].partition(":")[0] for argv in cases.values() if argv[0] in SUBCOMMANDS})
    modules.append("deepspeed")  # what the training commands' start-up checks import first (lazily)
    env = clean_env()
    env.pop("DS_RLHF_DEBUG", None)
    server = subprocess.run([sys.executable, "-c", FORK_SERVER, str(out / "cases.json"), str(out), str(WORKERS),
                             str(timeout), *modules], capture_output=True, text=True, cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL, timeout=timeout * len(cases))
    assert server.returncode == 0 and (out / "returncodes.json").is_file(), server.stderr[-4000:]
    codes = json.loads((out / "returncodes.json").read_text())
    return {name: subprocess.CompletedProcess([sys.executable, "-m", "ds_rlhf.entrypoints", *argv], codes[name],
                                              (out / f"{name}.out").read_text(), (out / f"{name}.err").read_text())
            for name, argv in cases.items()}


CASES = build_cases(Path("/audit"), Path("/model"))


@pytest.fixture(scope="module")
def audit(tiny_model_path, tmp_path_factory):
    """Every case run once, WORKERS at a time: name -> (the finished process, what its last line must hold)."""
    tmp = tmp_path_factory.mktemp("audit")
    make_inputs(tmp, tiny_model_path)
    cases = build_cases(tmp, tiny_model_path)
    procs = run_cases({name: argv for name, (argv, _) in cases.items()}, tmp / "processes")
    return {name: (procs[name], cases[name][1]) for name in cases}


def test_the_audit_covers_the_inputs_a_careless_user_gets_wrong():
    assert len(CASES) >= 26
    commands = {argv[0] for argv, _ in CASES.values()}
    assert {"train-ppo", "train-sft", "train-rm", "export", "prep-gsm8k", "convert-gguf", "doctor"} <= commands


@pytest.mark.heavy  # the module's audit (every case's process) is set up by the first of them
@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_input_is_one_line_naming_it(audit, name):
    proc, names = audit[name]
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert ERROR_LINE.match(last), last
    assert names in last, last
