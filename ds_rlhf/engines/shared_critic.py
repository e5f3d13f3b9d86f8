"""The critic of `model.share_base` (PPO with LoRA): LoRA adapters + a value head on the actor's own frozen base.

The base's weights exist once. `base_view(decoder)` is a second module tree over the actor's decoder: every module
is a shallow copy (its own `_parameters` / `_buffers` / `_modules` / hook dicts), every parameter and buffer is the
actor's own tensor, and peft's LoRA layers are replaced by their base layers. peft then puts the critic's own LoRA
adapters on that view (`apply_lora`, B = 0 at the start), and `CriticModel` adds the value head. The critic is then
an ordinary `CriticModel` in its own DeepSpeed engine with its own optimizer (`optim.critic_lr`), clipping, scheduler
and checkpoint; its export (`CriticModel.save_pretrained`) merges its adapters into the shared base as before.

Why a view instead of a second adapter inside the actor's peft model: the actor's adapters, its weight sync to vLLM
and its export see only the actor's tree, so nothing there can pick up the critic's adapters; the critic's forward
and its gradient-checkpointing recompute run on the critic's own modules, so there is no active-adapter switch to
get wrong between a forward and its backward; and peft's `disable_adapter()` / `set_adapter()` (which flip
`requires_grad`) on one tree never touch the other tree's adapters. The shared base parameters are frozen
(`requires_grad=False`), so neither engine's optimizer, gradient hooks, clipping or gradient all-reduce touch them.

ZeRO-3 partitions a module's parameters for one engine and drives their gathering with that engine's hooks, so a
base shared between two engines cannot be partitioned: `check_shared_critic_stage` refuses that combination.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

from torch import nn

from ds_rlhf.engines.builder import build_engine
from ds_rlhf.engines.models import CriticModel, apply_lora, unwrap
from ds_rlhf.engines.roles import role_info
from ds_rlhf.errors import ConfigError

logger = logging.getLogger(__name__)


def base_view(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """A module tree computing `module`'s base function from `module`'s own parameter and buffer tensors: each
    module a shallow copy, peft tuner layers (LoRA) replaced by their base layers. No tensor is copied."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    memo = {} if memo is None else memo
    if id(module) in memo:  # a module registered twice (shared) stays shared in the view
        return memo[id(module)]
    if isinstance(module, BaseTunerLayer):
        view = base_view(module.get_base_layer(), memo)
    else:
        view = copy.copy(module)  # the same __dict__ values; the dicts themselves are copied next
        for key, value in vars(module).items():
            if isinstance(value, dict):
                view.__dict__[key] = copy.copy(value)  # _parameters, _buffers, hook dicts: same entries
        view._modules = {name: None if child is None else base_view(child, memo)
                         for name, child in module._modules.items()}
    memo[id(module)] = view
    return view


def actor_decoder(actor) -> nn.Module:
    """The actor's decoder (the LM without its output head), LoRA layers in place."""
    return unwrap(actor, peft=True).get_decoder()


def score_head(path: str | Path, hidden_size: int) -> nn.Linear:
    """The `score` head of a `*ForSequenceClassification` checkpoint (a reward model, an exported critic), read
    from its safetensors without loading the rest of the model; fp32."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else {}
    # a peft SEQ_CLS adapter directory (a LoRA RM) keeps its trained head as base_model.model.score.* beside the
    # adapters; a full checkpoint as score.*
    adapter = path / "adapter_model.safetensors"
    prefix = "base_model.model." if adapter.exists() and not (path / "model.safetensors").exists() else ""
    tensors = {}
    for key in ("score.weight", "score.bias"):
        file = adapter if prefix else path / weight_map.get(key, "model.safetensors")
        if not file.exists():
            raise ValueError(f"{path} has no safetensors weights: the shared critic reads the value head from a "
                             "*ForSequenceClassification checkpoint's 'score' there (or use --critic.init actor)")
        with safe_open(str(file), framework="pt") as f:
            if prefix + key in set(f.keys()):  # a safetensors handle has no __contains__
                tensors[key.removeprefix("score.")] = f.get_tensor(prefix + key).float()
    weight = tensors.get("weight")
    if weight is None or tuple(weight.shape) != (1, hidden_size):
        found = "no score.weight" if weight is None else f"score.weight of shape {tuple(weight.shape)}"
        raise ValueError(f"{path}: the shared critic's value head needs a score.weight of shape (1, {hidden_size}) "
                         f"(the actor's hidden size), found {found}: use --critic.init actor for a fresh head")
    head = nn.Linear(hidden_size, 1, bias="bias" in tensors)
    head.load_state_dict(tensors)
    return head


def fresh_value_head(hidden_size: int) -> nn.Linear:
    """A new value head initialised as `CriticModel` does (small normal weights: values start near 0), in fp32."""
    head = nn.Linear(hidden_size, 1, bias=False)
    nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1))
    return head


def shared_critic_model(actor, lora: dict, head_from: str | Path | None = None) -> CriticModel:
    """A `CriticModel` whose backbone is the actor's base (a `base_view`) with fresh LoRA adapters of its own;
    the value head from `head_from`'s `score` (a reward model) or fresh."""
    decoder = actor_decoder(actor)
    hidden = decoder.config.hidden_size
    backbone = apply_lora(base_view(decoder), lora, None)
    head = score_head(head_from, hidden) if head_from is not None else fresh_value_head(hidden)
    return CriticModel(backbone, head)


def check_shared_critic_stage(stage, where: str) -> None:
    """Refuse ZeRO-3 for a critic on the shared base (one line, naming the keys and the fixes)."""
    if stage == 3:
        raise ConfigError(
            "model.share_base=true with a critic (rl.algo=ppo) puts the critic's LoRA adapters on the actor's base, "
            f"which needs ZeRO stage 0, 1 or 2, but {where} zero_optimization.stage=3 (ZeRO-3 partitions a module "
            "for one engine only): set --zero_stage 2, or --model.share_base false for a critic with its own copy "
            "of the base")


def owned_parameters(model: nn.Module, base: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters of `model` that are not tensors of `base` (by storage): what `model` adds to memory."""
    shared = {p.data_ptr() for p in base.parameters()}
    return [(n, p) for n, p in model.named_parameters() if p.data_ptr() not in shared]


def build_shared_critic(actor, ds_config: dict, *, lora: dict, head_from: str | Path | None = None):
    """The critic engine of `model.share_base`: `shared_critic_model` in its own DeepSpeed engine (`ds_config`:
    the critic's, with its learning rate). `actor` must be built (its engine has cast the base to its dtype)."""
    actor_info = role_info(actor)
    for where, cfg in (("the actor's ds_config has", actor_info.ds_config if actor_info else {}),
                       ("the critic's ds_config has", ds_config)):
        check_shared_critic_stage(cfg.get("zero_optimization", {}).get("stage", 0), where)
    model = shared_critic_model(actor, lora, head_from)
    own = sum(p.numel() for _, p in owned_parameters(model, actor_decoder(actor)))
    logger.info("critic: LoRA adapters + value head on the actor's base (model.share_base): %d parameters of its "
                "own, value head %s", own, f"from {head_from}" if head_from is not None else "fresh")
    return build_engine(model, ds_config, role="critic", trainable=True)
