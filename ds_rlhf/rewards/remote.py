"""A remote reward: a reward model or verifier behind HTTP, named by its URL in `reward.fn`.

`--reward.fn http://host:port/path` (or `https://...`, also inside a comma list with weights:
`gsm8k,http://host:port/score`) scores each batch of samples by POSTing it as JSON. The protocol is OpenRLHF's
remote reward model protocol, so a server written for OpenRLHF (its `serve_rm`, `{"query": ...}` -> `{"rewards":
...}`) works unchanged, and `ds-rlhf serve-rm` serves ours:

    POST <url>   Content-Type: application/json
    {"query":     [prompt + response, ...],    the full texts (what a reward model scores)
     "prompts":   [prompt, ...],                the rendered prompts
     "responses": [response, ...],              the responses alone
     "labels":    [ground truth or null, ...]}  the prompt store's ground truth (a verifier's answer key)
    -> 200 {"rewards": [float, ...]}            (or "scores"), one per item, in order; optionally
           "extra_logs": {name: [float, ...]}   per-item metrics, logged as reward/remote/<name> (never
                                                the reward: a log named `score` is logged as `extra_score`)

A batch is sent as requests of at most `batch_size` items (`reward.http_batch`), several at once (`PARALLEL`
threads). Each request takes at most `timeout` seconds in all (`reward.timeout`: connecting, sending and the
whole reply, however slowly it comes), and a reply may be at most `max_reply_bytes` (`reward.max_reply_mb`;
a larger one is refused without being read whole); see bounded_http.py. A connection error, a timeout, an HTTP 429
or 5xx is retried after 0.5, 1 and 2 s (`RETRY_DELAYS`). What still fails, a redirect (3xx: reported with its
`Location`, never followed, as a POST must not turn into a GET), a reply over the cap, and a reply that is not that
JSON (not a list of numbers, or a list of the wrong length), raises `RemoteRewardError` naming the URL, the HTTP
status or error, and the setting to change; the reward set reports it per sample as a bad reward, so
`reward.on_bad` applies (`fail` stops the run with that line). After a stop signal (bounded_http.interrupt)
a request has a few seconds left and is not retried; then it raises `Interrupted`. URLs in messages have their
secrets masked (ds_rlhf/redaction.py).

Preflight (`check_remote`) sends one GET with a `PROBE_TIMEOUT_S` timeout before any model loads: a server that
does not answer, answers 404 (no such path) or redirects, is a one-line error. Any other answer (405 for a
POST-only route, 200) counts as reachable; the protocol itself is checked by the first batch.

httpx does the HTTP (a maintained client, already installed with vLLM); bounded_http.py adds the total deadline,
the size cap and the interruption that its per-operation timeouts do not give.
"""

from __future__ import annotations

import concurrent.futures
import json
import numbers
import re
import threading
from collections.abc import Sequence

import httpx

from ds_rlhf.redaction import redact_urls
from ds_rlhf.rewards.bounded_http import DeadlineExceeded, ReplyTooLarge, make_client, pause, request

SCHEMES = ("http://", "https://")
URL_SCHEME = re.compile(r"^\s*([a-zA-Z][a-zA-Z0-9+.-]*)://")
DEFAULT_BATCH = 64  # items per request (reward.http_batch)
DEFAULT_MAX_REPLY_MB = 64  # a reply's size cap (reward.max_reply_mb)
ERROR_BODY_BYTES = 1 << 16  # what preflight reads of a GET's page
RETRY_DELAYS = (0.5, 1.0, 2.0)  # seconds before each retry
PARALLEL = 4  # requests in flight at once for one batch
PROBE_TIMEOUT_S = 5.0
REPLY_KEYS = ("rewards", "scores")
PROTOCOL = 'POST {"query": [...], ...} -> {"rewards": [...]}'


class RemoteRewardError(RuntimeError):
    """A remote reward server failed (after retries) or replied with something that is not the protocol's JSON."""


def is_remote(spec) -> bool:
    """Whether a reward spec is a URL (`http://...` or `https://...`)."""
    return isinstance(spec, str) and spec.strip().lower().startswith(SCHEMES)


def check_scheme(spec: str) -> None:
    """ValueError for a spec that is a URL of a scheme other than http/https (`ftp://...`), naming the scheme."""
    match = URL_SCHEME.match(spec) if isinstance(spec, str) else None
    if match and not is_remote(spec):
        raise ValueError(f"unsupported URL scheme '{match.group(1)}' in {redact_urls(spec.strip())!r}: a reward "
                         "server's URL starts with http:// or https://")


class _Retryable(Exception):
    """One failed attempt that is worth repeating (connection error, timeout, 429, 5xx)."""

    def __init__(self, what: str, hint: str):
        super().__init__(what)
        self.what, self.hint = what, hint


class RemoteReward:
    """A batched reward function (`(prompts, responses, ground_truths, metadatas) -> [float or dict]`) that asks
    the server at `url`; see the module docstring for the protocol, batching, bounds and retries."""

    reward_style = "batched"

    def __init__(self, url: str, batch_size: int = DEFAULT_BATCH, timeout: float = 30.0,
                 retry_delays: Sequence[float] = RETRY_DELAYS, parallel: int = PARALLEL,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_MB << 20):
        check_scheme(url)
        if not is_remote(url):
            raise ValueError(f"a remote reward URL starts with http:// or https://, got {redact_urls(url)!r}")
        if batch_size < 1 or not timeout > 0 or max_reply_bytes < 1:
            raise ValueError(f"remote reward {redact_urls(url)}: batch size must be >= 1, timeout > 0 and the reply "
                             f"cap >= 1 byte, got {batch_size}, {timeout}, {max_reply_bytes}")
        self.url, self.batch_size, self.timeout = url.strip(), int(batch_size), float(timeout)
        self.shown = redact_urls(self.url)  # the URL in messages
        self.retry_delays, self.parallel = tuple(retry_delays), max(1, int(parallel))
        self.max_reply_bytes = int(max_reply_bytes)
        self.__name__ = "remote"
        self._client: httpx.Client | None = None
        self._client_lock = threading.Lock()

    def __getstate__(self) -> dict:  # a client holds sockets and locks: each process makes its own
        return {**self.__dict__, "_client": None, "_client_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _client_lock=threading.Lock())

    def __call__(self, prompts, responses, ground_truths, metadatas) -> list:
        n = len(responses)
        bodies = [{"query": [p + r for p, r in zip(prompts[i:i + self.batch_size], responses[i:i + self.batch_size])],
                   "prompts": list(prompts[i:i + self.batch_size]),
                   "responses": list(responses[i:i + self.batch_size]),
                   "labels": [None if t is None else str(t) for t in ground_truths[i:i + self.batch_size]]}
                  for i in range(0, n, self.batch_size)]
        if len(bodies) <= 1:
            replies = [self._post(b) for b in bodies]
        else:
            with concurrent.futures.ThreadPoolExecutor(min(self.parallel, len(bodies))) as pool:
                replies = list(pool.map(self._post, bodies))
        return [value for reply in replies for value in reply]

    def _post(self, body: dict) -> list:
        """One request with its retries: the per-item values, or RemoteRewardError."""
        data = json.dumps(body).encode()
        attempts = len(self.retry_delays) + 1
        for attempt in range(attempts):
            try:
                return self._parse(self._send(data), len(body["query"]))
            except _Retryable as failure:
                if attempt + 1 == attempts:
                    raise RemoteRewardError(f"remote reward {self.shown}: {failure.what} (after {attempts} "
                                            f"attempts; {failure.hint})") from None
                pause(self.retry_delays[attempt])
        raise AssertionError("unreachable")

    def client(self) -> httpx.Client:
        with self._client_lock:
            if self._client is None:
                self._client = make_client(self.timeout)
            return self._client

    def _send(self, data: bytes) -> bytes:
        try:
            reply = request(self.client(), "POST", self.url, content=data, timeout=self.timeout,
                            max_bytes=self.max_reply_bytes, headers={"Content-Type": "application/json"})
        except DeadlineExceeded as exc:
            raise _Retryable(str(exc), "raise reward.timeout, or lower reward.http_batch") from None
        except ReplyTooLarge as exc:
            raise RemoteRewardError(f"remote reward {self.shown}: {exc} (reward.max_reply_mb; lower "
                                    "reward.http_batch, or raise the cap if the server's replies are this big)") \
                from None
        except httpx.TimeoutException:
            raise _Retryable(f"no reply within {self.timeout:g}s",
                             "raise reward.timeout, or lower reward.http_batch") from None
        except (httpx.HTTPError, OSError) as exc:
            what = "cannot connect" if isinstance(exc, (httpx.ConnectError, ConnectionError)) else "the request failed"
            raise _Retryable(f"{what} ({redact_urls(str(exc)) or type(exc).__name__})",
                             "is the reward server running? check the URL in reward.fn") from None
        if reply.status == 200:
            return reply.body
        detail = _snippet(reply.body)
        what = f"HTTP {reply.status} {reply.reason}" + (f": {detail}" if detail else "")
        if 300 <= reply.status < 400:
            raise RemoteRewardError(f"remote reward {self.shown}: HTTP {reply.status} {reply.reason}, a redirect to "
                                    f"{redact_urls(reply.location or '(no Location)')} (requests are not "
                                    "redirected: put the final URL in reward.fn)")
        if reply.status == 429 or reply.status >= 500:
            raise _Retryable(what, "check the reward server's log")
        raise RemoteRewardError(f"remote reward {self.shown}: {what} (the server refused the request: check the "
                                "URL's path in reward.fn and that the server speaks the protocol: "
                                f"{PROTOCOL})")

    def _parse(self, raw: bytes, n: int) -> list:
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the decoder's stack
            what = "is nested too deep" if isinstance(exc, RecursionError) else "is not JSON"
            raise RemoteRewardError(f"remote reward {self.shown}: the reply {what}: {_snippet(raw)!r} (expected "
                                    '{"rewards": [...]})') from None
        key = next((k for k in REPLY_KEYS if isinstance(reply, dict) and k in reply), None)
        if key is None:
            keys = sorted(map(str, reply))[:8] if isinstance(reply, dict) else type(reply).__name__
            raise RemoteRewardError(f"remote reward {self.shown}: the reply has no 'rewards' (or 'scores') list "
                                    f"(got {keys})")
        values = reply[key]
        if not isinstance(values, list) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
            raise RemoteRewardError(f"remote reward {self.shown}: '{key}' has {got} for a request of {n} items "
                                    "(one number per item, in order)")
        wrong = next((v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Real)), None)
        if wrong is not None or any(v is None for v in values):
            raise RemoteRewardError(f"remote reward {self.shown}: '{key}' holds {wrong!r}, not a number (one number "
                                    "per item)")
        logs = reply.get("extra_logs") if isinstance(reply.get("extra_logs"), dict) else {}
        return with_logs(values, {k: v for k, v in logs.items() if isinstance(v, list)})


def with_logs(rewards: list, logs: dict[str, list]) -> list:
    """Each reward with its per-item `extra_logs` as a `{"score": reward, name: value, ...}` dict (the logs are
    metrics only: one named `score` is kept as `extra_score`, never in the reward's place); logs whose length is
    not the rewards' are left out; the rewards as they are without logs."""
    logs = {("extra_score" if str(k) == "score" else str(k)): v for k, v in logs.items() if len(v) == len(rewards)}
    if not logs:
        return list(rewards)
    return [{**{k: v[i] for k, v in logs.items()}, "score": r} for i, r in enumerate(rewards)]


def _snippet(raw: bytes, limit: int = 160) -> str:
    text = raw.decode("utf-8", "replace").strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def check_remote(url: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Preflight: one GET of `url` within `timeout` s; ValueError naming the URL (its secrets masked) when the
    server does not answer, answers 404 or redirects. Any other HTTP answer means a server is there (a POST-only
    route answers 405)."""
    check_scheme(url)
    url, shown = url.strip(), redact_urls(url.strip())
    try:
        with make_client(timeout) as client:
            reply = request(client, "GET", url, timeout=timeout, max_bytes=ERROR_BODY_BYTES)
    except ReplyTooLarge:
        return  # a big page: a server is there
    except (DeadlineExceeded, httpx.TimeoutException):
        what = f"no answer within {timeout:g}s"
    except (httpx.HTTPError, OSError) as exc:
        what = f"cannot connect ({redact_urls(str(exc)) or type(exc).__name__})"
    else:
        if reply.status == 404:
            raise ValueError(f"remote reward {shown}: the server answered HTTP 404 to a GET (no such path): check "
                             "the path in the URL")
        if 300 <= reply.status < 400:
            raise ValueError(f"remote reward {shown}: the server answered HTTP {reply.status}, a redirect to "
                             f"{redact_urls(reply.location or '(no Location)')}: requests are not redirected, put "
                             "the final URL in reward.fn")
        return
    raise ValueError(f"remote reward {shown}: {what} to a GET with a {timeout:g}s timeout: start the reward "
                     "server (e.g. ds-rlhf serve-rm MODEL_DIR --port N) or fix the URL")
