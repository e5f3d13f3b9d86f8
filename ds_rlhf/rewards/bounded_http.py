"""One HTTP request with hard bounds, for the remote reward: httpx speaks the protocol; this module bounds it.

- **A total deadline.** httpx's timeouts bound each connect, read and write, so a server that drips a byte a
  second never trips them. Here a watchdog thread shuts the request's socket down at the deadline, which ends a
  blocked connect, read or write at once; the request then raises `DeadlineExceeded`. The socket is learnt from
  httpcore's `trace` extension (the stream of each `connect_tcp` / `start_tls`); connections are not kept alive, so
  the socket a request registered is the one it uses.
- **A reply size cap.** The reply is streamed: a `Content-Length` above `max_bytes` is refused before any of the
  body is read, and a body without one is read only until it passes the cap (`ReplyTooLarge`).
- **No redirects** (httpx's default): a 3xx comes back as it is, with its `Location`, for the caller to report.
- **A stop signal.** After `interrupt(signum)` (GracefulStop calls it on SIGTERM / SIGINT) a request may take
  `GRACE_S` seconds at most, counted from the signal for one open then, from its start for a later one: one that
  completes in that time returns as usual (the step finishes and is saved); one still open then is cut and raises
  `Interrupted`, a KeyboardInterrupt (reward calling lets it through, as Ctrl-C), as does a retry after the signal,
  so a run stops within seconds even while a reward server hangs. `interrupt` only sets numbers (it runs inside a
  signal handler: no locks, no threads).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import httpx

CONNECTION_EVENTS = ("connection.connect_tcp.complete", "connection.start_tls.complete")
GRACE_S = 5.0  # after a stop signal: how long requests may still take
TICK_S = 0.1  # how often the watchdog looks at the deadlines
IDLE_S = 5.0  # the watchdog thread ends after this long with no request open (the next request starts it again)
_signal = {"signum": 0, "at": 0.0}  # the stop signal and when it came (monotonic)
_open: set[_Bounds] = set()
_watchdog_lock = threading.Lock()
_watchdog: list[threading.Thread] = []


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
    """One request's deadline, sockets and why they were cut ("deadline" / "interrupt"; "" while not cut)."""

    def __init__(self, start: float, timeout: float):
        self.start, self.end = start, start + timeout
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


def _deadline(bounds: _Bounds) -> float:
    """A request's deadline: its own end, and after a stop signal no later than GRACE_S after the signal or the
    request's start, whichever came last."""
    if not _signal["signum"]:
        return bounds.end
    return min(bounds.end, max(bounds.start, _signal["at"]) + GRACE_S)


def _watch() -> None:
    """Cut each open request at its deadline; the thread ends once nothing has been open for IDLE_S."""
    idle = 0.0
    while True:
        time.sleep(TICK_S)
        now, open_now = time.monotonic(), list(_open)
        for bounds in open_now:
            if now >= _deadline(bounds):
                bounds.cut("interrupt" if _signal["signum"] else "deadline")
        idle = 0.0 if open_now else idle + TICK_S
        if idle >= IDLE_S:
            with _watchdog_lock:  # a request adds itself to _open before it looks for the watchdog
                if not _open:
                    _watchdog.clear()
                    return
            idle = 0.0


def _ensure_watchdog() -> None:
    with _watchdog_lock:
        if not _watchdog:
            _watchdog.append(threading.Thread(target=_watch, daemon=True, name="ds_rlhf-http-deadlines"))
            _watchdog[0].start()


def interrupt(signum: int) -> None:
    """A stop signal: each request has GRACE_S seconds left, from now or from its later start (module docstring)."""
    if not _signal["signum"]:
        _signal["at"] = time.monotonic()
        _signal["signum"] = signum


def clear_interrupt() -> None:
    """Forget the stop signal (a process that goes on after a stopped run, such as a test)."""
    _signal["signum"] = 0


def pause(seconds: float) -> None:
    """Sleep `seconds` (between retries); Interrupted instead once a stop signal came (a retry is not worth it)."""
    end = time.monotonic() + seconds
    while not _signal["signum"] and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, TICK_S))
    if _signal["signum"]:
        raise Interrupted(_signal["signum"])


def make_client(timeout: float) -> httpx.Client:
    """A client whose connections are closed after each request (see the module docstring) and that follows no
    redirect."""
    return httpx.Client(timeout=timeout, follow_redirects=False,
                        limits=httpx.Limits(max_keepalive_connections=0))


def request(client: httpx.Client, method: str, url: str, *, timeout: float, max_bytes: int,
            content: bytes | None = None, headers: dict | None = None) -> Reply:
    """`method url` within `timeout` seconds in all, its body at most `max_bytes`; httpx's errors pass through
    (a connection refused, a malformed reply) unless the deadline or a stop signal cut the request."""
    bounds = _Bounds(time.monotonic(), timeout)
    _open.add(bounds)
    _ensure_watchdog()
    try:
        with client.stream(method, url, content=content, timeout=timeout, extensions={"trace": bounds.trace},
                           headers={"Accept-Encoding": "identity", **(headers or {})}) as response:
            reply = Reply(response.status_code, response.reason_phrase, response.headers.get("location"),
                          _read(response, max_bytes))
    except (httpx.HTTPError, OSError, ValueError, AttributeError):  # what a socket shut down mid-request raises
        if not bounds.cut_by:
            raise
    finally:
        _open.discard(bounds)
    if bounds.cut_by == "interrupt":
        raise Interrupted(_signal["signum"])
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
