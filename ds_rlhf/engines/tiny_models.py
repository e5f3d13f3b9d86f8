"""Build a tiny tokenizer + Qwen2-style model offline, deterministically, for tests and the CPU demo.

Nothing is downloaded: a byte-level BPE tokenizer is trained on a synthetic corpus (arithmetic chats and filler
text) and a random-initialised Qwen2 model is saved next to it. head_dim is 64 because vLLM's CPU attention
rejects smaller heads. The same spec gives byte-identical files, so the cache directory is keyed by the spec's hash
and tests in several processes can share one build (written to a temp dir, then renamed into place).

CLI: ``python -m ds_rlhf.engines.tiny_models --out DIR [--preset small] [--reward]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ds_rlhf.tasks.addition import make_problems

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# ChatML, as Qwen2 uses; `generation` markers let data_prep build assistant-only loss masks.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FILLER_WORDS = (
    "the", "a", "model", "reward", "policy", "value", "token", "answer", "question", "is", "of", "to", "and",
    "in", "what", "sum", "plus", "equals", "human", "assistant", "helpful", "harmless", "please", "thanks",
    "sure", "here", "compute", "number", "result", "step",
)


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines the built files; its hash names the cache directory."""

    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2  # head_dim = hidden_size / num_heads = 64 (vLLM CPU needs >= 64)
    num_kv_heads: int = 1
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True  # like Qwen2-0.5B; exercises tied-weight handling in the sync bridge
    corpus_lines: int = 4000

    @property
    def digest(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


PRESETS = {
    "tiny": TinySpec(),
    # The demo's model: large enough to learn two-digit addition on a CPU in minutes.
    "small": TinySpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("DS_RLHF_CACHE", Path.home() / ".cache" / "ds_rlhf"))


def synthetic_corpus(spec: TinySpec) -> list[str]:
    rng = random.Random(spec.seed)
    lines = []
    for p in make_problems(spec.corpus_lines // 2, seed=spec.seed):
        lines.append(f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n{p.solution}<|im_end|>\n")
    for _ in range(spec.corpus_lines - len(lines)):
        lines.append(" ".join(rng.choice(FILLER_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + ".")
    return lines


def _train_tokenizer(spec: TinySpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits split one by one (as Qwen2 does) so arithmetic is learnable; ByteLevel makes any text encodable.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(synthetic_corpus(spec), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   bos_token=None, unk_token=None, additional_special_tokens=["<|im_start|>",
                                                                                              "<|endoftext|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_position_embeddings
    return fast


def _model_config(spec: TinySpec, tokenizer, **extra):
    from transformers import Qwen2Config

    vocab = -(-len(tokenizer) // 64) * 64  # pad to a multiple of 64, as real checkpoints do
    return Qwen2Config(
        vocab_size=vocab, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id, torch_dtype="float32", **extra)


def _write_atomically(target: Path, build) -> Path:
    """Build into a temp dir beside `target`, then rename: concurrent builders never see half-written files."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its files are identical
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_model(model, tokenizer, out: Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # generation_config carries no timestamps, but drop transformers' cache hints that vary by version.
    (out / "ds_rlhf_tiny.json").write_text(json.dumps({"kind": model.__class__.__name__}, sort_keys=True) + "\n")


def build_tiny_model(cache_dir: str | os.PathLike | None = None, spec: TinySpec | str = "tiny") -> Path:
    """Return a directory holding a tokenizer and a random-init Qwen2ForCausalLM; build it if absent."""
    import torch
    from transformers import Qwen2ForCausalLM

    spec = PRESETS[spec] if isinstance(spec, str) else spec
    target = Path(cache_dir or default_cache_dir()) / f"tiny-lm-{spec.digest}"

    def build(out: Path) -> None:
        tokenizer = _train_tokenizer(spec)
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(_model_config(spec, tokenizer))
        _save_model(model, tokenizer, out)

    return _write_atomically(target, build)


def build_tiny_reward_model(cache_dir: str | os.PathLike | None = None, spec: TinySpec | str = "tiny") -> Path:
    """A sequence-classification (one score) model on the same backbone and tokenizer: reward model / critic."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    spec = PRESETS[spec] if isinstance(spec, str) else spec
    target = Path(cache_dir or default_cache_dir()) / f"tiny-rm-{spec.digest}"

    def build(out: Path) -> None:
        tokenizer = _train_tokenizer(spec)
        torch.manual_seed(spec.seed + 1)
        config = _model_config(spec, tokenizer, num_labels=1)
        config.tie_word_embeddings = False  # a score head has nothing to tie to
        _save_model(Qwen2ForSequenceClassification(config), tokenizer, out)

    return _write_atomically(target, build)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="cache directory (default: $DS_RLHF_CACHE or ~/.cache/ds_rlhf)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size preset")
    parser.add_argument("--reward", action="store_true", help="also build the reward/critic model")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out, args.preset))
    if args.reward:
        print(build_tiny_reward_model(args.out, args.preset))


if __name__ == "__main__":
    main()
