"""The watchdog around vLLM's NCCL weight transfer (`rollout/server/watchdog.py`): a call stuck where no exception
can reach it ends the process with one line naming the cause, when the server process exits and when the call
outlasts its timeout; a call that finishes is left alone, whatever its server does afterwards. One test runs a real
stuck process to its end through `os._exit`; the others record the exit instead."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import torch

from ds_rlhf.rollout.base import Pending
from ds_rlhf.rollout.server import calls, transports
from ds_rlhf.rollout.server.watchdog import EXIT_CODE, exit_if_server_fails


def server(seconds: float, code: int = 3) -> subprocess.Popen:
    """A stand-in server process: it lives `seconds`, then exits with `code`."""
    return subprocess.Popen([sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit({code})"])


def stuck_until_exit(processes, timeout_s: float) -> tuple[list[int], float]:
    """Run a body that waits forever (until the watchdog's exit) under the watchdog; the exit codes it asked for and
    the seconds it took."""
    stuck, codes = threading.Event(), []

    def record(code):
        codes.append(code)
        stuck.set()  # a real exit ends the process; here it ends the wait

    start = time.monotonic()
    with exit_if_server_fails(processes, timeout_s, "weight update of the disaggregated server", poll_s=0.05,
                              exit=record):
        assert stuck.wait(30), "the watchdog never fired"
    return codes, time.monotonic() - start


def test_a_server_that_exits_ends_the_stuck_call_with_one_line(capsys):
    proc = server(0.3, code=3)
    codes, seconds = stuck_until_exit([proc], timeout_s=600)
    assert codes == [EXIT_CODE] and seconds < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: weight update of the disaggregated server: the rollout server "
                             f"(pid {proc.pid}) exited with code 3 while this process waited inside vLLM's NCCL")
    assert "--run.resume latest" in err[0]


def test_a_call_past_its_timeout_ends_the_process(capsys):
    proc = server(60)
    try:
        codes, seconds = stuck_until_exit([proc], timeout_s=1.0)
    finally:
        proc.kill()
        proc.wait()
    assert codes == [EXIT_CODE] and 1.0 <= seconds < 10
    assert "the rollout server did not finish it within 1s" in capsys.readouterr().err


def test_a_finished_call_is_left_alone_when_its_server_exits_later(capsys):
    proc, codes = server(0.3), []
    with exit_if_server_fails([proc], 600, "weight update", poll_s=0.05, exit=codes.append):
        pass
    proc.wait()
    time.sleep(0.2)
    assert codes == [] and capsys.readouterr().err == ""


def test_a_really_stuck_process_is_ended(tmp_path):
    """The default exit (`os._exit`) ends a process whose main thread waits where nothing can interrupt it."""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import subprocess, sys, threading\n"
        "from ds_rlhf.rollout.server.watchdog import exit_if_server_fails\n"
        "srv = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.3)'])\n"
        "with exit_if_server_fails([srv], 600, 'weight update', poll_s=0.05):\n"
        "    threading.Event().wait()\n"
        "print('not reached')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_CODE
    assert "not reached" not in out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: weight update: the rollout server (pid ")
    assert "exited with code 0" in lines[0]


def test_the_nccl_update_runs_under_the_watchdog(monkeypatch):
    """vLLM's NCCL transport (`transports.VLLMNCCL`) sends inside the watchdog, on the engine's own process and
    timeout."""
    events = []

    class Watch:
        def __init__(self, processes, timeout_s, what):
            events.append(("watch", list(processes), timeout_s, what))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append("left")

    class Sender:
        def send(self, named, plan):
            events.append("send")
            transport.client.finished = Pending.done([{"load_seconds": 0.2}])

    class Engine:
        process, timeout_s = object(), 123.0

    monkeypatch.setattr(transports, "exit_if_server_fails", Watch)
    engine = Engine()
    transport = transports.VLLMNCCL(engine, torch.float32)
    transport.client, transport.sender = calls.ServersWeightClient([]), Sender()  # joined already
    nbytes, done = transport.send_to([engine], [], [], wait=True)
    assert events == [("watch", [Engine.process], 123.0, "weight update of the disaggregated server"), "send", "left"]
    assert (nbytes, done.result()) == (0, {"load_seconds": 0.2})
