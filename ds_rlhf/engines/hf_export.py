"""Hugging Face export of a DeepSpeed engine, from any ZeRO stage.

``export_hf`` gathers every parameter (one at a time under ``deepspeed.zero.GatheredParameters``, so ZeRO-3 never
materialises the whole model at once on the device), folds LoRA adapters in, and writes a ``save_pretrained``
directory on rank 0 in the engine's compute dtype (bf16/fp16 — the "16-bit gather" — or fp32). A critic is written
as ``*ForSequenceClassification`` so ``CriticModel.from_pretrained``/``RewardModel.from_pretrained`` load it. A
reward model's export reads its score at the same token in plain transformers (``write_reward_scoring``: a pad token
other than the score token, and ``ds_rlhf_reward.json`` naming the score token; see ``rm_scoring.py``).
``export_reward_adapter`` writes a LoRA reward model unmerged, as a peft LoRA SEQ_CLS adapter directory of its base
(adapters + ``score``; peft's own ``save_pretrained`` on a meta-device view), the RM form ``model.share_base`` uses.
The export is written into a temp directory beside ``out_dir`` and swapped in whole (``atomic_files.publish_dir``),
so a crash or a full disk mid-export leaves the previous export whole.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ds_rlhf.atomic_files import publish_dir
from ds_rlhf.engines.ds_config import save_resolved_config
from ds_rlhf.engines.models import CriticModel, RewardModel, merge_lora_state_dict, unwrap
from ds_rlhf.engines.rm_scoring import REWARD_INFO, export_pad_token, reward_info, score_rule
from ds_rlhf.engines.roles import role_info

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_state_dict(module: torch.nn.Module, keep: Callable[[str], bool] | None = None) -> dict:
    """Full ``state_dict`` of ``module`` on rank 0 (CPU tensors); ``{}`` on other ranks. Works at every ZeRO stage:
    ZeRO-3 parameters are gathered one at a time; tied parameters are gathered once. ``keep(name)``: only those
    entries (the same names on every rank), e.g. a LoRA model's adapters without its frozen base."""
    import deepspeed

    gathered = deepspeed.zero.GatheredParameters

    rank0 = _rank() == 0
    out, seen = {}, {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if keep is not None and not keep(name):
            continue
        if id(tensor) in seen:
            if rank0:
                out[name] = seen[id(tensor)]
            continue
        if hasattr(tensor, "ds_id"):
            with gathered([tensor], modifier_rank=None):
                value = tensor.detach().cpu().clone() if rank0 else None
        else:
            value = tensor.detach().cpu().clone() if rank0 else None
        seen[id(tensor)] = value
        if rank0:
            out[name] = value
    return out


def export_hf(engine, tokenizer, out_dir: str | os.PathLike) -> Path:
    """Write a Hugging Face ``save_pretrained`` directory from ``engine`` (collective: call on every rank)."""
    module = getattr(engine, "module", engine)
    state = gather_state_dict(module)
    out = Path(out_dir)
    if _rank() == 0:
        info = role_info(engine)
        publish_dir(out, lambda tmp: write_export(module, state, tokenizer, tmp,
                                                  ds_config=info.ds_config if info is not None else None))
        logger.info("exported %s to %s", type(module).__name__, out)
    _barrier()
    return out


def _reward_backbone(module):
    """The peft model on a LoRA reward model's backbone (`models.apply_seqcls_lora`), else None."""
    if not isinstance(module, RewardModel):
        return None
    backbone = getattr(module.model, module.model.base_model_prefix, None)
    return backbone if hasattr(backbone, "peft_config") else None


def _is_reward_adapter_entry(name: str) -> bool:
    return "lora_" in name or name.startswith("model.score.")


def export_reward_adapter(engine, tokenizer, out_dir: str | os.PathLike, base_model: str | os.PathLike) -> Path:
    """A LoRA reward model (`model.lora_rank`) as a peft LoRA SEQ_CLS adapter directory of `base_model` (its
    adapters + its `score` head in `modules_to_save`), the form `model.share_base` runs on the actor's own base
    (`engines/shared_reward.py`). Only the adapters and the head are gathered. Collective: call on every rank."""
    module = getattr(engine, "module", engine)
    if _reward_backbone(module) is None:
        raise ValueError(f"{type(module).__name__} has no LoRA adapters on its backbone: nothing to write as an "
                         "adapter (the merged export is the whole model)")
    state = gather_state_dict(module, keep=_is_reward_adapter_entry)
    out = Path(out_dir)
    if _rank() == 0:
        info = role_info(engine)
        publish_dir(out, lambda tmp: write_reward_adapter(module, state, tokenizer, tmp, base_model,
                                                          ds_config=info.ds_config if info is not None else None))
        logger.info("exported the reward model's LoRA adapters + score head to %s", out)
    _barrier()
    return out


def _adapter_targets(backbone) -> set[str]:
    """The module names that carry the trained LoRA layers, as peft `target_modules` that select exactly those
    modules both on the backbone and on the `*ForSequenceClassification` model around it (peft matches a name
    as a suffix at a `.`): the leaf names (`q_proj`, ...) where every module of that name is adapted, else the
    full paths inside the backbone."""
    from peft.tuners.lora import LoraLayer

    base = backbone.get_base_model()
    adapted = {n for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    leaves = {n.rsplit(".", 1)[-1] for n in adapted}
    same_leaf = {n for n, _ in base.named_modules() if n and n.rsplit(".", 1)[-1] in leaves}
    return leaves if same_leaf == adapted else adapted


def write_reward_adapter(module: RewardModel, state: dict, tokenizer, out: Path, base_model: str | os.PathLike, *,
                         ds_config: dict | None = None) -> None:
    """Write the LoRA reward model ``module`` (weights ``state``, names as in ``module.state_dict()``; the adapters
    and the score head are enough) as peft writes a LoRA SEQ_CLS model of ``base_model``: a
    ``PeftModelForSequenceClassification`` built on the meta device from the RM's config and its LoRA settings is
    given the trained tensors under its own names, and peft's ``save_pretrained`` writes ``adapter_config.json``
    and ``adapter_model.safetensors`` (``score`` as the module to save). The tokenizer and ds_config go beside."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    backbone = _reward_backbone(module)
    if backbone is None:
        raise ValueError(f"{type(module).__name__} has no LoRA adapters on its backbone")
    if len(backbone.peft_config) != 1:
        raise ValueError(f"the reward model's backbone has {len(backbone.peft_config)} adapters; one is written")
    name, trained = next(iter(backbone.peft_config.items()))
    prefix = module.model.base_model_prefix
    settings = {**trained.to_dict(), "task_type": "SEQ_CLS", "base_model_name_or_path": str(base_model),
                "target_modules": sorted(_adapter_targets(backbone)), "layers_to_transform": None,
                "layers_pattern": None, "modules_to_save": None, "inference_mode": False}
    settings = {k: v for k, v in settings.items() if k not in ("peft_type", "auto_mapping", "peft_version")}
    config = LoraConfig(**settings)
    with torch.device("meta"):
        shell = AutoModelForSequenceClassification.from_config(copy.deepcopy(module.model.config))
    view = get_peft_model(shell, config, adapter_name=name, low_cpu_mem_usage=True)
    # our names -> the view's: model.<prefix>.base_model.model.X.lora_* -> base_model.model.<prefix>.X.lora_*,
    # model.score.W -> base_model.model.score.modules_to_save.<adapter>.W
    lora_from = f"model.{prefix}.base_model.model."
    weights = {}
    for key, tensor in state.items():
        if "lora_" in key and key.startswith(lora_from):
            weights[f"base_model.model.{prefix}.{key.removeprefix(lora_from)}"] = tensor
        elif key.startswith("model.score."):
            weights[f"base_model.model.score.modules_to_save.{name}.{key.removeprefix('model.score.')}"] = tensor
    wanted = {k for k in view.state_dict() if "lora_" in k or ".modules_to_save." in k}
    if set(weights) != wanted:
        raise ValueError(f"the reward model's adapters do not map onto peft's SEQ_CLS model: missing "
                         f"{sorted(wanted - set(weights))[:4]}, unexpected {sorted(set(weights) - wanted)[:4]}")
    view.save_pretrained(out, state_dict=weights, save_embedding_layers=False)
    if tokenizer is not None:
        (out / REWARD_INFO).write_text(json.dumps(reward_info(tokenizer, score_rule(tokenizer)), indent=1) + "\n")
        tokenizer.save_pretrained(out)
    if ds_config is not None:
        save_resolved_config(ds_config, out)


def write_export(module, state: dict, tokenizer, out: Path, *, ds_config: dict | None = None,
                 lora: str = "merge") -> None:
    """Write ``module`` (an actor / critic / reward module, not an engine) with weights ``state`` (names as in
    ``module.state_dict()``) as a ``save_pretrained`` directory at ``out``, plus the tokenizer (and its chat
    template) and the resolved ds_config. ``lora="adapter"``: a LoRA causal LM is written as a peft adapter
    directory (``adapter_config.json`` + ``adapter_model.safetensors`` naming its base model) instead of merged."""
    if lora not in ("merge", "adapter"):
        raise ValueError(f"lora must be 'merge' or 'adapter', got {lora!r}")
    with _kv_cache_on(module):
        _write_weights(module, state, out, lora)
        if isinstance(module, RewardModel) and tokenizer is not None:
            tokenizer = write_reward_scoring(module.model.config, tokenizer, out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if ds_config is not None:
        save_resolved_config(ds_config, out)


def write_reward_scoring(config, tokenizer, out: Path):
    """Make the reward model exported at ``out`` read its score in plain transformers where ds_rlhf reads it
    (``rm_scoring``): ``*ForSequenceClassification`` scores the rightmost token that is not
    ``config.pad_token_id``, so the written config pads with ``rm_scoring.export_pad_token`` (the tokenizer's pad
    unless that is the score token, as SmolLM2-Instruct's pad == ``<|im_end|>``), and the returned tokenizer (the
    one to write beside it) pads with the same token. ``ds_rlhf_reward.json`` names the score token."""
    rule = score_rule(tokenizer)
    pad = export_pad_token(tokenizer, rule)
    if pad is None:
        logger.warning("every special token of the tokenizer is the score token %d: plain transformers takes it for "
                       "padding and scores the token before it; pass scores at the attention mask's last position",
                       rule.score_id)
    else:
        if tokenizer.pad_token_id != pad[1]:
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.pad_token = pad[0]
        if config.pad_token_id != pad[1]:
            config = copy.deepcopy(config)
            config.pad_token_id = pad[1]
            config.save_pretrained(out)
    (out / REWARD_INFO).write_text(json.dumps(reward_info(tokenizer, rule), indent=1) + "\n")
    return tokenizer


@contextlib.contextmanager
def _kv_cache_on(module):
    """`config.use_cache = True` in what an export writes (the trainer turns the KV cache off for its forwards;
    generation wants it), the module's own setting put back after."""
    parts = [part for part in (module, unwrap(module, peft=True), getattr(module, "model", None))
             if part is not None and hasattr(getattr(part, "config", None), "use_cache")]
    before = [part.config.use_cache for part in parts]
    for part in parts:
        part.config.use_cache = True
    try:
        yield
    finally:
        for part, value in zip(parts, before):
            part.config.use_cache = value


def _write_weights(module, state: dict, out: Path, lora: str) -> None:
    if lora == "adapter":
        if not hasattr(module, "peft_config") or isinstance(module, CriticModel | RewardModel):
            raise ValueError(f"lora='adapter' needs a LoRA causal LM; {type(module).__name__} has no adapters to "
                             "write (use lora='merge')")
        module.load_state_dict(state)
        module.save_pretrained(out)
    elif isinstance(module, CriticModel):
        module.save_pretrained(out, state_dict=state)
    elif isinstance(module, RewardModel):  # a LoRA reward model (model.lora_rank) is written merged
        weights = {k.removeprefix("model."): v for k, v in merge_lora_state_dict(state, module).items()}
        module.model.save_pretrained(out, state_dict=weights)
    else:
        base = unwrap(module, peft=True)
        base.save_pretrained(out, state_dict=merge_lora_state_dict(state, module))
