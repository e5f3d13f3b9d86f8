"""Remote rewards (`--reward.fn http://...`) against real HTTP servers on this machine: batching, retries,
timeouts, bad replies, weighted mixes and preflight; then `ds-rlhf serve-rm` scoring a 2-step GRPO run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rewards import BadRewardError, RewardSet, score_samples
from ds_rlhf.rewards.loading import load_reward_fn
from ds_rlhf.rewards.remote import RemoteReward, RemoteRewardError
from ds_rlhf.run.preflight import check_reward
from ds_rlhf.testing.multiproc import clean_env, free_port
from tests.recipes.stores import prompt_store
from tests.rewards.http_stub import QuietHandler, serve

ROOT = Path(__file__).resolve().parents[2]
FAST = (0.01, 0.02, 0.04)  # retry delays for the tests


def length_score(text: str) -> float:
    return float(len(text)) / 10


class Server:
    """A JSON reward server in a thread. `script`: what each request gets, in order, then `default`: a status
    code (an error reply), "sleep" (no reply within the client's timeout), "short" (one value fewer), "text"
    (a string value), or "ok" (`length_score` of each query)."""

    def __init__(self, script=(), default="ok", key="rewards"):
        self.script, self.default, self.key = list(script), default, key
        self.requests: list[dict] = []
        server = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                action = server.script.pop(0) if server.script else server.default
                if action == "sleep":
                    time.sleep(1.5)
                values = [length_score(q) for q in body["query"]]
                if action == "short":
                    values = values[:-1]
                if action == "text":
                    values[0] = "high"
                status = action if isinstance(action, int) else 200
                data = json.dumps({server.key: values} if status == 200 else {"error": "busy"}).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout)
                    pass


        self.httpd = serve(Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request):
    made = []

    def make(*args, **kwargs):
        made.append(Server(*args, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _items(n, truth="7"):
    return [{"prompt": f"Q{i}: ", "response": "a" * (i + 1), "ground_truth": truth, "metadata": {},
             "id": f"s{i}"} for i in range(n)]


def test_batches_are_split_into_requests_of_the_set_size_and_keep_order(server):
    srv = server()
    items = _items(10)
    report = score_samples(RewardSet.from_spec(srv.url, http_batch=4), items, "fail")
    assert sorted(len(r["query"]) for r in srv.requests) == [2, 4, 4]
    assert report.scores == pytest.approx([length_score(it["prompt"] + it["response"]) for it in items])
    sent = {q: (p, r, lab) for req in srv.requests
            for q, p, r, lab in zip(req["query"], req["prompts"], req["responses"], req["labels"])}
    assert sent["Q3: aaaa"] == ("Q3: ", "aaaa", "7")


def test_a_503_is_retried_then_succeeds(server):
    srv = server(script=[503, 503])
    fn = RemoteReward(srv.url, retry_delays=FAST)
    assert fn(["p"], ["xy"], [None], [{}]) == [pytest.approx(0.3)]
    assert len(srv.requests) == 3


def test_a_server_that_never_answers_in_time_is_one_error_naming_the_url(server):
    srv = server(default="sleep")
    rewards = RewardSet.from_spec(srv.url, timeout=0.3)  # the default retries: after 0.5, 1 and 2 s
    with pytest.raises(BadRewardError) as err:
        score_samples(rewards, _items(2), "fail")
    assert f"remote reward {srv.url}: no reply within 0.3s (after 4 attempts; raise reward.timeout" in str(err.value)
    assert len(srv.requests) == 4
    report = score_samples(rewards, _items(2), "zero")  # the bad-reward policy applies
    assert report.all_bad and report.scores == [0.0, 0.0]


def test_a_closed_port_is_named_after_the_retries():
    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(RemoteRewardError, match=rf"remote reward {url}: cannot connect .* \(after 4 attempts; is "
                                                "the reward server running"):
        RemoteReward(url, retry_delays=FAST)(["p"], ["r"], [None], [{}])


@pytest.mark.parametrize("action,message", [
    ("short", "'rewards' has 1 values for a request of 2 items"),
    ("text", "'rewards' holds 'high', not a number"),
    (404, "HTTP 404 Not Found: {\"error\": \"busy\"} (the server refused the request"),
])
def test_a_wrong_reply_is_one_error_naming_the_url_without_retries(server, action, message):
    srv = server(default=action)
    with pytest.raises(RemoteRewardError) as err:
        RemoteReward(srv.url, retry_delays=FAST)(["p", "q"], ["r", "s"], [None, None], [{}, {}])
    assert str(err.value).startswith(f"remote reward {srv.url}: {message}"), str(err.value)
    assert len(srv.requests) == 1


def test_scores_key_is_accepted_and_a_url_loads_as_a_reward_function(server):
    srv = server(key="scores")
    assert load_reward_fn(srv.url)(["ab"], ["c"], [None], [{}]) == [pytest.approx(0.3)]


def test_a_comma_list_mixes_a_rule_and_a_remote_reward_under_weights(server):
    srv = server()
    items = _items(3, truth="7")
    items[1]["response"] = "#### 7"
    rewards = RewardSet.from_spec(f"gsm8k,{srv.url}", "2,0.5", workers=2)  # a URL never goes to the pool
    try:
        assert rewards.names == ["gsm8k", "remote"]
        report = score_samples(rewards, items, "fail")
    finally:
        rewards.close()
    remote = [length_score(it["prompt"] + it["response"]) for it in items]
    assert report.components["remote"] == pytest.approx(remote)
    assert report.components["gsm8k"] == [0.0, 1.0, 0.0]
    assert report.scores == pytest.approx([2 * g + 0.5 * r for g, r in zip([0, 1, 0], remote)])
    assert len(srv.requests) == 1


def test_preflight_reports_an_unreachable_url_in_one_line_within_seconds(tmp_path, server):
    url = f"http://127.0.0.1:{free_port()}/score"
    cfg = parse_config(["--data.train", str(tmp_path), "--reward.fn", f"gsm8k,{url}",
                        "--reward.weights", "1,1"])
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        check_reward(cfg)
    assert time.monotonic() - start < 10
    assert str(err.value).startswith(f"reward.fn='gsm8k,{url}': remote reward {url}: cannot connect (")
    assert "to a GET with a 5s timeout: start the reward server" in str(err.value)
    assert "\n" not in str(err.value)
    srv = server()
    check_reward(parse_config(["--data.train", str(tmp_path), "--reward.fn", srv.url]))  # 501 to a GET: up


# ---- end to end: ds-rlhf serve-rm scores a GRPO run ----------------------------------------------------------


class Recorder:
    """A proxy in front of serve-rm that keeps every (query, reward) the run got."""

    def __init__(self, target: str):
        self.pairs: list[tuple[str, float]] = []
        self.sizes: list[int] = []  # items per request
        recorder = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = urllib.request.Request(target, data=body, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as reply:
                    data = reply.read()
                recorder.pairs += list(zip(json.loads(body)["query"], json.loads(data)["rewards"]))
                recorder.sizes.append(len(json.loads(body)["query"]))
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)


        self.httpd = serve(Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"


def _wait_healthy(port: int, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                assert json.loads(reply.read()) == {"status": "ok"}
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("serve-rm did not come up")


def test_serve_rm_scores_a_grpo_run_as_the_in_process_reward_model(tiny_model_path, tiny_reward_path, tmp_path):
    import torch
    from transformers import AutoTokenizer

    from ds_rlhf.engines.models import RewardModel
    from ds_rlhf.engines.rm_scoring import score_rule, score_text
    from ds_rlhf.recipes.batching import pad_scored

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "ds_rlhf.entrypoints", "serve-rm", str(tiny_reward_path),
                               "--port", str(port), "--batch-size", "3", "--device", "cpu"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=clean_env())
    try:
        _wait_healthy(port, server)
        recorder = Recorder(f"http://127.0.0.1:{port}/score")
        run = subprocess.run(
            [sys.executable, "-m", "ds_rlhf.entrypoints", "train-ppo", "--model.path", str(tiny_model_path),
             "--data.train", str(prompt_store(tmp_path, tiny_model_path)), "--reward.fn", recorder.url,
             "--rl.algo", "grpo", "--rl.prompts_per_step", "2", "--rollout.n_samples", "2",
             "--reward.http_batch", "3",
             "--rollout.max_new_tokens", "8", "--rollout.backend", "hf", "--run.steps", "2",
             "--run.output_dir", str(tmp_path / "run"), "--run.progress", "false", "--run.tensorboard", "false"],
            capture_output=True, text=True, timeout=480, cwd=ROOT, env=clean_env())
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(30)
    assert len(recorder.pairs) == 2 * 2 * 2  # steps x prompts x samples, all scored through the server
    assert sorted(recorder.sizes) == [1, 1, 3, 3]  # reward.http_batch 3: each step's 4 items as 3 + 1
    tok = AutoTokenizer.from_pretrained(tiny_reward_path)
    rule = score_rule(tok)
    model = RewardModel.from_pretrained(tiny_reward_path).eval()
    with torch.no_grad():  # one text at a time: no padding, no micro-batch
        local = [float(model(*pad_scored([score_text(q, tok, rule)], rule, tok.pad_token_id))[0])
                 for q, _ in recorder.pairs]
    assert [r for _, r in recorder.pairs] == pytest.approx(local, abs=1e-4)
    assert len({round(r, 6) for _, r in recorder.pairs}) > 1  # the texts got different scores
