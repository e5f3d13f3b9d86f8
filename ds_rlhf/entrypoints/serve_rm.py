"""`ds-rlhf serve-rm MODEL_DIR`: serve a reward model over HTTP, so several RL runs share one copy of it
(`--reward.fn http://HOST:PORT/score` in each run).

The protocol is the remote reward protocol of ds_rlhf/rewards/remote.py (OpenRLHF's): POST any path with JSON
`{"query": [prompt + response text, ...], ...}` and get `{"rewards": [float, ...]}`, one per text, in order (the
other request fields, `prompts`, `responses`, `labels`, are accepted and not needed). `GET /health` answers
`{"status": "ok"}`. Each text is scored as RL's reward stage scores a rollout: tokenized, ended at the score token by
the tokenizer's score rule (engines/rm_scoring.py), and read at that token by `RewardModel`. Items of concurrent
requests are scored together, in micro-batches of at most --batch-size texts, on one device. Texts longer than
--max-len tokens keep their first --max-len - 1 tokens plus the score token (as a truncated response); a text is
cut to its first --max-len x `CHARS_PER_TOKEN` characters before it is tokenized, so a huge text costs no more than
one that just fills --max-len.

The server is the standard library's `http.server.ThreadingHTTPServer`: one thread per connection, so a slow or
huge client holds only its own thread, and a blocking torch forward needs no event loop around it (uvicorn, an
ASGI server, is installed with vLLM but would add an event loop, a thread hop per request and a dependency of its
own for a one-route protocol). The bounds around it:
- a request's body is at most --max-request-mb (413 before any of it is read); its `Content-Length` is required
  (411 without one; a chunked body, `Transfer-Encoding`, is answered 411 too, never parsed as a second request)
  and must be a byte count (400); the body must arrive within --request-timeout seconds in all (408); each of
  these answers closes the connection;
- JSON nested deeper than the decoder's stack is a 400, like any other JSON that is not the protocol's;
- texts are tokenized in the request's own thread; one thread scores for everybody (`Batcher`), and at most
  --max-queue requests wait for it: more get a 503 with `Retry-After` (the reward client retries a 503);
- at most --max-connections connections are served at once: the next one gets a 503 at once and is closed; an idle
  or stalled connection is closed after --request-timeout seconds without a byte.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from ds_rlhf.engines.models import RewardModel
from ds_rlhf.engines.rm_scoring import score_rule, score_text
from ds_rlhf.errors import ConfigError
from ds_rlhf.recipes.batching import pad_scored

PROG = "ds-rlhf serve-rm"
CHARS_PER_TOKEN = 32  # a text is cut to max_len x this many characters before tokenizing
READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class Limits:
    """What one request may take: body size, time to arrive, waiting room, connections at once."""

    max_request_bytes: int = 16 << 20
    request_timeout: float = 60.0
    max_queue: int = 64
    max_connections: int = 64


class Busy(Exception):
    """The scoring queue is full: the request is answered 503."""


class RMScorer:
    """A reward model and its tokenizer on one device: `ids(text)` tokenizes (any thread), `score_ids(seqs)`
    scores, in micro-batches; `score(texts)` does both."""

    def __init__(self, path: str, device: str = "cpu", dtype: str = "fp32", batch_size: int = 16,
                 max_len: int = 4096):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.rule = score_rule(self.tokenizer)
        self.model = RewardModel.from_pretrained(path, dtype=dtype).to(device).eval()
        self.device, self.batch_size, self.max_len = device, batch_size, max_len
        pad = self.tokenizer.pad_token_id
        self.pad_id = self.rule.score_id if pad is None else int(pad)  # masked out either way

    def ids(self, text: str) -> list[int]:
        ids = score_text(text[:self.max_len * CHARS_PER_TOKEN], self.tokenizer, self.rule)
        return ids if len(ids) <= self.max_len else ids[:self.max_len - 1] + [self.rule.score_id]

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(seqs), self.batch_size):
            ids, attn = pad_scored(seqs[i:i + self.batch_size], self.rule, self.pad_id, self.device)
            out.extend(self.model(input_ids=ids, attention_mask=attn).float().cpu().tolist())
        return out

    def score(self, texts: list[str]) -> list[float]:
        return self.score_ids([self.ids(t) for t in texts])


class Batcher:
    """One thread scores for every request: it takes the token ids of all requests waiting (up to a micro-batch's
    worth at a time) and scores them together, so concurrent runs share micro-batches. At most `max_queue`
    requests wait; `submit` raises Busy beyond that. Texts are tokenized by `submit`, in the caller's thread."""

    def __init__(self, scorer: RMScorer, max_queue: int = Limits.max_queue):
        self.scorer = scorer
        self.waiting: queue.Queue[tuple[list[list[int]], Future]] = queue.Queue(maxsize=max_queue)
        threading.Thread(target=self._run, daemon=True, name="serve-rm-batcher").start()

    def submit(self, texts: list[str]) -> list[float]:
        seqs = [self.scorer.ids(t) for t in texts]
        done: Future = Future()
        try:
            self.waiting.put_nowait((seqs, done))
        except queue.Full:
            raise Busy(f"{self.waiting.maxsize} requests are already waiting to be scored (--max-queue)") from None
        return done.result()

    def _run(self) -> None:
        while True:
            jobs = [self.waiting.get()]
            count = len(jobs[0][0])
            while count < self.scorer.batch_size:
                try:
                    jobs.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
                count += len(jobs[-1][0])
            try:
                scores = self.scorer.score_ids([s for seqs, _ in jobs for s in seqs])
            except Exception as exc:  # noqa: BLE001 - reported to every waiting request as an HTTP 500
                for _, done in jobs:
                    done.set_exception(exc)
                continue
            start = 0
            for seqs, done in jobs:
                done.set_result(scores[start:start + len(seqs)])
                start += len(seqs)


class Refused(Exception):
    """A request answered with an error status before its body was used; the connection is closed after it."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def read_body(handler: BaseHTTPRequestHandler, limits: Limits) -> bytes:
    """The request's body by its Content-Length, within the size cap and the time limit; Refused otherwise."""
    if handler.headers.get("Transfer-Encoding") is not None:
        raise Refused(411, "chunked bodies (Transfer-Encoding) are not accepted: send the body with a Content-Length")
    given = handler.headers.get_all("Content-Length") or []
    if not given:
        raise Refused(411, "a POST needs a Content-Length")
    if len(set(given)) > 1 or not (given[0].strip().isascii() and given[0].strip().isdigit()):
        raise Refused(400, f"Content-Length {', '.join(given)!r} is not a byte count")
    size = int(given[0])
    if size > limits.max_request_bytes:
        raise Refused(413, f"the request is {size} bytes, more than this server's cap of {limits.max_request_bytes} "
                           "(--max-request-mb): send fewer texts per request (reward.http_batch)")
    deadline = time.monotonic() + limits.request_timeout
    chunks, left = [], size
    try:
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            handler.connection.settimeout(remaining)
            chunk = handler.rfile.read1(min(left, READ_CHUNK))
            if not chunk:
                raise Refused(400, f"the body ended {left} bytes before its Content-Length")
            chunks.append(chunk)
            left -= len(chunk)
    except TimeoutError:
        raise Refused(408, f"the body did not arrive within {limits.request_timeout:g}s (--request-timeout)") from None
    handler.connection.settimeout(limits.request_timeout)
    return b"".join(chunks)


def parse_texts(body: bytes) -> list[str]:
    """The request's `query` texts; Refused (400) for anything else, JSON nested too deep included."""
    try:
        request = json.loads(body or b"null")
    except RecursionError:
        raise Refused(400, "the request's JSON is nested too deep") from None
    except ValueError:
        raise Refused(400, "the request body is not JSON") from None
    texts = request.get("query") if isinstance(request, dict) else None
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise Refused(400, 'expected a JSON object with "query": [text, ...]')
    return texts


def make_handler(batcher: Batcher, limits: Limits = Limits()) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = limits.request_timeout  # an idle or stalled connection is closed after this long without a byte

        def _reply(self, status: int, body: dict, close: bool = False) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 405:
                self.send_header("Allow", "POST")
            if status == 503:
                self.send_header("Retry-After", "1")
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            unread = "Content-Length" in self.headers or "Transfer-Encoding" in self.headers  # a body is not read
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"status": "ok"}, close=unread)
            else:
                self._reply(405, {"error": 'POST {"query": [text, ...]} to score; GET /health to check'}, close=unread)

        def do_POST(self) -> None:  # noqa: N802
            try:
                texts = parse_texts(read_body(self, limits))
                scores = batcher.submit(texts) if texts else []
            except Refused as exc:  # the body may be unread: the connection cannot carry another request
                return self._reply(exc.status, {"error": str(exc)}, close=True)
            except Busy as exc:
                return self._reply(503, {"error": str(exc)})
            except Exception as exc:  # noqa: BLE001 - the client sees why (and retries a 5xx)
                return self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
            self._reply(200, {"rewards": scores})

        def log_message(self, format, *args) -> None:  # noqa: A002 - quiet: one line per request is noise
            pass

    return Handler


BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")


class RMServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most `max_connections` connections served at once; one more is answered 503
    from the accept loop (a few bytes into an empty socket buffer: no wait) and closed."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int = Limits.max_connections):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            body = json.dumps({"error": f"{self.max_connections} connections are open already "
                                        "(--max-connections)"}).encode()
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(BUSY % (len(body), body))
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def make_server(scorer: RMScorer, host: str, port: int, limits: Limits = Limits()) -> RMServer:
    return RMServer((host, port), make_handler(Batcher(scorer, limits.max_queue), limits), limits.max_connections)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example: ds-rlhf serve-rm runs/rm/export --port 8000 --device cuda\n"
                                       "         ds-rlhf train-ppo ... --reward.fn http://127.0.0.1:8000/score")
    p.add_argument("model_dir", help="a reward model directory (`ds-rlhf export` of an RM run, or any "
                                     "*ForSequenceClassification model with one label)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine "
                                                       "only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000; 0 = any free port)")
    p.add_argument("--batch-size", type=int, default=16, help="texts per forward pass (default: 16)")
    p.add_argument("--max-len", type=int, default=4096, help="tokens per text at most (default: 4096)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: auto, cuda when available)")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                   help="weights dtype (default: auto, bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-request-mb", type=float, default=16.0, help="a request's body at most, MiB (default: 16; "
                                                                       "larger: 413)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds for a request's body to arrive, "
                                                                        "and an idle connection's life (default: 60)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting to be scored at most (default: 64; "
                                                             "more: 503)")
    p.add_argument("--max-connections", type=int, default=64, help="connections served at once (default: 64; "
                                                                   "more: 503)")
    return p


def limits_of(args: argparse.Namespace) -> Limits:
    """The Limits the flags give; ValueError naming a flag out of range."""
    if args.batch_size < 1 or args.max_len < 2:
        raise ValueError("--batch-size must be >= 1 and --max-len >= 2")
    if not args.max_request_mb > 0 or not args.request_timeout > 0 or args.max_queue < 1 or args.max_connections < 1:
        raise ValueError("--max-request-mb and --request-timeout must be > 0, --max-queue and --max-connections >= 1")
    return Limits(int(args.max_request_mb * (1 << 20)), args.request_timeout, args.max_queue, args.max_connections)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        limits = limits_of(args)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = ("bf16" if device.startswith("cuda") else "fp32") if args.dtype == "auto" else args.dtype
    try:
        scorer = RMScorer(args.model_dir, device, dtype, args.batch_size, args.max_len)
        server = make_server(scorer, args.host, args.port, limits)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"{PROG}: {args.model_dir}: {exc}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"[serve-rm] {args.model_dir} on {device} ({dtype}): POST http://{host}:{port}/score "
          f'{{"query": [...]}} -> {{"rewards": [...]}}; GET /health', flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
