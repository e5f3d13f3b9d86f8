"""`ds-rlhf serve-rm MODEL_DIR`: serve a reward model over HTTP, so several RL runs share one copy of it
(`--rl.reward_fn http://HOST:PORT/score` in each run).

The protocol is the remote reward protocol of ds_rlhf/rewards/remote.py (OpenRLHF's): POST any path with JSON
`{"query": [prompt + response text, ...], ...}` and get `{"rewards": [float, ...]}`, one per text, in order (the
other request fields, `prompts`, `responses`, `labels`, are accepted and not needed). `GET /health` answers
`{"status": "ok"}`. Each text is scored as RL's reward stage scores a rollout: tokenized, ended at the score token by
the tokenizer's score rule (engines/rm_scoring.py), and read at that token by `RewardModel`. Items of concurrent
requests are scored together, in micro-batches of at most --batch-size texts, on one device. Texts longer than
--max-len tokens keep their first --max-len - 1 tokens plus the score token (as a truncated response).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from ds_rlhf.config import ConfigError
from ds_rlhf.engines.models import RewardModel
from ds_rlhf.engines.rm_scoring import score_rule, score_text
from ds_rlhf.recipes.batching import pad_scored

PROG = "ds-rlhf serve-rm"


class RMScorer:
    """A reward model and its tokenizer on one device: `score(texts) -> [float]`, in micro-batches."""

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
        ids = score_text(text, self.tokenizer, self.rule)
        return ids if len(ids) <= self.max_len else ids[:self.max_len - 1] + [self.rule.score_id]

    @torch.no_grad()
    def score(self, texts: list[str]) -> list[float]:
        seqs = [self.ids(t) for t in texts]
        out: list[float] = []
        for i in range(0, len(seqs), self.batch_size):
            ids, attn = pad_scored(seqs[i:i + self.batch_size], self.rule, self.pad_id, self.device)
            out.extend(self.model(input_ids=ids, attention_mask=attn).float().cpu().tolist())
        return out


class Batcher:
    """One thread scores for every request: it takes the texts of all requests waiting (up to a micro-batch's
    worth at a time) and scores them together, so concurrent runs share micro-batches."""

    def __init__(self, scorer: RMScorer):
        self.scorer = scorer
        self.waiting: queue.Queue[tuple[list[str], Future]] = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="serve-rm-batcher").start()

    def submit(self, texts: list[str]) -> list[float]:
        done: Future = Future()
        self.waiting.put((texts, done))
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
                scores = self.scorer.score([t for texts, _ in jobs for t in texts])
            except Exception as exc:  # noqa: BLE001 - reported to every waiting request as an HTTP 500
                for _, done in jobs:
                    done.set_exception(exc)
                continue
            start = 0
            for texts, done in jobs:
                done.set_result(scores[start:start + len(texts)])
                start += len(texts)


def make_handler(batcher: Batcher) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 405:
                self.send_header("Allow", "POST")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._reply(405, {"error": 'POST {"query": [text, ...]} to score; GET /health to check'})

        def do_POST(self) -> None:  # noqa: N802
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            except ValueError:
                return self._reply(400, {"error": "the request body is not JSON"})
            texts = body.get("query") if isinstance(body, dict) else None
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                return self._reply(400, {"error": 'expected a JSON object with "query": [text, ...]'})
            try:
                scores = batcher.submit(texts) if texts else []
            except Exception as exc:  # noqa: BLE001 - the client sees why (and retries a 5xx)
                return self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
            self._reply(200, {"rewards": scores})

        def log_message(self, format, *args) -> None:  # noqa: A002 - quiet: one line per request is noise
            pass

    return Handler


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example: ds-rlhf serve-rm runs/rm/export --port 8000 --device cuda\n"
                                       "         ds-rlhf train-ppo ... --rl.reward_fn http://127.0.0.1:8000/score")
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.batch_size < 1 or args.max_len < 2:
        print(f"{PROG}: --batch-size must be >= 1 and --max-len >= 2", file=sys.stderr)
        return 2
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = ("bf16" if device.startswith("cuda") else "fp32") if args.dtype == "auto" else args.dtype
    try:
        scorer = RMScorer(args.model_dir, device, dtype, args.batch_size, args.max_len)
        server = ThreadingHTTPServer((args.host, args.port), make_handler(Batcher(scorer)))
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
