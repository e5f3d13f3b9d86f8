"""A remote reward: a reward model or verifier behind HTTP, named by its URL in `rl.reward_fn`.

`--rl.reward_fn http://host:port/path` (or `https://...`, also inside a comma list with weights:
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

A batch is sent as requests of at most `batch_size` items (`rl.reward_http_batch`), several at once (`PARALLEL`
threads). Each request waits at most `timeout` seconds (`rl.reward_timeout`); a connection error, a timeout, an
HTTP 429 or 5xx is retried after 0.5, 1 and 2 s (`RETRY_DELAYS`). What still fails, and a reply that is not that
JSON (not a list of numbers, or a list of the wrong length), raises `RemoteRewardError` naming the URL, the HTTP
status or error, and the setting to change; the reward set reports it per sample as a bad reward, so
`rl.on_bad_reward` applies (`fail` stops the run with that line).

Preflight (`check_remote`) sends one GET with a `PROBE_TIMEOUT_S` timeout before any model loads: a server that
does not answer, or answers 404 (no such path), is a one-line error. Any other answer (405 for a POST-only route,
200) counts as reachable; the protocol itself is checked by the first batch.

The standard library's urllib does the HTTP: the protocol is one JSON POST, so no HTTP client package is needed.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import numbers
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

SCHEMES = ("http://", "https://")
DEFAULT_BATCH = 64  # items per request (rl.reward_http_batch)
RETRY_DELAYS = (0.5, 1.0, 2.0)  # seconds before each retry
PARALLEL = 4  # requests in flight at once for one batch
PROBE_TIMEOUT_S = 5.0
REPLY_KEYS = ("rewards", "scores")


class RemoteRewardError(RuntimeError):
    """A remote reward server failed (after retries) or replied with something that is not the protocol's JSON."""


def is_remote(spec) -> bool:
    """Whether a reward spec is a URL (`http://...` or `https://...`)."""
    return isinstance(spec, str) and spec.strip().lower().startswith(SCHEMES)


class _Retryable(Exception):
    """One failed attempt that is worth repeating (connection error, timeout, 429, 5xx)."""

    def __init__(self, what: str, hint: str):
        super().__init__(what)
        self.what, self.hint = what, hint


class RemoteReward:
    """A batched reward function (`(prompts, responses, ground_truths, metadatas) -> [float or dict]`) that asks
    the server at `url`; see the module docstring for the protocol, batching, timeout and retries."""

    reward_style = "batched"

    def __init__(self, url: str, batch_size: int = DEFAULT_BATCH, timeout: float = 30.0,
                 retry_delays: Sequence[float] = RETRY_DELAYS, parallel: int = PARALLEL):
        if not is_remote(url):
            raise ValueError(f"a remote reward URL starts with http:// or https://, got {url!r}")
        if batch_size < 1 or not timeout > 0:
            raise ValueError(f"remote reward {url}: batch size must be >= 1 and timeout > 0, got {batch_size}, "
                             f"{timeout}")
        self.url, self.batch_size, self.timeout = url.strip(), int(batch_size), float(timeout)
        self.retry_delays, self.parallel = tuple(retry_delays), max(1, int(parallel))
        self.__name__ = "remote"

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
                    raise RemoteRewardError(f"remote reward {self.url}: {failure.what} (after {attempts} attempts; "
                                            f"{failure.hint})") from None
                time.sleep(self.retry_delays[attempt])
        raise AssertionError("unreachable")

    def _send(self, data: bytes) -> bytes:
        request = urllib.request.Request(self.url, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return reply.read()
        except urllib.error.HTTPError as exc:
            detail = _snippet(exc.read())
            what = f"HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
            if exc.code == 429 or exc.code >= 500:
                raise _Retryable(what, "check the reward server's log") from None
            raise RemoteRewardError(f"remote reward {self.url}: {what} (the server refused the request: check the "
                                    "URL's path in rl.reward_fn and that the server speaks the protocol: POST "
                                    '{"query": [...], ...} -> {"rewards": [...]})') from None
        except TimeoutError:
            raise _Retryable(f"no reply within {self.timeout:g}s",
                             "raise rl.reward_timeout, or lower rl.reward_http_batch") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise _Retryable(f"no reply within {self.timeout:g}s",
                                 "raise rl.reward_timeout, or lower rl.reward_http_batch") from None
            raise _Retryable(f"cannot connect ({reason})",
                             "is the reward server running? check the URL in rl.reward_fn") from None

    def _parse(self, raw: bytes, n: int) -> list:
        try:
            reply = json.loads(raw)
        except ValueError:
            raise RemoteRewardError(f"remote reward {self.url}: the reply is not JSON: {_snippet(raw)!r} (expected "
                                    '{"rewards": [...]})') from None
        key = next((k for k in REPLY_KEYS if isinstance(reply, dict) and k in reply), None)
        if key is None:
            keys = sorted(map(str, reply))[:8] if isinstance(reply, dict) else type(reply).__name__
            raise RemoteRewardError(f"remote reward {self.url}: the reply has no 'rewards' (or 'scores') list "
                                    f"(got {keys})")
        values = reply[key]
        if not isinstance(values, list) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
            raise RemoteRewardError(f"remote reward {self.url}: '{key}' has {got} for a request of {n} items "
                                    "(one number per item, in order)")
        wrong = next((v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Real)), None)
        if wrong is not None or any(v is None for v in values):
            raise RemoteRewardError(f"remote reward {self.url}: '{key}' holds {wrong!r}, not a number (one number "
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
    """Preflight: one GET of `url` with a `timeout`; ValueError naming the URL when the server does not answer or
    answers 404. Any other HTTP answer means a server is there (a POST-only route answers 405)."""
    url = url.strip()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout):
            return
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            return
        raise ValueError(f"remote reward {url}: the server answered HTTP 404 to a GET (no such path): check the "
                         "path in the URL") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        what = f"no answer within {timeout:g}s" if isinstance(reason, TimeoutError) \
            else f"cannot connect ({reason})"
        raise ValueError(f"remote reward {url}: {what} to a GET with a {timeout:g}s timeout: start the reward "
                         "server (e.g. ds-rlhf serve-rm MODEL_DIR --port N) or fix the URL") from None
