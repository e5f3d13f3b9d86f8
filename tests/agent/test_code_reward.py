"""The `code_tests` reward: a response's code run against its row's tests in the tool sandbox. Right code scores 1,
partly right code the fraction, code that does not load 0 with a crash reported; hostile code (an endless loop, a
fork bomb, file writes outside the scratch directory, a network connection) scores as failed tests within the
budget; the shipped problems' reference solutions pass; an RL run scored by it goes on through hostile responses."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ds_rlhf.agent import sandbox
from ds_rlhf.agent.code_reward import PER_TEST_TIMEOUT_S, SAMPLE_BUDGET_S, extract_code, parse_tests, score_code
from ds_rlhf.config import parse_config
from ds_rlhf.data.prep import prep_prompts
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.rewards import load_reward_fn, score_samples
from ds_rlhf.rollout.base import RolloutSample
from ds_rlhf.rollout.hf_engine import HFRolloutEngine

ROOT = Path(__file__).resolve().parents[2]
PROBLEMS = ROOT / "bench" / "learn_tasks" / "code" / "problems.jsonl"
ADD_TESTS = json.dumps({"setup": "import math", "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0",
                                                          "assert add(2, 2) == 4", "assert add(0, 0) == 0"]})
TEST_TIMEOUT_S = 3 * SAMPLE_BUDGET_S  # a hung reward fails the test here, well above the reward's own budget


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nIt adds the numbers."


def scored(response: str, truth: str = ADD_TESTS) -> tuple[dict, float]:
    """`score_code` of one response, in a thread the test waits on for at most TEST_TIMEOUT_S; (result, seconds)."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(score_code, response, truth).result(timeout=TEST_TIMEOUT_S)
    return result, time.monotonic() - t0


def test_the_code_is_the_last_python_block_else_the_whole_response():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```\nc") == "y = 2\n"
    assert extract_code("```python\nx = 1\n```\n```\nnot python\n```") == "x = 1\n"
    assert extract_code("cut off: ```python\ndef f():\n    return 1") == "def f():\n    return 1"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"


def test_tests_come_as_a_list_or_an_object_with_setup_and_a_row_without_tests_is_an_error():
    assert parse_tests('["assert f(1) == 1"]') == ("", ["assert f(1) == 1"])
    assert parse_tests({"setup": "import os", "tests": ["assert f()"]}) == ("import os", ["assert f()"])
    for bad in ("42 is the answer", "[]", '{"tests": "assert f()"}', None):
        with pytest.raises(ValueError, match="code_tests"):
            parse_tests(bad)


@pytest.mark.parametrize(("body", "score", "extras"), [
    ("def add(a, b):\n    return a + b", 1.0, {"tests_passed": 4, "crashed": 0, "timeouts": 0, "errors": 0}),
    ("def add(a, b):\n    return a + b if a >= 0 else 7", 0.75, {"tests_passed": 3, "crashed": 0}),
    ("def add(a, b):\n    return a + b if a > 0 else math.nan", 0.5, {"tests_passed": 2, "crashed": 0}),
    ("def add(a, b):\n    return [][a]", 0.0, {"tests_passed": 0, "errors": 4, "crashed": 0}),
    ("def add(a, b)\n    return a + b", 0.0, {"tests_passed": 0, "crashed": 1}),
    ("raise SystemExit(3)", 0.0, {"tests_passed": 0, "crashed": 1}),
])
def test_the_reward_is_the_pass_fraction_with_counts_per_sample(body, score, extras):
    report = score_samples(load_reward_fn("code_tests"), [
        {"prompt": "p", "response": fenced(body), "ground_truth": ADD_TESTS, "metadata": {}, "id": "s0"}], "fail")
    assert report.scores == [score] and report.keep == [True] and not report.bad
    assert report.extras["code_tests_reward/tests_total"] == [4.0]
    for key, value in extras.items():
        assert report.extras[f"code_tests_reward/{key}"] == [float(value)], key


def test_an_endless_loop_is_cut_by_each_tests_timer():
    result, seconds = scored(fenced("def add(a, b):\n    while True:\n        pass"))
    assert result["score"] == 0.0 and result["timeouts"] == 4
    assert 4 * PER_TEST_TIMEOUT_S * 0.9 <= seconds < TEST_TIMEOUT_S


def test_a_loop_that_ignores_the_timer_is_cut_by_the_budget():
    result, seconds = scored(fenced("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                                    "def add(a, b):\n    while True:\n        pass"))
    assert result == {"score": 0.0, "tests_passed": 0.0, "tests_total": 4.0, "timeouts": 4.0, "errors": 0.0,
                      "crashed": 0.0}
    assert seconds < SAMPLE_BUDGET_S + 5


def test_a_fork_bomb_fails_its_tests_within_the_budget():
    result, seconds = scored(fenced("import os\ndef add(a, b):\n    while True:\n        os.fork()\n    return a + b"))
    assert result["score"] == 0.0 and result["tests_passed"] == 0
    assert seconds < SAMPLE_BUDGET_S + 5


@pytest.mark.parametrize("where", ["/tmp/{name}", "../{name}"])
def test_writing_outside_the_scratch_directory_fails_the_tests(where, tmp_path):
    name = f"ds_rlhf_code_reward_{uuid.uuid4().hex}"
    code = f"def add(a, b):\n    with open({where.format(name=name)!r}, 'w') as f:\n        f.write('x')\n" \
           "    return a + b"
    result, _ = scored(fenced(code))
    assert result["score"] == 0.0 and result["errors"] == 4  # PermissionError / OSError at each test
    assert not Path("/tmp", name).exists()


def test_a_network_connection_fails_the_tests_and_reaches_nothing():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        accepted = []

        def accept():
            deadline = time.monotonic() + TEST_TIMEOUT_S
            while time.monotonic() < deadline and not accepted:
                try:
                    accepted.append(server.accept())
                except TimeoutError:
                    continue

        watcher = threading.Thread(target=accept, daemon=True)
        watcher.start()
        code = ("import socket\ndef add(a, b):\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n    return a + b")
        result, _ = scored(fenced(code))
        time.sleep(0.5)
        got = list(accepted)
        accepted.append(None)  # stops the watcher
        watcher.join(timeout=5)
    assert result["score"] == 0.0 and result["errors"] == 4
    assert got == []


def test_a_batch_with_hostile_responses_is_scored_and_the_good_one_still_scores_one():
    hostile = ["def add(a, b):\n    while True:\n        pass", "import os\nwhile True:\n    os.fork()",
               "open('/tmp/x', 'w').write('x')", "def add(a, b)"]
    items = [{"prompt": "p", "response": fenced(code), "ground_truth": ADD_TESTS, "metadata": {}, "id": f"s{i}"}
             for i, code in enumerate(["def add(a, b):\n    return a + b", *hostile])]
    with ThreadPoolExecutor(1) as pool:
        report = pool.submit(score_samples, load_reward_fn("code_tests"), items, "fail").result(TEST_TIMEOUT_S)
    assert report.scores == [1.0, 0.0, 0.0, 0.0, 0.0] and not report.bad


def test_every_shipped_problems_reference_solution_passes_and_a_stub_does_not():
    rows = [json.loads(line) for line in PROBLEMS.read_text().splitlines()]
    assert 20 <= len(rows) <= 40 and len({r["task_id"] for r in rows}) == len(rows)
    fn = load_reward_fn("code_tests")
    truths = [json.dumps(r["label"]) for r in rows]
    right = fn([r["prompt"] for r in rows], [fenced(r["canonical_solution"]) for r in rows], truths, [{}] * len(rows))
    assert [r["score"] for r in right] == [1.0] * len(rows)
    assert all(r["tests_total"] >= 3 for r in right)
    stubs = [fenced(r["canonical_solution"].split('"""')[0] + "pass") for r in rows]  # the signature, no body
    wrong = fn([r["prompt"] for r in rows], stubs, truths, [{}] * len(rows))
    assert sum(r["score"] for r in wrong) < len(rows) / 4


class ScriptedCode(HFRolloutEngine):
    """The tiny HF engine, except that each prompt's first sample is a scripted answer teacher-forced with the
    model's own log-probs: the right function for `strlen`, an endless loop at import for `concatenate`."""

    def __init__(self, *args, tokenizer, **kwargs):
        super().__init__(*args, **kwargs)
        self.tok = tokenizer

    def generate(self, prompts, spec):
        samples = super().generate(prompts, spec)
        for k, s in enumerate(samples):
            text = self.tok.decode(s.prompt_ids)
            if s.sample_index == 0:
                answer = fenced("def strlen(string):\n    return len(string)") if "def strlen" in text else \
                    fenced("while True:\n    pass")
                ids = self.tok.encode(answer, add_special_tokens=False) + [self.tok.eos_token_id]
                logprobs = self.logprobs([list(s.prompt_ids) + ids])[0][len(s.prompt_ids) - 1:]
                samples[k] = RolloutSample(s.prompt_index, 0, list(s.prompt_ids), ids, logprobs, "stop")
        return samples


def test_an_rl_run_scored_by_code_tests_goes_on_through_hostile_responses(tiny_model_path, tiny_tokenizer,
                                                                          dist_single, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "_DEFAULT_REQUIRE", [()])  # what env.sandbox_require sets, restored afterwards
    given = tuple(n for n in sandbox.PROTECTIONS if n not in sandbox.Sandbox().run_code("pass").unavailable)
    rows = [json.loads(line) for line in PROBLEMS.read_text().splitlines()]
    chosen = [{**r, "prompt": r["prompt"].split('"""')[0].split("\n\n")[-1]}  # the signature only: the tiny
              for r in rows if r["entry_point"] in ("strlen", "concatenate")]  # model's context is 512 tokens
    raw = tmp_path / "problems.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    prep_prompts(raw, tmp_path / "store", str(tiny_model_path), input_key="prompt", label_key="label",
                 apply_chat_template=False, progress=False, overwrite=True, on_error="fail")
    engine = ScriptedCode(str(tiny_model_path), dtype="float32", batch_size=8, tokenizer=tiny_tokenizer)
    cfg = parse_config(["--model.path", str(tiny_model_path), "--data.train", str(tmp_path / "store"),
                        "--run.output_dir", str(tmp_path / "run"), "--run.steps", "2", "--rl.algo", "grpo",
                        "--reward.fn", "code_tests", "--rl.prompts_per_step", "2", "--rollout.n_samples", "2",
                        "--rollout.max_new_tokens", "24", "--rollout.max_model_len", "512",
                        "--data.max_prompt_len", "128", "--rollout.backend", "hf", "--optim.micro_batch_size", "4",
                        "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false",
                        "--env.sandbox_require", ",".join(given)])
    t0 = time.monotonic()
    history = RLTrainer(cfg, rollout=engine).train()
    assert len(history) == 2
    for h in history:
        assert h["reward/bad"] == 0 and h["reward/code_tests/tests_total"] >= 3
        assert h["reward/max"] == 1.0  # the scripted strlen answer passes every test
        assert h["reward/code_tests/timeouts"] > 0  # the scripted endless loop timed out
    assert time.monotonic() - t0 < 10 * SAMPLE_BUDGET_S
    assert sandbox._DEFAULT_REQUIRE[0] == given  # the code ran with every protection this machine gives required
