"""The learning benchmark (`bench/learn.py`, `ds-rlhf bench learn`): its task files and rewards, the calculator
environment's reward on the task's answer format, the trainer settings it passes, the warm start's demonstrations,
and tiny runs end to end on CPU (single turns; calculator episodes with `--environment`) that write the JSON and
the PNG. Its results and seeds: test_bench_learn_results.py."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ds_rlhf.agent.examples.calculator import CalculatorEnv, calculator, final_number_reward
from ds_rlhf.agent.tool_calls import ToolCall
from ds_rlhf.data import open_store
from ds_rlhf.engines.model_source import resolve_model_source
from ds_rlhf.telemetry.logger import read_metrics
from ds_rlhf.testing.multiproc import clean_env
from tests.ops.learn_bench import CALCULATOR, ROOT, bench_module

TASKS = ROOT / "bench" / "learn_tasks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"learn_tasks_{name}", TASKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tasks, rewards = _load("tasks"), _load("rewards")


def _answer(question: str) -> int:
    """An independent solver of the generated problems' phrasing, sentence by sentence."""
    total = None
    for sentence in question.split(". "):
        if m := re.search(r"has (\d+) boxes with (\d+) ", sentence):
            total = int(m[1]) * int(m[2])
        elif m := re.search(r"^\w+ has (\d+) ", sentence):
            total = int(m[1])
        elif m := re.search(r"(?:buys|gives \w+) (\d+) more", sentence):
            total += int(m[1])
        elif m := re.search(r"(?:gives away|loses) (\d+)", sentence):
            total -= int(m[1])
        elif m := re.search(r"becomes (\d+) times", sentence):
            total *= int(m[1])
    return total


def test_arithmetic_rows_are_fixed_correct_and_disjoint():
    heldout = tasks.heldout_rows(500)
    assert heldout == tasks.heldout_rows(500) and len({r["prompt"] for r in heldout}) == 500
    train = tasks.training_rows(3000, heldout)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    ops = {"+": 0, "-": 0, "x": 0}
    for row in heldout + train[:500]:
        question = row["prompt"].split("\n")[0]
        assert int(row["label"]) == _answer(question) >= 0, question
        assert row["prompt"].endswith(tasks.INSTRUCTION)
        ops["+"] += "more" in question
        ops["-"] += "gives away" in question or "loses" in question
        ops["x"] += "times as large" in question or "boxes" in question
    assert min(ops.values()) > 100, ops


def test_the_instruction_shows_no_number_a_policy_could_copy():
    assert not re.search(r"\d", tasks.INSTRUCTION), tasks.INSTRUCTION


def test_gsm8k_split_is_the_test_file_re_split(shared_data, tmp_path):
    files = tasks.write_gsm8k(shared_data / "gsm8k" / "test.jsonl", tmp_path)
    train, held = ([json.loads(x) for x in files[k].read_text().splitlines()] for k in ("train", "heldout"))
    assert (len(train), len(held)) == (1000, 319)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    source = [json.loads(x) for x in (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()]
    answers = {s["question"]: s["answer"].rsplit("####", 1)[1].strip().replace(",", "") for s in source}
    assert all(answers[r["prompt"].split(f"\n{tasks.INSTRUCTION}")[0]] == r["label"] for r in train + held)


@pytest.mark.parametrize("response, truth, right, fmt, train, lenient", [
    ("3 + 4 = 7. #### 7", "7", 1.0, 1.0, 1.0, 1.0),
    ("#### 1,200", "1200", 1.0, 1.0, 1.0, 1.0),
    ("So she has 7 now.\n#### 7.  ", "7", 1.0, 1.0, 1.0, 1.0),
    ("#### 8", "7", 0.0, 1.0, 0.1, 0.0),
    ("The answer is 7.", "7", 0.0, 0.0, 0.0, 0.0),
    # one answer, at the end: repeated `####`, several guesses or text after the answer give no answer
    ("#### 5 then #### 7", "7", 0.0, 0.0, 0.0, 1.0),
    ("#### 42 = 38 + 7\n#### 42 = 55\n#### 7\n############", "7", 0.0, 0.0, 0.0, 1.0),
    ("#### 7 and then some more text", "7", 0.0, 0.0, 0.0, 1.0),
])
def test_rewards(response, truth, right, fmt, train, lenient):
    assert rewards.correct(None, response, truth) == right and rewards.formatted(None, response) == fmt
    assert rewards.train_reward(None, response, truth) == train
    assert rewards.eval_reward(None, response, truth) == {"score": right, "format": fmt, "lenient": lenient}
    assert rewards.lenient_correct(None, response, truth) == lenient
    assert rewards.lenient_train_reward(None, response, truth) == (1.0 if lenient else 0.1 * ("####" in response))


@pytest.mark.slow
def test_tiny_learning_run_writes_json_and_png(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", "bench", "learn", "--tiny", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "learn_arithmetic.json").read_text())
    assert set(result["modes"]) == {"sync", "async"}
    for run in result["modes"].values():
        points = run["points"]
        assert [p["step"] for p in points] == [0, 1, 2]
        assert points[0]["seconds"] == 0 < points[1]["seconds"] < points[2]["seconds"]
        assert 0 < points[1]["generated_tokens"] < points[2]["generated_tokens"]
        assert all(0 <= p["exact_match"] <= p["exact_match_lenient"] <= 1 and 0 <= p["format"] <= 1 for p in points)
        assert [x["step"] for x in run["lengths"]] == [1, 2] and run["summary"]["steps"] == 2
        assert set(run["gpu"]) == {"source", "window", "gpu_util_mean", "gpu_mem_max_gib", "samples"}
    assert (tmp_path / "learn_arithmetic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "exact_match_end" in out.stdout  # the table of the summaries


def test_the_calculator_environment_scores_the_tasks_answer_format():
    """With `--environment` the held-out exact match is the calculator's reward: every answer the task's exact
    match counts right it counts right, a wrong `#### N` wrong; it also takes a last number without `####`."""
    for row in tasks.heldout_rows(200):
        truth = row["label"]
        for response in (f"So the total is {truth}.\n#### {truth}", f"#### {truth}.", f"12 + 3 = 15. #### {truth}"):
            assert rewards.correct(None, response, truth) == final_number_reward(response, {"answer": truth}) == 1.0
        wrong = f"#### {int(truth) + 1}"
        assert rewards.correct(None, wrong, truth) == final_number_reward(wrong, {"answer": truth}) == 0.0
    assert final_number_reward("#### 1,200", {"answer": "1200"}) == rewards.correct(None, "#### 1,200", "1200") == 1.0
    assert final_number_reward("The answer is 7", {"answer": "7"}) == 1.0 > rewards.correct(None, "The answer is 7", 7)


@pytest.mark.extended  # CI runs the episodes in the RL loop (tests/agent/test_rl_episodes.py) and the bench's
@pytest.mark.slow  # single-turn tiny run; this one (about a minute) runs with `make test-all`
def test_tiny_calculator_episodes_run_writes_tool_calls_to_json_and_png(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", "bench", "learn", "--tiny", "--steps", "1",
                          "--eval-size", "4", "--environment", CALCULATOR, "--out", str(tmp_path)],
                         capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "learn_arithmetic.json").read_text())
    assert set(result["modes"]) == {"sync"}  # the default with --environment
    assert result["settings"]["environment"] == f"{ROOT / CALCULATOR}"
    run = result["modes"]["sync"]
    metrics = [json.loads(line) for line in (tmp_path / "work_arithmetic" / "run_sync" / "metrics.jsonl").open()]
    evals = [m for m in metrics if "eval/pass@1" in m]
    assert [p["step"] for p in run["points"]] == [m["step"] for m in evals] == [0, 1]
    for point, m in zip(run["points"], evals):
        # the exact match is the held-out episodes' pass@1, scored by the environment alone
        assert point["exact_match"] == m["eval/pass@1"] and 0 <= point["exact_match"] <= 1
        assert point["tool_call_rate"] == m["eval/episode/tool_call_rate"] and 0 <= point["tool_call_rate"] <= 1
        assert 1 <= point["turns_mean"] <= 2 and point["format"] is None
    assert [x["step"] for x in run["lengths"]] == [1]
    assert run["lengths"][0]["tool_call_rate"] == metrics[-1]["episode/tool_call_rate"]
    config = json.loads((tmp_path / "work_arithmetic" / "run_sync" / "config.json").read_text())
    assert config["env"]["name"] == result["settings"]["environment"]
    assert not config["reward"]["fn"] and not config["eval"]["reward_fn"]
    samples = [json.loads(line) for line in (tmp_path / "work_arithmetic" / "run_sync" / "samples.jsonl").open()]
    assert samples and all(s["turns"][0]["role"] == "assistant" and s["reward"] == s["episode_reward"]
                           for s in samples)
    assert (tmp_path / "learn_arithmetic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reward_none_trains_on_no_reward_and_still_scores_the_held_out_set(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as when the script runs: its folder first on the path
    spec = importlib.util.spec_from_file_location("bench_learn", ROOT / "bench" / "learn.py")
    learn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(learn)
    stores = {"train": tmp_path / "train", "heldout": tmp_path / "heldout"}

    def argv(*flags):
        return learn.trainer_args(learn.parse_args(["--tiny", *flags]), "tiny", stores, tmp_path / "run", "sync", False)

    plain, none = argv(), argv("--reward", "none", "--cfg", "rl.teacher=/t")
    assert plain[plain.index("--reward.fn") + 1].endswith("rewards.py:train_reward")
    assert "--reward.fn" not in none
    assert none[none.index("--eval.reward_fn") + 1].endswith("rewards.py:eval_reward")
    assert none[-2:] == ["--rl.teacher", "/t"]


def test_a_memory_cap_leaves_the_micro_batch_budget_to_the_trainers_split(tmp_path, monkeypatch):
    """On a GPU the bench fixes 49152-token micro-batches with gradient checkpointing, except under `--cfg
    run.max_gpu_memory_gb=N`, where the trainer's memory split (memory/split.py) picks the budget that fits the cap;
    an explicit flag always wins."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_learn", ROOT / "bench" / "learn.py")
    learn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(learn)
    stores = {"train": tmp_path / "train", "heldout": tmp_path / "heldout"}

    def budget(*flags):
        argv = learn.trainer_args(learn.parse_args(["--tiny", *flags]), "tiny", stores, tmp_path / "r", "sync", True)
        return argv[argv.index("--data.micro_batch_tokens") + 1] if "--data.micro_batch_tokens" in argv else None

    assert budget() == "49152"
    assert budget("--cfg", "run.max_gpu_memory_gb=30") is None
    assert budget("--cfg", "run.max_gpu_memory_gb=30", "--micro-batch-tokens", "8192") == "8192"

    def checkpointing(*flags):
        argv = learn.trainer_args(learn.parse_args(["--tiny", *flags]), "tiny", stores, tmp_path / "r", "sync", True)
        return [v for k, v in zip(argv, argv[1:]) if k == "--model.gradient_checkpointing"]

    # the default 49152-token budget comes with gradient checkpointing (tests/memory/test_kv_fit.py: under 30 GiB)
    assert checkpointing() == ["true"]
    assert checkpointing("--micro-batch-tokens", "4096") == checkpointing("--cfg", "run.max_gpu_memory_gb=30") == []
    assert checkpointing("--cfg", "model.gradient_checkpointing=false") == ["false"]


@pytest.mark.extended
def test_tiny_calculator_episodes_on_gsm8k(shared_data, tmp_path):
    """The calculator tool on real GSM8K questions (the test file re-split): episodes run, are scored by the
    environment against GSM8K's `#### N` answers, and the JSON records the held-out tool-call rate."""
    out = subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", "bench", "learn", "--tiny", "--task", "gsm8k",
                          "--gsm8k", str(shared_data / "gsm8k" / "test.jsonl"), "--steps", "1", "--eval-size", "4",
                          "--environment", CALCULATOR, "--out", str(tmp_path)],
                         capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = json.loads((tmp_path / "learn_gsm8k.json").read_text())["modes"]["sync"]
    assert [p["step"] for p in run["points"]] == [0, 1]
    assert all(0 <= p["tool_call_rate"] <= 1 and 1 <= p["turns_mean"] <= 2 for p in run["points"])
    heldout = [json.loads(line) for line in (tmp_path / "work_gsm8k" / "task" / "heldout.jsonl").open()]
    answers = {json.loads(line)["question"]: json.loads(line)["answer"].rsplit("####", 1)[1].strip().replace(",", "")
               for line in (shared_data / "gsm8k" / "test.jsonl").open()}
    assert len(heldout) == 319
    assert all(answers[row["prompt"].rsplit("\n", 1)[0]] == row["label"] for row in heldout)
    samples = [json.loads(line) for line in (tmp_path / "work_gsm8k" / "run_sync" / "samples.jsonl").open()]
    assert samples and all(s["reward"] == s["episode_reward"] for s in samples)


def _check_demonstration(record: dict, row: dict) -> None:
    """A warm-start demonstration line: `row`'s question, a calculator call that the environment's own parser
    reads back to the call on the problem's expression, the tool's result (the answer), `#### answer`."""
    user, call, tool, answer = record["messages"]
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert user["content"].startswith(row["prompt"] + "\n\n") and "calculator(expression: string)" in user["content"]
    parsed = CalculatorEnv().parse(call["content"])
    assert parsed.error is None and parsed.calls == [ToolCall("calculator", {"expression": row["expression"]})]
    assert calculator(row["expression"]) == tool["content"] == row["label"] == record["answer"]
    assert answer["content"] == f"#### {row['label']}"


def test_warm_start_demonstrations_are_calculator_episodes_of_the_training_stream(tmp_path, monkeypatch):
    learn = bench_module(monkeypatch)
    args = learn.parse_args(["--tiny", "--environment", CALCULATOR, "--warm-start-steps", "3"])
    path = tmp_path / "demos.jsonl"
    assert learn.write_demonstrations(args, resolve_model_source("tiny"), path, 12) == 12
    records = [json.loads(line) for line in path.read_text().splitlines()]
    rows = tasks.training_rows(12, tasks.heldout_rows(500), expressions=True)  # the stream's first problems
    assert len(records) == 12 and rows[:12] == tasks.training_rows(40, tasks.heldout_rows(500), expressions=True)[:12]
    for record, row in zip(records, rows):
        _check_demonstration(record, row)
    assert {"*" in r["expression"] for r in rows} == {True, False}  # products and sums among them


@pytest.mark.parametrize("flags, message", [
    (["--warm-start-steps", "2"], "add --environment"),
    (["--warm-start-steps", "2", "--environment", CALCULATOR, "--task", "gsm8k"], "use --task arithmetic"),
    (["--warm-start-steps", "-1", "--environment", CALCULATOR], "give 0"),
])
def test_warm_start_settings_a_run_cannot_use_are_refused_in_one_line(flags, message, monkeypatch, capsys):
    learn = bench_module(monkeypatch)
    with pytest.raises(SystemExit):
        learn.parse_args(["--tiny", *flags])
    assert message in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.extended  # about a minute: the SFT run, then GRPO from its export
@pytest.mark.slow
def test_tiny_calculator_run_with_a_warm_start_trains_sft_first_and_records_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", "bench", "learn", "--tiny", "--steps", "1",
                          "--eval-size", "4", "--environment", CALCULATOR, "--warm-start-steps", "2",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "learn_arithmetic.json").read_text())
    warm, work = result["warm_start"], tmp_path / "work_arithmetic"
    assert (warm["steps"], warm["demonstrations"], warm["batch_size"]) == (2, 8, 4) and warm["seconds"] > 0
    assert result["settings"]["warm_start_steps"] == 2
    # the tool-call rate and the held-out accuracy of GRPO's step 0, which evaluates the SFT'd model
    start = result["modes"]["sync"]["points"][0]
    assert start["step"] == 0
    assert warm["step0"]["sync"] == {k: start[k] for k in ("exact_match", "tool_call_rate", "turns_mean")}
    # the demonstration file: the training stream's first 8 problems as calculator episodes
    records = [json.loads(line) for line in Path(warm["file"]).read_text().splitlines()]
    rows = tasks.training_rows(8, tasks.heldout_rows(500), expressions=True)
    assert len(records) == 8
    for record, row in zip(records, rows):
        _check_demonstration(record, row)
    # the SFT run: 2 steps on the demonstrations' store, the loss on the assistant turns only
    sft = [m for m in read_metrics(work / "run_warm_start") if "train/loss" in m]
    assert [m["step"] for m in sft] == [1, 2] and [m["train/loss"] for m in sft] == [warm["loss_first"],
                                                                                   warm["loss_last"]]
    store = open_store(work / "store_warm_start")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source("tiny"))
    for i, row in enumerate(rows):
        stored = store.row(i)
        trained = [t for t, m in zip(stored["input_ids"], stored["loss_mask"]) if m]
        assert tokenizer.decode(trained) == f'calculator("{row["expression"]}")<|im_end|>#### {row["label"]}<|im_end|>'
    # GRPO started from the SFT run's export
    config = json.loads((work / "run_sync" / "config.json").read_text())
    assert config["model"]["path"] == str(work / "run_warm_start" / "export")
