"""A single-node run's rendezvous listens on 127.0.0.1 only: torch's TCPStore (unauthenticated) and gloo's own
listeners are read from /proc/net/tcp{,6} (what `ss -ltn` shows) while the process group is up. A multi-node run
keeps the launcher's address (`single_node` is False there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_rlhf.distributed import clean_dist_env, free_port, single_node

ROOT = Path(__file__).resolve().parents[2]

# Prints (as JSON) the listening TCP sockets this process owns: /proc/net/tcp{,6} rows in state 0A (LISTEN) whose
# inode is one of this process's socket fds.
_LISTENERS = r"""
import ipaddress, json, os

def listeners():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:
                continue
            addr, port = cols[1].split(":")
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per 32-bit word, host order
            out.append([str(ipaddress.ip_address(raw)), int(port, 16)])
    return out
"""

_WORLD_OF_ONE = _LISTENERS + r"""
import shutil, subprocess
from ds_rlhf.distributed import ensure_distributed
import torch, torch.distributed as dist
ensure_distributed()
t = torch.ones(1)
dist.all_reduce(t)
print("LISTENERS " + json.dumps(listeners()), flush=True)
if shutil.which("ss"):  # the same, as `ss -ltnp` shows it: this process's listening sockets
    mine = [line.split()[3] for line in subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
            .splitlines() if f"pid={os.getpid()}," in line]
    print("SS " + json.dumps(mine), flush=True)
os._exit(0)
"""

_TWO_RANKS = _LISTENERS + r"""
import datetime
from ds_rlhf.distributed import init_loopback_group
import torch, torch.distributed as dist
init_loopback_group("gloo", datetime.timedelta(seconds=120))
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == 2.0
print("LISTENERS " + json.dumps(listeners()), flush=True)
dist.barrier()
os._exit(0)
"""


def _listeners(out: str) -> list[list]:
    line = next(line for line in out.splitlines() if line.startswith("LISTENERS "))
    return json.loads(line.split(" ", 1)[1])


def _env(**extra) -> dict:
    env = clean_dist_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)
    env.pop("GLOO_SOCKET_IFNAME", None)
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def _assert_loopback_only(found: list[list]) -> None:
    assert found, "the process group listens nowhere? (the probe found no listener of this process)"
    outside = [(addr, port) for addr, port in found if addr not in ("127.0.0.1", "::1")]
    assert not outside, f"listeners outside loopback: {outside} (all: {found})"


def test_a_plain_python_run_listens_on_loopback_only():
    """`python train.py` (no launcher): the run's store and gloo listen on 127.0.0.1, never on `*`."""
    proc = subprocess.run([sys.executable, "-c", _WORLD_OF_ONE], env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_loopback_only(_listeners(proc.stdout))
    ss = [line for line in proc.stdout.splitlines() if line.startswith("SS ")]
    if ss:  # `ss -ltnp` agrees: every local address is 127.0.0.1:<port>
        shown = json.loads(ss[0].split(" ", 1)[1])
        assert shown and all(addr.startswith("127.0.0.1:") for addr in shown), shown


def test_two_ranks_on_one_node_rendezvous_on_loopback():
    """A launcher's single-node env (WORLD_SIZE = LOCAL_WORLD_SIZE = 2): both ranks meet on 127.0.0.1."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="localhost", MASTER_PORT=str(port)))
             for r in range(2)]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, err[-3000:]
        outs.append(out)
    master = _listeners(outs[0])
    assert [addr for addr, p in master if p == port] == ["127.0.0.1"], master
    for out in outs:
        _assert_loopback_only(_listeners(out))


def test_the_weight_group_store_of_a_local_rollout_server_listens_on_loopback():
    """The trainer's weight-sync store (rank 0 of WeightGroup) with the rollout server on this host."""
    import threading

    import torch

    from ds_rlhf.rollout.weights.group import WeightGroup

    port, seen, done = free_port(), {}, threading.Event()
    namespace: dict = {}
    exec(_LISTENERS, namespace)

    def member(rank: int) -> None:
        group = WeightGroup("127.0.0.1", port, 2, rank, timeout_s=60)
        buf = torch.full((4,), 7 if rank == 0 else 0, dtype=torch.uint8)
        group.broadcast(buf).wait()
        seen[rank] = buf.tolist()
        if rank == 0:
            seen["listeners"] = [addr for addr, p in namespace["listeners"]() if p == port]
            done.set()
        done.wait(60)
        group.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert seen[1] == [7, 7, 7, 7]
    assert seen["listeners"] == ["127.0.0.1"], seen["listeners"]


@pytest.mark.parametrize(("env", "expected"), [
    ({}, True),                                                            # plain python
    ({"WORLD_SIZE": "1"}, True),
    ({"WORLD_SIZE": "8", "LOCAL_SIZE": "8"}, True),                       # deepspeed launcher, one node
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, True),                 # accelerate / torchrun env, one node
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, False),               # two nodes: the launcher's address
    ({"WORLD_SIZE": "16"}, False),                                        # local size unknown: keep torch's store
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),  # torchrun's
])
def test_single_node_is_told_from_the_launcher_env(env, expected):
    assert single_node(env) is expected


def test_unpinned_lifts_only_the_loopback_pin_this_process_set(monkeypatch):
    """A weight-sync group with a remote host is built without our GLOO_SOCKET_IFNAME=lo; a user's value stays."""
    import ds_rlhf.distributed as distributed

    monkeypatch.setattr(distributed, "_PINNED", {"GLOO_SOCKET_IFNAME": "lo"})
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with distributed.unpinned():
        assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")  # the user's choice, not our pin
    with distributed.unpinned():
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth1"
