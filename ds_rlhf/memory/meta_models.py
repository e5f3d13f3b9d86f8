"""The roles of a run as modules on PyTorch's `meta` device: exact shapes and parameter counts from each model's
`config.json`, no storage, no weights read (for `plan.py`)."""

from __future__ import annotations

import copy

from ds_rlhf.algos.registry import ADVANTAGE_ESTIMATORS
from ds_rlhf.engines.model_source import resolve_model_path
from ds_rlhf.engines.models import CriticModel, apply_lora, apply_seqcls_lora


def hf_config(path: str):
    """The model's config; for a peft adapter directory (adapter_config.json, no config.json) its base model's,
    which is the shape transformers loads the adapter onto (the adapters themselves are not counted)."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    resolved = Path(resolve_model_path(path))
    adapter = resolved / "adapter_config.json"
    if adapter.is_file() and not (resolved / "config.json").exists():
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        if base:
            return AutoConfig.from_pretrained(resolve_model_path(base))
    return AutoConfig.from_pretrained(str(resolved))


def lora_settings(cfg) -> dict | None:
    m = cfg.model
    return {"r": m.lora_rank, "lora_alpha": m.lora_alpha, "target_modules": m.lora_targets} if m.lora_rank else None


def meta_model(role: str, config, lora: dict | None = None):
    """The role's module (as `engines.models` builds it) with meta tensors: shapes, no storage."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    with torch.device("meta"):
        if role in ("actor", "reference"):
            model = AutoModelForCausalLM.from_config(config)
            return apply_lora(model, lora, "CAUSAL_LM") if lora and role == "actor" else model
        scored = copy.deepcopy(config)
        scored.num_labels = 1  # one score, as engines.models loads it
        seqcls = AutoModelForSequenceClassification.from_config(scored)
        if role == "reward":  # with `lora` (a LoRA-trained RM): adapters on the backbone, score trained
            if lora:
                apply_seqcls_lora(seqcls, lora)
            return seqcls
        backbone = getattr(seqcls, seqcls.base_model_prefix)
        return CriticModel(apply_lora(backbone, lora, None) if lora else backbone)


def role_sources(cfg, kind: str) -> dict[str, str]:
    """role -> model path, for the roles this run builds (the same rules as `recipes/rl_build.py`)."""
    rl = cfg.rl
    if kind == "sft":
        return {"actor": cfg.model.path}
    if kind == "rm":
        return {"reward": cfg.model.path}
    out = {"actor": cfg.model.path}
    if ADVANTAGE_ESTIMATORS.get(rl.algo).meta.get("critic"):
        out["critic"] = cfg.critic.path or cfg.reward.model or cfg.model.path
    if rl.uses_reference():  # the teacher (on-policy distillation) is the reference when set
        out["reference"] = rl.teacher or cfg.model.path
    if cfg.reward.model:
        out["reward"] = cfg.reward.model
    return out
