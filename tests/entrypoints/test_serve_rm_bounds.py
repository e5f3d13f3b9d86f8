"""`ds-rlhf serve-rm`'s bounds against real clients on raw sockets: malformed or oversized requests get an answer
(400 / 411 / 413) and never a hang or a second parsed request, deep JSON is a 400, a slow or huge client stalls
nobody else, and connections past the limit get a 503. The server is the real one, on the tiny reward model."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from ds_rlhf.entrypoints.serve_rm import Limits, RMScorer, make_server

WAIT_S = 30  # how long a client waits for an answer that must come (a hang fails the test after this)


@pytest.fixture(scope="module")
def scorer(tiny_reward_path):
    return RMScorer(str(tiny_reward_path), batch_size=4, max_len=256)


@pytest.fixture
def serve(scorer):
    made, clients = [], []

    def make(limits: Limits | None = None):
        server = make_server(scorer, "127.0.0.1", 0, limits or Limits())
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append(server)
        return server.server_address[1]

    def connect(port: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        clients.append(sock)
        return sock

    make.connect = connect
    yield make
    for sock in clients:
        sock.close()
    for server in made:
        server.shutdown()
        server.server_close()


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a socket timeout fails the test: no answer)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def post(port: int, body: bytes, connect) -> dict:
    sock = connect(port)
    sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    head, _, payload = read_all(sock).partition(b"\r\n\r\n")
    return {"status": int(head.split()[1]), **json.loads(payload)}


def raw(port: int, request: bytes, connect) -> bytes:
    sock = connect(port)
    sock.sendall(request)
    return read_all(sock)


@pytest.mark.parametrize("header,status,message", [
    (b"Content-Length: -1\r\n", 400, "Content-Length '-1' is not a byte count"),
    (b"", 411, "a POST needs a Content-Length"),
    (b"Content-Length: 314572800\r\n", 413, "the request is 314572800 bytes, more than this server's cap of 16777216"),
], ids=["negative", "missing", "300-MB"])
def test_a_bad_content_length_is_answered_at_once(serve, header, status, message):
    port = serve()
    reply = raw(port, b"POST /score HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n", serve.connect)  # no body sent
    assert reply.startswith(b"HTTP/1.1 %d " % status), reply[:200]
    assert message in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]


def test_a_chunked_body_is_refused_and_never_parsed_as_a_second_request(serve):
    port = serve()
    body = b'{"query": ["a"]}'
    reply = raw(port, b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body), serve.connect)
    assert reply.startswith(b"HTTP/1.1 411 "), reply[:200]
    assert reply.count(b"HTTP/1.1 ") == 1, reply  # one answer, then the connection is closed


def test_json_nested_2_kb_deep_is_a_400(serve):
    port = serve()
    deep = b'{"query": ' + b"[" * 2048 + b"]" * 2048 + b"}"
    assert post(port, deep, serve.connect) == {"status": 400, "error": "the request's JSON is nested too deep"}
    ok = post(port, json.dumps({"query": ["Q: 1+1? A: 2"]}).encode(), serve.connect)
    assert ok["status"] == 200 and len(ok["rewards"]) == 1


def test_a_slow_client_and_a_huge_text_stall_no_other_client(serve):
    port = serve()
    slow = serve.connect(port)  # sends its head and 10 of 100 bytes, then nothing
    slow.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b'{"query":[')
    huge = serve.connect(port)  # one 15 MB text, under the 16 MiB cap
    body = json.dumps({"query": ["hello world the reward model " * 520_000]}).encode()
    huge.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    time.sleep(2.0)  # the huge request is parsed and handed on before the small one comes
    start = time.monotonic()
    small = post(port, json.dumps({"query": ["Q: 2+2? A: 4"]}).encode(), serve.connect)
    assert small["status"] == 200 and len(small["rewards"]) == 1
    assert time.monotonic() - start < 15
    assert json.loads(read_all(huge).partition(b"\r\n\r\n")[2])["rewards"][0] == pytest.approx(
        post(port, json.dumps({"query": ["hello world the reward model " * 300]}).encode(),
             serve.connect)["rewards"][0], abs=1e-4)  # its first max_len tokens were scored, as with 300 repeats
    slow.settimeout(0.5)
    with pytest.raises(TimeoutError):  # still waiting for its body: not answered, not in anybody's way
        slow.recv(1)


def test_connections_past_the_limit_get_a_503(serve):
    port = serve(Limits(max_connections=2))
    idle = [serve.connect(port) for _ in range(2)]  # hold both slots: connected, no request yet
    time.sleep(0.5)
    reply = raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", serve.connect)
    assert reply.startswith(b"HTTP/1.1 503 "), reply[:200]
    assert b"Retry-After: 1" in reply and b"(--max-connections)" in reply
    for sock in idle:
        sock.close()
    deadline = time.monotonic() + WAIT_S
    while True:  # the slots come back as those connections end
        reply = raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", serve.connect)
        if reply.startswith(b"HTTP/1.1 200 ") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
