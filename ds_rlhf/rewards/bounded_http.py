"""One HTTP request with hard bounds, for the remote reward: httpx speaks the protocol; this module bounds it.

- **A total deadline.** httpx's timeouts bound each connect, read and write, so a server that drips a byte a
  second never trips them. Here a timer shuts the request's socket down at the deadline, which ends a blocked
  connect, read or write at once; the request then raises `DeadlineExceeded`. The socket is learnt from httpcore's
  `trace` extension (the stream of each `connect_tcp` / `start_tls`); connections are not kept alive, so the socket
  a request registered is the one it uses.
- **A reply size cap.** The reply is streamed: a `Content-Length` above `max_bytes` is refused before any of the
  body is read, and a body without one is read only until it passes the cap (`ReplyTooLarge`).
- **No redirects** (httpx's default): a 3xx comes back as it is, with its `Location`, for the caller to report.
- **Interruption.** `interrupt(signum)` (GracefulStop calls it on SIGTERM / SIGINT) shuts every open request's
  socket down and makes each request in flight or started later raise `Interrupted`, a KeyboardInterrupt (reward
  calling lets it through, as Ctrl-C), so a run stops within seconds even while a reward server hangs. It takes no
  lock: it runs inside a signal handler.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass

import httpx

CONNECTION_EVENTS = ("connection.connect_tcp.complete", "connection.start_tls.complete")
_interrupted = threading.Event()
_signum = [0]
_open: set[_Bounds] = set()


class DeadlineExceeded(Exception):
    """No complete reply within the request's deadline."""


class ReplyTooLarge(Exception):
    """The reply is (or declares to be) larger than the cap; its body was not read whole."""


class Interrupted(KeyboardInterrupt):
    """The process got a stop signal (`interrupt`); `signum` names it."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


@dataclass
class Reply:
    status: int
    reason: str
    location: str | None  # a redirect's target
    body: bytes


class _Bounds:
    """One request's sockets and why they were cut ("deadline" / "interrupt"; "" while not cut)."""

    def __init__(self):
        self.sockets: list[socket.socket] = []
        self.cut_by = ""

    def trace(self, event: str, info: dict) -> None:
        if event in CONNECTION_EVENTS:
            sock = info["return_value"].get_extra_info("socket")
            if sock is not None:
                self.sockets.append(sock)
                if self.cut_by:  # cut while it was connecting
                    _shut(sock)

    def cut(self, why: str) -> None:
        self.cut_by = self.cut_by or why
        for sock in list(self.sockets):
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed already: nothing to wake
        sock.shutdown(socket.SHUT_RDWR)


def interrupt(signum: int) -> None:
    """Stop every request now and every later one at its start (signal-handler safe: no locks)."""
    _signum[0] = _signum[0] or signum
    _interrupted.set()
    for bounds in list(_open):
        bounds.cut("interrupt")


def clear_interrupt() -> None:
    """Allow requests again after `interrupt` (a process that goes on after a stopped run, such as a test)."""
    _signum[0] = 0
    _interrupted.clear()


def pause(seconds: float) -> None:
    """Sleep `seconds` (between retries), or raise Interrupted as soon as `interrupt` is called."""
    if _interrupted.wait(seconds):
        raise Interrupted(_signum[0])


def make_client(timeout: float) -> httpx.Client:
    """A client whose connections are closed after each request (see the module docstring) and that follows no
    redirect."""
    return httpx.Client(timeout=timeout, follow_redirects=False,
                        limits=httpx.Limits(max_keepalive_connections=0))


def request(client: httpx.Client, method: str, url: str, *, timeout: float, max_bytes: int,
            content: bytes | None = None, headers: dict | None = None) -> Reply:
    """`method url` within `timeout` seconds in all, its body at most `max_bytes`; httpx's errors pass through
    (a connection refused, a malformed reply) unless the deadline or an interrupt cut the request."""
    if _interrupted.is_set():
        raise Interrupted(_signum[0])
    bounds = _Bounds()
    timer = threading.Timer(timeout, bounds.cut, ("deadline",))
    timer.daemon = True
    _open.add(bounds)
    timer.start()
    try:
        with client.stream(method, url, content=content, timeout=timeout, extensions={"trace": bounds.trace},
                           headers={"Accept-Encoding": "identity", **(headers or {})}) as response:
            reply = Reply(response.status_code, response.reason_phrase, response.headers.get("location"),
                          _read(response, max_bytes))
    except (httpx.HTTPError, OSError, ValueError, AttributeError):  # what a socket shut down mid-request raises
        if not bounds.cut_by:
            raise
    finally:
        timer.cancel()
        _open.discard(bounds)
    if bounds.cut_by == "interrupt" or _interrupted.is_set():
        raise Interrupted(_signum[0])
    if bounds.cut_by == "deadline":
        raise DeadlineExceeded(f"no reply within {timeout:g}s")
    return reply


def _read(response: httpx.Response, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ReplyTooLarge(f"the reply declares {int(declared)} bytes (Content-Length), more than the cap of "
                            f"{max_bytes} bytes")
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise ReplyTooLarge(f"the reply passed the cap of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
