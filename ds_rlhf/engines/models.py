"""The model roles as plain ``nn.Module``s; ``builder.py`` turns them into DeepSpeed engines.

- actor / reference: a Hugging Face causal LM (``load_causal_lm``), optionally with LoRA adapters.
- critic: LM backbone + scalar value head (``CriticModel``), initialised from the reward model (backbone and its
  ``score`` head) or from the actor (backbone; fresh head). It saves in ``*ForSequenceClassification`` format, so
  an exported critic loads as a reward model and vice versa.
- reward: ``RewardModel`` wraps ``*ForSequenceClassification`` (its trained ``score`` head required; an RM run's
  fresh head starts at zero) and scores each row's last attended token; callers end each sequence at the score
  token first (``rm_scoring.score_ids``, through ``recipes.batching.pad_scored``).

``quantize="nf4" | "int8"`` (``model.quantize_base``, LoRA only) loads the actor's / critic's frozen base linear
layers through bitsandbytes (``quantized.py``); the adapters, heads, embeddings and norms stay in floating point.

Padding: when an ``attention_mask`` is given without ``position_ids``, positions are counted from the first real
token (``cumsum(mask) - 1``), so left- and right-padded copies of a sequence get the same values and scores.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch import nn

from ds_rlhf.engines import quantized
from ds_rlhf.engines.attention import select_attn_impl
from ds_rlhf.engines.kernels import apply_kernels
from ds_rlhf.engines.rm_head import SCORE_HEAD, check_reward_model_dir, head_refusal
from ds_rlhf.errors import ConfigError, UserInputError

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}
GC_KWARGS = {"use_reentrant": False}  # non-reentrant: works with frozen inputs, LoRA and ZeRO-3 hooks
LORA_DEFAULTS = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token (left padding) and stay 0 on padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-pad token of each row; works for left and right padding."""
    length = attention_mask.shape[-1]
    return length - 1 - attention_mask.long().flip(-1).argmax(-1)


def _hf_kwargs(dtype, attn_impl, compute_dtype, quantize: str | None = None, lora: dict | None = None) -> dict:
    """`from_pretrained` keywords: weight dtype, attention kernel and, with `quantize`, the bitsandbytes config."""
    dtype = as_dtype(dtype)
    compute = as_dtype(compute_dtype) if compute_dtype is not None else dtype
    if quantized.enabled(quantize) and not lora:
        raise ValueError(f"model.quantize_base={quantize} quantizes a frozen base under LoRA adapters: set "
                         "--model.lora_rank > 0 (a quantized model cannot be fine-tuned in full)")
    impl = select_attn_impl(attn_impl, dtype=compute)
    return {"dtype": dtype, "attn_implementation": impl, **quantized.load_kwargs(quantize, compute)}


def _prepare(model, *, gradient_checkpointing: bool, quantize: str | None) -> None:
    """peft's k-bit preparation for a quantized base, then gradient checkpointing (non-reentrant for all)."""
    if quantized.enabled(quantize):
        quantized.prepare_for_lora(model)
    if gradient_checkpointing:
        _enable_gc(model)


def lora_settings(model_cfg) -> dict | None:
    """peft LoraConfig keywords from the config's `model` section (None for full fine-tuning)."""
    if model_cfg.lora_rank <= 0:
        return None
    return {"r": model_cfg.lora_rank, "lora_alpha": model_cfg.lora_alpha, "target_modules": model_cfg.lora_targets}


def apply_lora(model: nn.Module, lora: dict, task_type: str | None):
    """Wrap ``model`` with peft LoRA adapters; only the adapters stay trainable."""
    from peft import LoraConfig, get_peft_model

    settings = {**LORA_DEFAULTS, **lora}
    settings.setdefault("task_type", task_type)
    try:
        return get_peft_model(model, LoraConfig(**settings))
    except ValueError as exc:  # peft's NoMatchingPeftModuleError: no module of the model has a target's name
        if "target modules" not in str(exc).lower():
            raise
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, nn.Linear)})
        raise ConfigError(f"model.lora_targets={settings['target_modules']!r}: the model has no such module; name "
                          f"some of its linear layers ({', '.join(linear)}) or pass all-linear") from None


def apply_seqcls_lora(seqcls: nn.Module, lora: dict) -> None:
    """A LoRA reward model (`model.lora_rank` in an RM run): peft adapters on a `*ForSequenceClassification`'s
    backbone (the transformer), its `score` head trained in full (one hidden-size row). The frozen backbone then
    needs no gradients or Adam states, as for the LoRA actor; the RM export merges the adapters and writes them
    unmerged beside it as well (`recipes/rm.py`)."""
    prefix = seqcls.base_model_prefix
    setattr(seqcls, prefix, apply_lora(getattr(seqcls, prefix), lora, None))
    for p in seqcls.score.parameters():
        p.requires_grad_(True)


def _enable_gc(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=GC_KWARGS)
    model.config.use_cache = False


def pretrained(auto_cls, path: str | os.PathLike, **kwargs):
    """`auto_cls.from_pretrained(path, **kwargs)`; a model directory whose files cannot be read (a missing or
    truncated weight file, a corrupt config.json) is a UserInputError naming the directory and the cause."""
    from safetensors import SafetensorError

    try:
        return auto_cls.from_pretrained(path, **kwargs)
    except (OSError, SafetensorError, json.JSONDecodeError) as exc:
        cause = " ".join(str(exc).split())
        raise UserInputError(f"cannot load the model at {path} ({type(exc).__name__}: {cause[:400]}): check that it "
                             "is a complete Hugging Face model directory (config.json and whole weight files), e.g. "
                             "copy or export it again") from exc


def load_causal_lm(path: str | os.PathLike, *, dtype: str | torch.dtype, attn_impl: str = "auto",
                   gradient_checkpointing: bool = False, lora: dict | None = None,
                   compute_dtype: str | torch.dtype | None = None, quantize: str | None = None,
                   kernels: str = "none"):
    """A Hugging Face causal LM from ``path``; ``compute_dtype`` (default ``dtype``) picks the attention kernel and
    the quantized matmul's dtype; ``quantize`` ("nf4" | "int8", needs ``lora``) stores the frozen base quantized;
    ``kernels`` is `model.kernels` (engines/kernels.py)."""
    from transformers import AutoModelForCausalLM

    model = pretrained(AutoModelForCausalLM, path, **_hf_kwargs(dtype, attn_impl, compute_dtype, quantize, lora))
    apply_kernels(model, kernels)
    # Training/scoring forwards need no KV cache, and with one transformers ignores packed position_ids (it only
    # builds the block-diagonal mask when past_key_values is None). generate() uses generation_config.use_cache.
    model.config.use_cache = False
    _prepare(model, gradient_checkpointing=gradient_checkpointing, quantize=quantize)
    if lora:
        model = apply_lora(model, lora, "CAUSAL_LM")
    return model


def _seqcls_parts(seqcls):
    backbone = getattr(seqcls, seqcls.base_model_prefix)
    head = getattr(seqcls, "score", None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise ValueError(f"{type(seqcls).__name__} has no single-output 'score' head (num_labels must be 1)")
    return backbone, head


class CriticModel(nn.Module):
    """LM backbone + linear value head; ``forward`` returns a value per token ``[B, T]`` in fp32."""

    def __init__(self, backbone: nn.Module, value_head: nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        if value_head is None:
            hidden = self.config.hidden_size
            value_head = nn.Linear(hidden, 1, bias=False)
            nn.init.normal_(value_head.weight, std=1.0 / (hidden + 1))  # small: values start near 0
            value_head.to(next(backbone.parameters()).dtype)
        self.value_head = value_head

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, init_from: str = "reward", *, dtype="fp32",
                        attn_impl: str = "auto", gradient_checkpointing: bool = False, lora: dict | None = None,
                        compute_dtype=None, quantize: str | None = None, kernels: str = "none") -> CriticModel:
        """``init_from="reward"``: a ``*ForSequenceClassification`` checkpoint; its ``score`` head becomes the value
        head. ``init_from="actor"``: a causal-LM checkpoint; the backbone is loaded and the head is fresh.
        ``quantize`` (with ``lora``) stores the backbone's linear layers quantized; the heads stay as loaded."""
        from transformers import AutoModel, AutoModelForSequenceClassification

        kwargs = _hf_kwargs(dtype, attn_impl, compute_dtype, quantize, lora)
        if init_from == "reward":
            seqcls = pretrained(AutoModelForSequenceClassification, path, num_labels=1, **kwargs)
            backbone, score = _seqcls_parts(seqcls)
            head = nn.Linear(score.in_features, 1, bias=score.bias is not None).to(score.weight.dtype)
            head.load_state_dict(score.state_dict())
        elif init_from == "actor":
            backbone, head = pretrained(AutoModel, path, **kwargs), None
        else:
            raise ValueError(f"init_from must be 'reward' or 'actor', got {init_from!r}")
        apply_kernels(backbone, kernels)
        _prepare(backbone, gradient_checkpointing=gradient_checkpointing, quantize=quantize)
        if lora:
            backbone = apply_lora(backbone, lora, None)
        return cls(backbone, head)

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs) -> torch.Tensor:
        if position_ids is None and attention_mask is not None:
            position_ids = positions_from_mask(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False, **kwargs).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()

    def gradient_checkpointing_enable(self, **_):
        _enable_gc(self.backbone)

    def save_pretrained(self, out_dir: str | os.PathLike, state_dict: dict | None = None) -> Path:
        """Write a ``*ForSequenceClassification`` directory (value head -> ``score``), LoRA merged in.

        ``state_dict`` (names as in ``self.state_dict()``) lets callers pass weights gathered from ZeRO-3.
        """
        from huggingface_hub import save_torch_state_dict
        from transformers import AutoModelForSequenceClassification

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = merge_lora_state_dict(dict(state_dict if state_dict is not None else self.state_dict()), self)
        base = unwrap(self.backbone, peft=True)
        prefix = type(base).base_model_prefix if hasattr(type(base), "base_model_prefix") else "model"
        weights = {}
        for key, tensor in state.items():
            if key.startswith("backbone."):
                weights[f"{prefix}.{key[len('backbone.'):]}"] = tensor.detach().cpu().contiguous()
            elif key.startswith("value_head."):
                weights[f"score.{key[len('value_head.'):]}"] = tensor.detach().cpu().contiguous()
        config = copy.deepcopy(base.config)
        config.num_labels = 1
        config.tie_word_embeddings = False  # the score head has nothing to tie to
        config.architectures = [AutoModelForSequenceClassification._model_mapping[type(config)].__name__]
        config.dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
        config.save_pretrained(out)
        save_torch_state_dict(weights, out)
        (out / "ds_rlhf_critic.json").write_text(json.dumps({"value_head": "score"}) + "\n")
        return out


class RewardModel(nn.Module):
    """``*ForSequenceClassification`` (one label) scored at each row's last non-pad token: ``forward -> [B]`` fp32."""

    def __init__(self, seqcls: nn.Module):
        super().__init__()
        _seqcls_parts(seqcls)
        self.model = seqcls
        self.config = seqcls.config

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype="fp32", attn_impl: str = "auto",
                        compute_dtype=None, kernels: str = "none", new_head: bool = False) -> RewardModel:
        """A `*ForSequenceClassification` reward model with its trained `score` head; a directory whose weights
        lack the head (a causal LM, e.g. an SFT export) is a ConfigError naming it, before anything is built.
        `new_head=True` (an RM run's starting point, or a module a checkpoint is loaded into) accepts a causal LM
        and starts its head at zero: the untrained RM scores every sequence 0, preferring neither side of a pair
        (a random head already ranks pairs by whatever feature it happens to project, with a random sign)."""
        from transformers import AutoModelForSequenceClassification

        if not new_head and Path(path).is_dir():
            check_reward_model_dir(path)
        kwargs = _hf_kwargs(dtype, attn_impl, compute_dtype)
        seqcls, info = pretrained(AutoModelForSequenceClassification, path, num_labels=1, output_loading_info=True,
                                  **kwargs)
        missing = [k for k in info.get("missing_keys", ()) if k.split(".")[0] == SCORE_HEAD]
        if missing and not new_head:
            raise ConfigError(head_refusal(path, sorted(missing)))
        if missing:
            with torch.no_grad():
                for param in _seqcls_parts(seqcls)[1].parameters():
                    param.zero_()
        apply_kernels(seqcls, kernels)
        return cls(seqcls)

    def gradient_checkpointing_enable(self, **_):
        """`model.gradient_checkpointing` for an RM run (the RM trainer skipped it before: the 8B RM step of
        bench/low_memory_gpu.py then ran out of memory under its 24 GiB cap on the H200)."""
        _enable_gc(self.model)

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        backbone, score = _seqcls_parts(self.model)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_token_index(attention_mask)]
        return score(last).squeeze(-1).float()


_WRAPPERS = {"DeepSpeedEngine", "PipelineEngine", "DistributedDataParallel", "DataParallel"}


def unwrap(engine_or_module, *, peft: bool = False) -> nn.Module:
    """The module inside a DeepSpeed engine (or DDP) wrapper; with `peft=True` also the base model inside a PEFT
    wrapper (LoRA layers stay in place). A plain module is returned as is."""
    module = engine_or_module
    while (any(c.__name__ in _WRAPPERS for c in type(module).__mro__)
           and isinstance(getattr(module, "module", None), nn.Module)):
        module = module.module
    if peft:
        get_base = getattr(module, "get_base_model", None)
        module = get_base() if callable(get_base) else module
    return module


def merge_lora_state_dict(state: dict, module: nn.Module) -> dict:
    """Fold LoRA adapters into their base weights (``W + scaling * B @ A``) and drop peft's name prefixes, giving
    the state dict of the plain model. A no-op for models without LoRA. A quantized base (``model.quantize_base``)
    is dequantized first, so the export holds full-precision weights, not bitsandbytes' packed storage."""
    state = quantized.dequantize_state_dict(state, module)
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return state
    for name, sub in module.named_modules():
        if not isinstance(sub, LoraLayer):
            continue
        weight = state.pop(f"{name}.base_layer.weight")
        merged = weight.float()
        for adapter in list(sub.lora_A.keys()):
            a = state.pop(f"{name}.lora_A.{adapter}.weight").float()
            b = state.pop(f"{name}.lora_B.{adapter}.weight").float()
            delta = (b @ a) * sub.scaling[adapter]
            merged = merged + (delta.T if getattr(sub, "fan_in_fan_out", False) else delta)
        state[f"{name}.weight"] = merged.to(weight.dtype)
        if f"{name}.base_layer.bias" in state:
            state[f"{name}.bias"] = state.pop(f"{name}.base_layer.bias")
    leftover = [k for k in state if "lora_" in k]
    if leftover:
        raise ValueError(f"cannot merge LoRA weights of these keys (unsupported adapter type): {leftover[:4]}")
    return {k.replace("base_model.model.", "", 1): v for k, v in state.items()}
