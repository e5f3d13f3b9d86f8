"""Hugging Face `generate` rollout backend: same interface as the vLLM engines, for machines without vLLM.

It is slow (no paged KV cache, no continuous batching: ../shared/device/README.md measured HF `generate` at 784
tokens/s vs vLLM's 16.3k at batch 64 on the H200), so the factory only picks it automatically, with a warning, when
vLLM cannot be imported. It keeps its own copy of the model so
that its weight transport (`weights`) and the canary exercise the same sync path as vLLM.

Decoding is a small loop over the model's forward with a KV cache rather than `model.generate`, so that the
conventions match vLLM's exactly: per-request seeds (one torch.Generator per row, seeded like vLLM's requests; for
both `SamplingSpec.seeding` values, as HF's sampling has no per-request cost to save),
stop tokens that end a row without being masked, `ignore_eos`, and log-probs of the distribution each token was
sampled from (logits / temperature, then top-k and top-p, renormalised; greedy: the raw logits), as vLLM's
`processed_logprobs`; `score` stays raw. Prompts are expanded to `n` rows each and decoded in left-padded batches of
`batch_size` rows. Samples do not equal vLLM's (different RNG streams), only follow the same rules.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from ds_rlhf.rollout.base import InProcessWeights, RolloutEngine, RolloutSample, SamplingSpec, finish_reason_of

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class HFRolloutEngine(RolloutEngine):
    backend = "hf"
    placement = "colocated"

    def __init__(self, model_path: str, *, dtype: str = "auto", device: str | torch.device | None = None,
                 seed: int = 0, batch_size: int = 64, max_model_len: int = 1024, **_ignored) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        torch_dtype = "auto" if dtype == "auto" else _DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        gen, cfg = self.model.generation_config, self.model.config
        eos = gen.eos_token_id if gen.eos_token_id is not None else cfg.eos_token_id  # id 0 is an id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        pad = gen.pad_token_id if gen.pad_token_id is not None else cfg.pad_token_id
        # only fills the left padding, which the attention mask (from lengths) hides: any id does, EOS included
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.seed, self.batch_size, self.max_model_len = seed, batch_size, max_model_len
        self._params = dict(self.model.named_parameters())
        self.weights = InProcessWeights(self._load, next(iter(self._params.values())).dtype)

    def _left_pad(self, rows: list[list[int]]):
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, r in enumerate(rows):
            ids[k, width - len(r):] = torch.tensor(r)
            mask[k, width - len(r):] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[RolloutSample]:
        t0 = time.perf_counter()
        rows = [(i, j) for i in range(len(prompts)) for j in range(spec.n)]
        stops = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(self.eos_ids))
        samples = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            gens = [self._generator(spec, i, j) for i, j in chunk]
            resp, lps = self._decode([prompts[i] for i, _ in chunk], spec, stops, gens)
            for (i, j), r, lp in zip(chunk, resp, lps):
                samples.append(RolloutSample(i, j, list(prompts[i]), r, lp,
                                             finish_reason_of(r, stops, spec.max_new_tokens)))
        self.record_generate(samples, time.perf_counter() - t0)
        return samples

    def _generator(self, spec: SamplingSpec, i: int, j: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        seed = spec.request_seed(i)
        if seed is None:
            g.seed()
        else:
            g.manual_seed(seed + j)
        return g

    def _decode(self, rows: list[list[int]], spec: SamplingSpec, stops: set[int], gens: list[torch.Generator]):
        """Batched incremental decoding with a KV cache; per-row generators give per-request seeds."""
        ids, mask = self._left_pad(rows)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        stop_t = torch.tensor(sorted(stops), dtype=torch.long, device=self.device)
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        toks, lps, past, cur = [], [], None, ids
        for _ in range(spec.max_new_tokens):
            out = self.model(input_ids=cur, attention_mask=mask, position_ids=pos, past_key_values=past,
                             use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1].float()
            tok, processed = self._sample(logits, spec, gens)
            lps.append(F.log_softmax(processed, -1).gather(-1, tok[:, None]).squeeze(-1))
            toks.append(tok)
            done |= torch.isin(tok, stop_t)
            if bool(done.all()):
                break
            cur = tok[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
        tok_m, lp_m = torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist()
        resp, logp = [], []
        for r, lp in zip(tok_m, lp_m):
            cut = next((t + 1 for t, x in enumerate(r) if x in stops), len(r))
            resp.append(r[:cut])
            logp.append(lp[:cut])
        return resp, logp

    @staticmethod
    def _sample(logits: torch.Tensor, spec: SamplingSpec,
                gens: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled tokens, the logits they were sampled from: scaled and truncated, -inf outside the kept set)."""
        if spec.temperature <= 0:
            return logits.argmax(-1), logits
        x = logits / spec.temperature
        if 0 < spec.top_k < x.shape[-1]:
            kth = x.topk(spec.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if spec.top_p < 1.0:
            sorted_x, order = x.sort(dim=-1, descending=True)
            probs = sorted_x.softmax(-1)
            drop = probs.cumsum(-1) - probs > spec.top_p  # keep the smallest prefix reaching top_p
            x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
        probs = x.softmax(-1)
        return torch.cat([torch.multinomial(probs[k], 1, generator=g) for k, g in enumerate(gens)]), x

    @torch.no_grad()
    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        out = []
        for seq in sequences:
            x = torch.tensor([list(seq)], device=self.device)
            logits = self.model(input_ids=x).logits[0, :-1].float()
            out.append(F.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1).tolist())
        return out

    @torch.no_grad()
    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                raise KeyError(f"HF rollout model has no parameter {name!r} (e.g. {next(iter(self._params))!r})")
            param.copy_(tensor)

    def close(self) -> None:
        self.model = None
        self._params = {}
