"""The reward model of `model.share_base`, where the user's RM allows it: a LoRA-trained RM of the actor's own base
(a peft adapter directory of task type SEQ_CLS whose `base_model_name_or_path` is the actor's `model.path`) runs as
its LoRA adapters + its `score` head on the actor's frozen base, so the base's weights exist once.

The RM's module tree is a `shared_critic.base_view` of the actor's decoder (the actor's tensors, no LoRA of the
actor's), with a `*ForSequenceClassification` shell built on the meta device around it; peft loads the RM's
adapters and trained `score` head into that tree (`PeftModel.from_pretrained`, frozen), and `RewardModel` scores it
in a frozen DeepSpeed engine as usual. Nothing is merged into the base.

Any other RM (a full `*ForSequenceClassification` model, which is what our RM stage exports, LoRA merged; an adapter of
another base; or any RM at ZeRO-3, which cannot share a module between engines) stays a separate frozen model:
`shared_reward_refusal` says why in words, and `rl_build` prints it.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from torch import nn

from ds_rlhf.engines.builder import build_engine, frozen_config
from ds_rlhf.engines.models import RewardModel
from ds_rlhf.engines.shared_critic import actor_decoder, base_view

logger = logging.getLogger(__name__)


def _same_path(a: str | Path, b: str | Path) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return str(a).rstrip("/") == str(b).rstrip("/")  # hub names


def _adapter_keys(rm_path: Path) -> list[str]:
    from safetensors import safe_open

    file = rm_path / "adapter_model.safetensors"
    if not file.exists():
        return []
    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


def shared_reward_refusal(rm_path: str | Path, actor_path: str | Path, zero_stage: int) -> str | None:
    """None when the RM at `rm_path` can run as an adapter + score head on the actor's base (from `actor_path`),
    else the reason it cannot, in words."""
    rm_path = Path(rm_path)
    config_file = rm_path / "adapter_config.json"
    if not config_file.is_file():
        return f"{rm_path} is a full model, not a LoRA adapter of the actor's base (no adapter_config.json)"
    adapter = json.loads(config_file.read_text())
    base = adapter.get("base_model_name_or_path") or ""
    if adapter.get("peft_type") != "LORA" or adapter.get("task_type") != "SEQ_CLS":
        return (f"{rm_path} is a {adapter.get('peft_type')} adapter of task type {adapter.get('task_type')}, not a "
                "LoRA SEQ_CLS (reward model) adapter")
    if not _same_path(base, actor_path):
        return f"{rm_path} is an adapter of {base!r}, not of the actor's base {str(actor_path)!r}"
    if not any(".score." in f".{k}" for k in _adapter_keys(rm_path)):
        return f"{rm_path}/adapter_model.safetensors holds no trained score head"
    if zero_stage == 3:
        return "ZeRO-3 partitions a module for one engine only, so the base cannot be shared with the RM"
    return None


def shared_reward_model(actor, rm_path: str | Path) -> RewardModel:
    """`RewardModel` over the actor's base with the RM's LoRA adapters and score head from `rm_path` (frozen)."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    decoder = actor_decoder(actor)
    config = copy.deepcopy(decoder.config)
    config.num_labels = 1
    with torch.device("meta"):
        shell = AutoModelForSequenceClassification.from_config(config)
    setattr(shell, shell.base_model_prefix, base_view(decoder))
    shell.score = nn.Linear(config.hidden_size, 1, bias=False)  # replaced by the adapter's trained score below
    seqcls = PeftModel.from_pretrained(shell, str(rm_path), is_trainable=False).get_base_model()
    score = seqcls.score
    trained = getattr(score, "modules_to_save", None)
    if trained is not None:  # peft's ModulesToSaveWrapper: the trained copy is the head
        seqcls.score = trained[next(iter(trained))]
    left = [n for n, p in seqcls.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"{rm_path}: the shared reward model has weights nobody loaded: {left[:4]}")
    return RewardModel(seqcls)


def build_shared_reward(actor, rm_path: str | Path, ds_config: dict):
    """The frozen reward engine of `model.share_base` for an RM that `shared_reward_refusal` accepts."""
    model = shared_reward_model(actor, rm_path)
    logger.info("reward model: %s's LoRA adapters + score head on the actor's base (model.share_base)", rm_path)
    return build_engine(model, frozen_config(ds_config), role="reward", trainable=False)
