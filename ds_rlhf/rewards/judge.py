"""The LLM judge (`--reward.judge MODEL --reward.judge_prompt FILE`): a language model reads each prompt and
response through a rubric template and writes a score (judge_template.py: the template, the strict score rule).

MODEL is either the URL of an OpenAI-compatible server (vLLM's `vllm serve`, SGLang, TGI, ...): a URL whose path
ends in `/chat/completions` or `/completions` is used as it is, any other gets `/v1/chat/completions` added (after
`/v1`: `/chat/completions`); the model name sent is the URL's fragment (`http://host:8000/v1#Qwen/Qwen2.5-7B`,
never sent as part of the URL), `default` without one. Or MODEL is a causal LM (an HF directory or Hub id, loaded
in this process with transformers, on the GPU when there is one) that generates greedily, `batch` items per call.

Each item's request is one HTTP POST (greedy: temperature 0, at most `max_tokens` tokens), `batch` of them in
flight at once; each has `timeout` seconds in all and a capped reply (bounded_http.py), and a connection error,
a timeout, a 429 or a 5xx is retried after `retry_delays`. An item whose request still fails, whose reply is not
the OpenAI JSON, or whose text is unparsable by the score rule is returned as a `calling.BadValue`: a bad reward
(`reward.on_bad`) with its reason, counted as `reward/judge/failed` or `reward/judge/unparsable`.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

import httpx

from ds_rlhf.redaction import redact_urls
from ds_rlhf.rewards.bounded_http import DeadlineExceeded, ReplyTooLarge, make_client, pause, request
from ds_rlhf.rewards.calling import BadValue
from ds_rlhf.rewards.judge_template import parse_score, read_template, render
from ds_rlhf.rewards.remote import DEFAULT_MAX_REPLY_MB, RETRY_DELAYS, is_remote

DEFAULT_MODEL_NAME = "default"


class JudgeFailed(Exception):
    """One judge request failed for good (after its retries), or its reply is not the OpenAI JSON."""


def endpoint(url: str) -> tuple[str, str, bool]:
    """(the URL to POST to, the model name, whether it is the chat endpoint) of a judge URL (module docstring)."""
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    if not path.endswith("/completions"):
        path += "/chat/completions" if path.endswith("/v1") else "/v1/chat/completions"
    return (urlunsplit((parts.scheme, parts.netloc, path, parts.query, "")), parts.fragment or DEFAULT_MODEL_NAME,
            path.endswith("/chat/completions"))


class JudgeReward:
    """A batched reward function (`(prompts, responses, ground_truths, metadatas) -> [dict or BadValue]`) that
    asks the judge MODEL (a URL or a local model) with the template of `prompt_file`."""

    reward_style = "batched"
    in_process = True  # never sent to a reward worker: it holds a client or a model
    bad_kinds = ("unparsable", "failed")

    def __init__(self, model: str, prompt_file: str, *, batch: int = 8, max_tokens: int = 256,
                 timeout: float = 30.0, retry_delays: Sequence[float] = RETRY_DELAYS,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_MB << 20):
        self.template = read_template(prompt_file)
        self.model, self.batch, self.max_tokens, self.timeout = model.strip(), max(1, batch), max_tokens, timeout
        self.retry_delays, self.max_reply_bytes = tuple(retry_delays), int(max_reply_bytes)
        self.__name__ = "judge"
        self.local = None if is_remote(self.model) else LocalJudge(self.model, max_tokens)
        if self.local is None:
            self.url, self.model_name, self.chat = endpoint(self.model)
            self.shown = redact_urls(self.url)
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()

    def __call__(self, prompts, responses, ground_truths, metadatas) -> list:
        texts = [render(self.template, p, r, t) for p, r, t in zip(prompts, responses, ground_truths)]
        if self.local is not None:
            replies = [reply for i in range(0, len(texts), self.batch)
                       for reply in self.local.generate(texts[i:i + self.batch])]
        elif len(texts) <= 1:
            replies = [self._ask(t) for t in texts]
        else:
            with concurrent.futures.ThreadPoolExecutor(min(self.batch, len(texts))) as pool:
                replies = list(pool.map(self._ask, texts))
        return [reply if isinstance(reply, BadValue) else _scored(reply) for reply in replies]

    def _client_once(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = make_client(self.timeout)
            return self._client

    def _ask(self, text: str) -> str | BadValue:
        """The judge's reply text for one rendered template, or a BadValue saying why there is none."""
        body = {"model": self.model_name, "max_tokens": self.max_tokens, "temperature": 0}
        body.update({"messages": [{"role": "user", "content": text}]} if self.chat else {"prompt": text})
        data = json.dumps(body).encode()
        for attempt in range(len(self.retry_delays) + 1):
            try:
                return self._reply_text(self._post(data))
            except JudgeFailed as exc:
                return BadValue(f"judge {self.shown}: {exc}", "failed")
            except _Again as exc:
                if attempt == len(self.retry_delays):
                    return BadValue(f"judge {self.shown}: {exc} (after {attempt + 1} attempts; reward.timeout)",
                                    "failed")
                pause(self.retry_delays[attempt])
        raise AssertionError("unreachable")

    def _post(self, data: bytes) -> bytes:
        try:
            reply = request(self._client_once(), "POST", self.url, content=data, timeout=self.timeout,
                            max_bytes=self.max_reply_bytes, headers={"Content-Type": "application/json"})
        except (DeadlineExceeded, httpx.TimeoutException):
            raise _Again(f"no reply within {self.timeout:g}s") from None
        except ReplyTooLarge as exc:
            raise JudgeFailed(f"{exc} (reward.max_reply_mb)") from None
        except (httpx.HTTPError, OSError) as exc:
            raise _Again(f"cannot connect ({redact_urls(str(exc)) or type(exc).__name__})") from None
        if reply.status == 429 or reply.status >= 500:
            raise _Again(f"HTTP {reply.status} {reply.reason}")
        if reply.status != 200:
            raise JudgeFailed(f"HTTP {reply.status} {reply.reason}")
        return reply.body

    def _reply_text(self, raw: bytes) -> str:
        try:
            choice = json.loads(raw)["choices"][0]
            text = choice["message"]["content"] if self.chat else choice["text"]
        except (ValueError, RecursionError, KeyError, IndexError, TypeError):
            raise JudgeFailed(f"the reply is not OpenAI {'chat ' if self.chat else ''}completions JSON: "
                              f"{raw[:120]!r}") from None
        if not isinstance(text, str):
            raise JudgeFailed(f"the reply's text is {type(text).__name__}, not a string")
        return text


class _Again(Exception):
    """A failed attempt worth repeating (connection error, timeout, 429, 5xx)."""


def _scored(reply: str) -> dict | BadValue:
    score = parse_score(reply)
    if score is None:
        tail = reply.strip().splitlines()[-1][:80] if reply.strip() else ""
        return BadValue(f"judge reply unparsable (its last line must be 'Score: <0-10>'): {tail!r}", "unparsable")
    return {"score": score}


class LocalJudge:
    """A causal LM loaded in this process with transformers (on the GPU when there is one), generating greedily
    for a batch of rendered templates (left-padded; through the tokenizer's chat template when it has one)."""

    def __init__(self, path: str, max_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.max_tokens = torch, max_tokens
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tok = AutoTokenizer.from_pretrained(path, padding_side="left")
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).to(self.device).eval()

    def generate(self, texts: list[str]) -> list[str]:
        if self.tok.chat_template:
            texts = [self.tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                  add_generation_prompt=True) for t in texts]
        enc = self.tok(texts, return_tensors="pt", padding=True).to(self.device)
        with self.torch.no_grad():
            out = self.model.generate(**enc, max_new_tokens=self.max_tokens, do_sample=False,
                                      pad_token_id=self.tok.pad_token_id)
        return self.tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
