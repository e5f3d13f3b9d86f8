"""The LLM judge (`--reward.judge MODEL --reward.judge_prompt FILE`): the template's placeholders, the strict score
rule, an OpenAI-compatible server on this machine (scores, concurrency, a deadline, malformed replies), the tiny
model judging in-process, and a 2-step GRPO run scored by the judge."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rewards import BadRewardError, RewardSet, RewardSpec, score_samples
from ds_rlhf.rewards.judge import JudgeReward
from ds_rlhf.rewards.judge_template import parse_score
from ds_rlhf.run.preflight import check_reward
from ds_rlhf.testing.multiproc import clean_env
from tests.recipes.stores import prompt_store
from tests.rewards.http_stub import QuietHandler, serve

ROOT = Path(__file__).resolve().parents[2]
RUBRIC = "Rate the answer.\nQuestion: {prompt}\nAnswer: {response}\nReference: {reference}\nEnd with 'Score: N'.\n"


class JudgeServer:
    """An OpenAI chat-completions server in a thread. The reply depends on the response under judgement (the text
    after `Answer: ` in the message): `good` -> "Score: 7", `fine` -> "Score: 10", `high` -> "Score: 12",
    `chat` -> no score line, `slow` -> "Score: 5" after 3 s, `junk` -> a body that is not JSON; else `default`."""

    def __init__(self, default="Score: 7"):
        self.default, self.bodies, self.in_flight, self.most = default, [], 0, 0
        self.lock = threading.Lock()
        server = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.bodies.append(body)
                    server.in_flight += 1
                    server.most = max(server.most, server.in_flight)
                try:
                    data = server.reply(body)
                finally:
                    with server.lock:
                        server.in_flight -= 1
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up
                    pass


        self.httpd = serve(Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1#judge-model"

    def reply(self, body: dict) -> bytes:
        answer = body["messages"][0]["content"].split("Answer: ", 1)[1].split("\n", 1)[0]
        time.sleep(0.2)  # long enough for concurrent requests to overlap
        text = {"good": "The answer is right.\nScore: 7", "fine": "Score: 10", "high": "Score: 12",
                "chat": "A fine answer overall."}.get(answer, self.default)
        if answer == "slow":
            time.sleep(3)
        if answer == "junk":
            return b"{not json"
        return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    srv = JudgeServer()
    yield srv
    srv.close()


@pytest.fixture
def rubric(tmp_path) -> Path:
    path = tmp_path / "rubric.txt"
    path.write_text(RUBRIC)
    return path


def items(responses, truth="42"):
    return [{"id": f"s{i}", "prompt": f"q{i}", "response": r, "ground_truth": truth, "metadata": {}}
            for i, r in enumerate(responses)]


def judge_set(judge: JudgeReward, weight: float = 1.0) -> RewardSet:
    return RewardSet([RewardSpec(judge, weight, name="judge")])


def test_the_score_rule_reads_only_a_last_line_score_in_range():
    assert parse_score("Looks right.\nScore: 7") == pytest.approx(0.7)
    assert parse_score("score : 7.5\n\n") == pytest.approx(0.75)
    assert parse_score("Score: 10") == 1.0 and parse_score("Score: 0") == 0.0
    for reply in ("Score: 7\nthanks", "Score: 10.5", "Score: -1", "Score: seven", "7", "", "Score: 7/10"):
        assert parse_score(reply) is None, reply


def test_server_scores_are_parsed_normalised_and_sent_concurrently(server, rubric):
    judge = JudgeReward(server.url, str(rubric), batch=4, retry_delays=())
    report = score_samples(judge_set(judge), items(["good"] * 6 + ["fine"] * 2), "fail")
    assert report.scores == pytest.approx([0.7] * 6 + [1.0] * 2)
    assert len(server.bodies) == 8 and server.most > 1 and server.most <= 4  # batched, at most judge_batch at once
    assert {(b["model"], b["temperature"]) for b in server.bodies} == {("judge-model", 0)}
    sent = {b["messages"][0]["content"] for b in server.bodies}
    assert RUBRIC.format(prompt="q0", response="good", reference="42") in sent and len(sent) == 8
    assert report.means()["reward/judge/unparsable"] == 0


def test_unparsable_out_of_range_slow_and_malformed_replies_are_bad_rewards(server, rubric):
    judge = JudgeReward(server.url, str(rubric), batch=8, timeout=1.0, retry_delays=())
    start = time.monotonic()
    report = score_samples(judge_set(judge), items(["good", "chat", "high", "slow", "junk"]), "zero")
    assert time.monotonic() - start < 3  # the slow request is cut at its 1 s deadline
    assert report.scores == pytest.approx([0.7, 0, 0, 0, 0])
    reasons = dict(report.bad)
    assert set(reasons) == {"s1", "s2", "s3", "s4"}
    assert "unparsable" in reasons["s1"] and "A fine answer overall." in reasons["s1"]
    assert "Score: 12" in reasons["s2"]
    assert "no reply within 1s" in reasons["s3"] and "not OpenAI chat completions JSON" in reasons["s4"]
    assert report.means()["reward/judge/unparsable"] == 2 and report.means()["reward/judge/failed"] == 2
    dropped = score_samples(judge_set(judge), items(["good", "chat"]), "drop")
    assert dropped.keep == [True, False]
    with pytest.raises(BadRewardError, match="unparsable"):
        score_samples(judge_set(judge), items(["chat"]), "fail")


def test_the_judge_weighs_in_beside_a_reward_function(server, rubric):
    judge = JudgeReward(server.url, str(rubric), retry_delays=())
    rewards = RewardSet([RewardSpec("gsm8k", 1.0), RewardSpec(judge, 0.5, name="judge")])
    report = score_samples(rewards, items(["good #### 42"], truth="42"), "fail")
    assert report.components["judge"] == [pytest.approx(0.7)]
    assert report.scores == [pytest.approx(1.0 + 0.5 * 0.7)]


def test_the_tiny_model_judging_in_process_writes_no_score_a_reported_bad_reward(tiny_model_path, rubric):
    judge = JudgeReward(str(tiny_model_path), str(rubric), batch=2, max_tokens=6)
    report = score_samples(judge_set(judge), items(["a", "bb", "ccc"]), "zero")
    assert report.scores == [0.0, 0.0, 0.0] and len(report.bad) == 3
    assert all("unparsable" in why for _, why in report.bad)
    assert report.means()["reward/judge/unparsable"] == 3
    with pytest.raises(BadRewardError, match="3 bad reward"):
        score_samples(judge_set(judge), items(["a", "bb", "ccc"]), "fail")


@pytest.mark.parametrize("template, message", [
    ("{prompt} {answer} {response}", "unknown placeholder {answer}"),
    ("{prompt} {} {response}", "unknown placeholder {}"),
    ("{prompt!r} {response}", "unknown placeholder {prompt!r}"),
    ("{prompt}", "no {response} placeholder"),
])
def test_a_template_with_an_unknown_placeholder_is_one_error_line(tmp_path, server, template, message):
    bad = tmp_path / "bad.txt"
    bad.write_text(template)
    cfg = parse_config(["--data.train", str(tmp_path), "--reward.judge", server.url,
                        "--reward.judge_prompt", str(bad)])
    with pytest.raises(ConfigError) as err:
        check_reward(cfg)
    assert message in str(err.value) and "\n" not in str(err.value) and "reward.judge_prompt" in str(err.value)


def test_config_needs_the_template_with_the_judge_and_names_the_issue_spelling(tmp_path, rubric):
    with pytest.raises(ConfigError, match="needs its rubric template"):
        parse_config(["--data.train", str(tmp_path), "--reward.judge", "http://127.0.0.1:9/v1"])
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(["--data.train", str(tmp_path), "--reward.judge", "http://127.0.0.1:9/v1",
                      "--reward.judge_prompt", str(tmp_path / "missing.txt")])
    cfg = parse_config(["--data.train", str(tmp_path), "--rl.reward_judge", "http://127.0.0.1:9/v1",
                        "--rl.judge_prompt", str(rubric)])
    assert (cfg.reward.judge, cfg.reward.judge_prompt) == ("http://127.0.0.1:9/v1", str(rubric))


def test_a_grpo_run_is_scored_by_the_judge_server(tiny_model_path, tmp_path, server, rubric):
    run = subprocess.run(
        [sys.executable, "-m", "ds_rlhf.entrypoints", "train-ppo", "--model.path", str(tiny_model_path),
         "--data.train", str(prompt_store(tmp_path, tiny_model_path)), "--reward.judge", server.url,
         "--reward.judge_prompt", str(rubric), "--reward.judge_max_tokens", "16",
         "--rl.algo", "grpo", "--rl.prompts_per_step", "2", "--rollout.n_samples", "2",
         "--rollout.max_new_tokens", "8", "--rollout.backend", "hf", "--run.steps", "2",
         "--run.output_dir", str(tmp_path / "run"), "--run.progress", "false", "--run.tensorboard", "false"],
        capture_output=True, text=True, timeout=480, cwd=ROOT, env=clean_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(server.bodies) == 2 * 2 * 2  # steps x prompts x samples, each judged once
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward/judge/unparsable" in m]
    assert len(steps) == 2 and all(m["reward/judge/unparsable"] == 0 for m in steps)
    assert all(m["reward/mean"] == pytest.approx(0.7) for m in steps)
