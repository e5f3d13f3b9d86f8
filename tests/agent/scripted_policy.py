"""A scripted `generate` callable for the episode tests: exact turn texts, real token ids of the real tokenizer."""

from __future__ import annotations

from ds_rlhf.rollout.base import RolloutSample


class ScriptedPolicy:
    """A `generate` callable that answers from a script: `script[key][k]` is the text of turn k of the episode whose
    prompt contains `key`. Texts are encoded with the real tokenizer and end with the end-of-turn token unless
    they end with `...` (a turn cut before its end). Log-probs are made-up but distinct per token. Records each
    call's (key, turn) pairs and the samples returned."""

    def __init__(self, tokenizer, script: dict[str, list[str]], eot_id: int) -> None:
        self.tokenizer, self.script, self.eot_id = tokenizer, script, eot_id
        self.calls: list[list[tuple[str, int]]] = []
        self.samples: dict[str, list[RolloutSample]] = {k: [] for k in script}
        self.specs = []

    def ids(self, text: str) -> list[int]:
        if text.endswith("..."):
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text, add_special_tokens=False) + [self.eot_id]

    def __call__(self, prompts, spec):
        self.specs.append(spec)
        out, call = [], []
        for i, prompt in enumerate(prompts):
            text = self.tokenizer.decode(prompt)
            key = next(k for k in self.script if k in text)
            turn = text.count("<|im_start|>assistant") - 1
            ids = self.ids(self.script[key][turn])[:spec.max_new_tokens]
            lps = [-(turn + 1) / 10 - k / 1000 for k in range(len(ids))]
            sample = RolloutSample(i, 0, list(prompt), ids, lps, "stop" if ids[-1] == self.eot_id else "length")
            out.append(sample)
            call.append((key, turn))
            self.samples[key].append(sample)
        self.calls.append(call)
        return out
