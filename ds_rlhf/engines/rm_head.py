"""A model's head must fit its role: a reward model holds a trained `score` head, a policy a causal LM head.

`AutoModelForSequenceClassification.from_pretrained` on a causal LM (an SFT export given as `reward.model`)
succeeds with a randomly initialised `score` head, and the run would train on noise. `check_reward_model_dir`
refuses such a directory from its safetensors index or headers, without loading a weight (cheap enough for
preflight); `RewardModel.from_pretrained` also refuses a load whose `missing_keys` name the head.

The other way round, `AutoModelForCausalLM.from_pretrained` on a reward model or critic export loads its backbone
with a random LM head (transformers only notes `score.weight` as unexpected). `check_causal_lm_dir` refuses such a
directory as a policy, teacher or reference from its files alone (`sequence_classifier`: config.json's
architectures, the reward model export's `ds_rlhf_reward.json`, a peft adapter's `task_type`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ds_rlhf.engines.rm_scoring import REWARD_INFO
from ds_rlhf.errors import ConfigError

SCORE_HEAD = "score"  # the `*ForSequenceClassification` head RewardModel reads (`models._seqcls_parts`)


def _safetensors_keys(model_dir: Path) -> list[str] | None:
    """The tensor names of a directory's safetensors weights, from the index or the file headers (nothing is
    loaded); None when the directory has no safetensors weights."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(json.loads(index.read_text()).get("weight_map", {}))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{index} cannot be read ({type(exc).__name__}: {exc}): copy or export the reward "
                              "model again") from None
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import SafetensorError, safe_open

    keys: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                keys.extend(f.keys())
        except (OSError, SafetensorError) as exc:
            raise ConfigError(f"{path} cannot be read ({type(exc).__name__}: {exc}): copy or export the reward "
                              "model again") from None
    return keys


def check_reward_model_dir(path: str | Path) -> None:
    """Refuse (ConfigError) a reward model directory whose weights hold no trained `score` head, e.g. a causal LM
    (an SFT export) given as `reward.model`: loaded as a sequence classifier it would get a randomly initialised
    head and score noise. Reads only the safetensors index or headers; a peft adapter directory (`model.share_base`)
    is checked by `engines.shared_reward`, a directory without safetensors weights when it is loaded
    (`RewardModel.from_pretrained`)."""
    model_dir = Path(path)
    if (model_dir / "adapter_config.json").is_file():
        return
    keys = _safetensors_keys(model_dir)
    if keys is None:
        return
    missing = missing_head_keys(keys)
    if missing:
        raise ConfigError(head_refusal(model_dir, missing))


def missing_head_keys(keys) -> list[str]:
    """`score.weight` when no tensor of `keys` is the score head's weight (names may carry a prefix)."""
    want = f"{SCORE_HEAD}.weight"
    return [] if any(k == want or k.endswith(f".{want}") for k in keys) else [want]


def head_refusal(model_dir, missing) -> str:
    return (f"reward model {model_dir} has no trained score head (its weights lack {', '.join(missing)}): it is not "
            "a sequence-classification reward model (e.g. a causal LM / SFT export) and would score with a random "
            "head; pass the export of an RM run (ds-rlhf train rm ... run_dir/export)")


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    return data if isinstance(data, dict) else {}


def sequence_classifier(path: str | Path) -> str | None:
    """What marks the model directory `path` as a sequence classifier (a reward model or critic export), or None:
    config.json's `architectures` naming a `*ForSequenceClassification` class, the `ds_rlhf_reward.json` a reward
    model export carries, or a peft adapter of task `SEQ_CLS`. Reads those small files only."""
    model_dir = Path(path)
    config = model_dir / "config.json"
    if config.is_file():
        found = [a for a in _json(config).get("architectures") or [] if str(a).endswith("ForSequenceClassification")]
        if found:
            return f"config.json's architectures name {found[0]}"
    if (model_dir / REWARD_INFO).is_file():
        return f"it holds {REWARD_INFO}, the mark of a reward model export"
    adapter = model_dir / "adapter_config.json"
    if adapter.is_file() and _json(adapter).get("task_type") == "SEQ_CLS":
        return "its adapter_config.json has task_type SEQ_CLS"
    return None


def check_causal_lm_dir(path: str | Path, key: str, role: str) -> None:
    """Refuse (ConfigError, one line naming `key`, the path and `role`) a sequence-classification model directory
    (`sequence_classifier`) where a causal LM is needed: loaded as one it would get a randomly initialised LM head."""
    why = sequence_classifier(path)
    if why is not None:
        raise ConfigError(f"{key}={str(path)!r} is a reward model (a sequence-classification head: {why}), not a "
                          f"causal LM, so it cannot be the {role}: it would generate with a random LM head; pass a "
                          "causal LM (a base model or an SFT / RL export), and a reward model as --reward.model")
