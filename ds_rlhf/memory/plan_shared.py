"""Rows of the memory plan for the roles that run on the actor's base under `model.share_base` (LoRA).

- the reference (`engines/shared_base.py`): the actor with its adapters off. No weights of its own; a no-grad forward
  through the actor's engine at the actor's ZeRO stage (ZeRO-3 gathers as the actor does);
- the critic of a critic algorithm (`engines/shared_critic.py`): its own LoRA adapters + a value head (hidden x 1)
  on a view of the actor's base. Its weights, gradients and Adam states are those of the adapters and the head only,
  at the critic's ZeRO stage and offload; its activations are a critic's of the actor's shape (forward + backward).
  With `model.quantize_base` there is still nothing of a base to count: the base is the actor's (planned there);
- the reward model, when `reward.model` is a LoRA SEQ_CLS adapter directory of the actor's `model.path`
  (`engines/shared_reward.py:shared_reward_refusal`, the rule the trainer uses, which reads only the adapter's
  config and its safetensors header): its adapters + trained score head, frozen, counted from the adapter file's
  tensor shapes (what peft loads), plus a no-grad forward of the actor's shape. Any other RM keeps its own row.

The rows keep the role's activation estimate from `role_plan.plan_role` and replace its model states with those
of the tensors the role owns (`owned`: a module holding only those parameters, on the meta device).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import nn

from ds_rlhf.engines.model_source import resolve_model_path
from ds_rlhf.engines.shared_reward import shared_reward_refusal
from ds_rlhf.memory import meta_models
from ds_rlhf.memory.role_plan import plan_role


def shares_base(cfg) -> bool:
    """`model.share_base` in effect: the reference is the LoRA actor with its adapters disabled."""
    return bool(cfg.model.share_base) and cfg.model.lora_rank > 0


def shared_reward_adapter(cfg, stage: int) -> str | None:
    """The resolved `reward.model` path when the trainer will run it on the actor's base (`model.share_base` and
    `shared_reward_refusal` accepts it at ZeRO stage `stage`), else None."""
    if not (shares_base(cfg) and cfg.reward.model):
        return None
    path = resolve_model_path(cfg.reward.model)
    return path if shared_reward_refusal(path, resolve_model_path(cfg.model.path), stage) is None else None


def shared_roles(cfg, kind: str, sources: dict[str, str], stage: int) -> dict[str, str]:
    """role -> why it shares the actor's base, for the roles of `sources` (`meta_models.role_sources`) that do."""
    if kind != "rl" or not shares_base(cfg):
        return {}
    out = {}
    if "reference" in sources and not cfg.rl.teacher:  # a teacher is its own model (recipes/rl_build.py)
        out["reference"] = "the actor with LoRA off (model.share_base): no weights of its own"
    if "critic" in sources:
        out["critic"] = "LoRA adapters + value head on the actor's base (model.share_base): no base weights of its own"
    rm = shared_reward_adapter(cfg, stage) if "reward" in sources else None
    if rm is not None:
        out["reward"] = (f"{Path(rm).name}'s LoRA adapters + score head on the actor's base (model.share_base): "
                         "no base weights of its own")
    return out


class _Owned(nn.Module):
    """The parameters a shared role owns (meta tensors), as one module for `role_plan._states`."""

    def __init__(self, params: list[nn.Parameter], config):
        super().__init__()
        self.owned = nn.ParameterList(params)
        self.config = config


def owned_critic(hf_config, lora: dict) -> _Owned:
    """The shared critic's own parameters: the trainable ones of a LoRA critic of the actor's shape (its adapters,
    as `shared_critic_model` puts them on the base view, and the hidden x 1 value head)."""
    critic = meta_models.meta_model("critic", hf_config, lora)
    return _Owned([p for p in critic.parameters() if p.requires_grad], hf_config)


def owned_reward(rm_path: str, hf_config) -> _Owned:
    """The shared RM's own parameters: every tensor of its `adapter_model.safetensors` (LoRA A/B and the trained
    score head, as peft loads them), by shape from the file's header; frozen."""
    import torch
    from safetensors import safe_open

    with safe_open(str(Path(rm_path) / "adapter_model.safetensors"), framework="pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118 (a safetensors handle)
    return _Owned([nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False) for shape in shapes],
                  hf_config)


def shared_row(role: str, hf_config, s, *, lora: dict | None, rm_path: str | None, frozen_stage: int,
               frozen_offload: bool, detail: str):
    """The plan row of a role in `shared_roles` (`s`: the plan's `Settings`; `hf_config`: the actor's)."""
    if role == "reference":
        full = plan_role("reference", meta_models.meta_model("reference", hf_config), hf_config, s, s.zero_stage,
                         s.offload_param)
        return dataclasses.replace(full, num_params=0, params=0, grads=0, optimizer_states=0, host=0, detail=detail)
    if role == "critic":  # trained in its own engine, at the run's stage and offload
        row = plan_role("critic", owned_critic(hf_config, lora), hf_config, s, s.zero_stage, s.offload_param)
        return dataclasses.replace(row, detail=f"{row.detail}, {detail}")
    if role == "reward":  # frozen (builder.frozen_config), a no-grad forward
        row = plan_role("reward", owned_reward(rm_path, hf_config), hf_config, s, frozen_stage, frozen_offload)
        return dataclasses.replace(row, detail=f"{row.detail}, {detail}")
    raise ValueError(f"no shared-base row for role {role!r}")


def shared_notes(cfg, shared: dict[str, str], stage: int) -> list[str]:
    """FAIL notes for what the trainer refuses with a shared base (`rl_build.check_share_base_critic`)."""
    if "critic" in shared and stage == 3:
        return [f"FAIL: model.share_base with a critic (rl.algo={cfg.rl.algo}) needs ZeRO stage 0, 1 or 2 (this plan "
                "is ZeRO-3): set --zero_stage 2, or --model.share_base false"]
    return []

