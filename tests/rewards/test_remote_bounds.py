"""The remote reward's hard bounds against real misbehaving servers on this machine (raw sockets in a thread): a
total deadline per request, a reply size cap, redirects, other URL schemes, secrets masked in messages and in what
a run writes; and a stop signal ending a run whose reward server hangs."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rewards import bounded_http
from ds_rlhf.rewards.bounded_http import Interrupted, clear_interrupt, interrupt
from ds_rlhf.rewards.loading import load_reward_fn
from ds_rlhf.rewards.remote import RemoteReward, RemoteRewardError, check_remote
from ds_rlhf.run.context import setup_run
from ds_rlhf.run.preflight import check_reward
from ds_rlhf.testing.multiproc import clean_env
from tests.recipes.stores import prompt_store

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20


class RawServer:
    """A TCP server in a thread: `reply(conn, server)` writes whatever it likes after reading the request's head.
    `sent` counts the bytes the replies got out; `requests` the request lines."""

    def __init__(self, reply):
        self.reply, self.sent, self.requests = reply, 0, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                data = conn.recv(65536)
                if not data:
                    return
                head += data
            self.requests.append(head.split(b"\r\n", 1)[0].decode())
            with contextlib.suppress(OSError):  # the client hung up: what a bounded client does
                self.reply(conn, self)

    def send(self, conn, data: bytes):
        conn.sendall(data)
        self.sent += len(data)

    def close(self):
        self.closed.set()
        self.sock.close()


@pytest.fixture
def raw_server():
    made = []

    def make(reply):
        made.append(RawServer(reply))
        return made[-1]

    yield make
    for s in made:
        s.close()


def drip(conn, server):
    """The reply, one byte every 0.5 s (each socket read gets data well within any per-read timeout)."""
    for byte in b'HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n{"rewards": [1.0]}  ' + b" " * 200:
        if server.closed.is_set():
            return
        server.send(conn, bytes([byte]))
        time.sleep(0.5)


def huge(conn, server, declare=True):
    """A 300 MB reply (with or without its Content-Length), streamed until the client hangs up."""
    size = 300 * MB
    server.send(conn, b"HTTP/1.1 200 OK\r\n" + (f"Content-Length: {size}\r\n".encode() if declare else
                                               b"Connection: close\r\n") + b"\r\n")
    chunk = b"[" * MB
    for _ in range(size // MB):
        server.send(conn, chunk)


def redirect(conn, server):
    location = server.url.replace("/score", "/elsewhere?token=s3cret")
    server.send(conn, f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode())


def not_found(conn, server):
    server.send(conn, b'HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}')


def test_a_dripping_server_is_abandoned_at_the_total_deadline(raw_server):
    srv = raw_server(drip)
    fn = RemoteReward(srv.url, timeout=2, retry_delays=(0.1,))
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"no reply within 2s \(after 2 attempts; raise reward.timeout"):
        fn(["p"], ["r"], [None], [{}])
    assert time.monotonic() - start < 2 * 2 + 10  # two attempts of 2 s, not the 120 s the drip lasts
    assert len(srv.requests) == 2


@pytest.mark.parametrize("declare", [True, False], ids=["content-length", "no-length"])
def test_a_300_mb_reply_is_refused_at_the_cap_without_reading_it(raw_server, declare):
    srv = raw_server(lambda conn, server: huge(conn, server, declare))
    fn = RemoteReward(srv.url, timeout=120, retry_delays=(), max_reply_bytes=4 * MB)
    start = time.monotonic()
    with pytest.raises(RemoteRewardError) as err:
        fn(["p"], ["r"], [None], [{}])
    expected = "declares 314572800 bytes (Content-Length), more than the cap" if declare else "passed the cap"
    assert f"remote reward {srv.url}: the reply {expected} of 4194304 bytes (reward.max_reply_mb" in str(err.value)
    assert time.monotonic() - start < 60
    time.sleep(0.5)
    assert srv.sent < 64 * MB  # the client hung up: the rest was never sent


def test_a_deeply_nested_reply_is_one_error(raw_server):
    body = b"[" * 100_000
    srv = raw_server(lambda conn, server: server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                                      % (len(body), body)))
    with pytest.raises(RemoteRewardError, match=r"^remote reward .*/score: the reply is nested too deep: '\[\[\["):
        RemoteReward(srv.url, retry_delays=())(["p"], ["r"], [None], [{}])


def test_a_redirect_is_reported_with_its_location_and_not_followed(raw_server):
    srv = raw_server(redirect)
    with pytest.raises(RemoteRewardError) as err:
        RemoteReward(srv.url, retry_delays=())(["p"], ["r"], [None], [{}])
    where = srv.url.replace("/score", "/elsewhere?token=***")
    assert str(err.value) == (f"remote reward {srv.url}: HTTP 302 Found, a redirect to {where} (requests are not "
                              "redirected: put the final URL in reward.fn)")
    assert srv.requests == ["POST /score HTTP/1.1"]
    with pytest.raises(ValueError, match=r"answered HTTP 302, a redirect to .*/elsewhere\?token=\*\*\*: requests"):
        check_remote(srv.url)


def test_another_url_scheme_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"^unsupported URL scheme 'ftp' in 'ftp://u:\*\*\*@host/x': a reward "
                                         r"server's URL starts with http:// or https://$"):
        load_reward_fn("ftp://u:pw@host/x")
    cfg = parse_config(["--data.train", str(tmp_path), "--reward.fn", "gsm8k,ftp://host/score",
                        "--reward.weights", "1,1"])
    with pytest.raises(ConfigError, match="unsupported URL scheme 'ftp'"):
        check_reward(cfg)


def test_secrets_in_the_url_are_masked_in_errors_config_json_the_log_and_wandb(raw_server, tmp_path,
                                                                               tiny_model_path, monkeypatch, capsys):
    srv = raw_server(not_found)
    url = srv.url.replace("http://", "http://bob:pw123@") + "?token=s3cret&v=2"
    with pytest.raises(RemoteRewardError) as err:
        RemoteReward(url, retry_delays=())(["p"], ["r"], [None], [{}])
    assert "pw123" not in str(err.value) and "s3cret" not in str(err.value)
    assert srv.url.replace("http://", "http://bob:***@") + "?token=***&v=***: HTTP 404" in str(err.value)

    argv = ["--model.path", str(tiny_model_path), "--run.output_dir", str(tmp_path / "run"), "--reward.fn",
            f"gsm8k,{url}", "--reward.weights", "1,1", "--run.wandb", "true", "--run.tensorboard", "false"]
    monkeypatch.setattr(sys, "argv", ["ds-rlhf-train-ppo", *argv])  # wandb records the command line too
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ctx = setup_run(parse_config(argv), "rl")
    try:
        logger = ctx.metrics_logger(total_steps=1, start_step=0, desc="rl", postfix_keys=())
        assert logger.wandb_run is not None
        logger.close()
    finally:
        ctx.close()
    assert sys.argv[-7] == f"gsm8k,{url}"  # the process's own command line is left as it was
    masked = "gsm8k," + srv.url.replace("http://", "http://bob:***@") + "?token=***&v=***"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["reward"]["fn"] == masked
    out = capsys.readouterr()
    assert str(tmp_path / "run" / "config.json") in out.out  # the log names the resolved config's file
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any("wandb" in p.parts for p in written)
    for text in [out.out, out.err, *(p.read_bytes().decode("latin-1") for p in written)]:
        assert "s3cret" not in text and "pw123" not in text


def late(conn, server):
    time.sleep(0.5)
    server.send(conn, b'HTTP/1.1 200 OK\r\nContent-Length: 18\r\n\r\n{"rewards": [0.5]}')


def test_after_a_stop_signal_a_request_has_the_grace_to_finish_and_a_hung_one_is_cut(raw_server, monkeypatch):
    monkeypatch.setattr(bounded_http, "GRACE_S", 3.0)
    answers, hangs = raw_server(late), raw_server(hang)
    interrupt(signal.SIGTERM)
    time.sleep(3.5)  # the signal came during something else (generation): the step goes on to its rewards
    try:  # an Interrupted (a KeyboardInterrupt) here would stop pytest itself: a failure of this test instead
        assert RemoteReward(answers.url, timeout=60)(["p"], ["r"], [None], [{}]) == [0.5]  # the step can finish
    except Interrupted as exc:
        pytest.fail(f"a request started after the signal was cut before its grace: {exc!r}")
    start = time.monotonic()
    with pytest.raises(Interrupted):  # a hung server: cut 3 s after the request's start, never retried
        RemoteReward(hangs.url, timeout=60)(["p"], ["r"], [None], [{}])
    assert 2.5 < time.monotonic() - start < 3 + 10
    assert len(hangs.requests) == 1


def hang(conn, server):
    """A POST is read, then never answered (until the test ends); the preflight's GET gets a 405."""
    if server.requests[-1].startswith("GET"):
        server.send(conn, b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
        return
    server.closed.wait(300)


@pytest.mark.slow
def test_sigterm_stops_a_run_waiting_on_a_hung_reward_server(raw_server, tmp_path, tiny_model_path):
    srv = raw_server(hang)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ds_rlhf.entrypoints", "train-ppo", "--model.path", str(tiny_model_path),
         "--data.train", str(prompt_store(tmp_path, tiny_model_path)), "--reward.fn", srv.url,
         "--reward.timeout", "300", "--rl.algo", "grpo", "--rl.prompts_per_step", "2",
         "--rollout.n_samples", "2", "--rollout.max_new_tokens", "4", "--rollout.backend", "hf",
         "--run.steps", "2", "--run.output_dir", str(run_dir), "--run.progress", "false",
         "--run.tensorboard", "false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=clean_env())
    try:
        deadline = time.monotonic() + 400
        while not any(r.startswith("POST") for r in srv.requests):  # the preflight GET comes first
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        out = proc.communicate(timeout=60)[0]
        assert time.monotonic() - start < 20, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "a reward request was stopped mid-step; exiting with 143" in out
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "stopped" and status["signal"] == "SIGTERM"


@pytest.fixture(autouse=True)
def _allow_requests_again():
    yield
    clear_interrupt()
