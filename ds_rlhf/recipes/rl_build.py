"""Building what an RL run needs from its config, once: engines per role, the rollout engine, weight sync, the
prompt loader and the reward stage, into a typed `RLParts`. The step (`rl.py`) uses them; the exports are
`rl_export.py`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ds_rlhf.agent.adapters import load_environment
from ds_rlhf.agent.sandbox import require_protections
from ds_rlhf.agent.sandbox_reap import stop_all as stop_sandbox_calls
from ds_rlhf.algos.curriculum import PassRateTracker
from ds_rlhf.algos.registry import ADVANTAGE_ESTIMATORS
from ds_rlhf.data.loader import StoreLoader
from ds_rlhf.data.store import open_store
from ds_rlhf.ds_config_file import load_ds_config
from ds_rlhf.engines.attention import select_attn_impl
from ds_rlhf.engines.builder import build_actor, build_critic, build_reference, build_reward, build_shared_reference
from ds_rlhf.engines.model_source import resolve_model_path
from ds_rlhf.engines.models import as_dtype, lora_settings
from ds_rlhf.engines.shared_critic import build_shared_critic, check_shared_critic_stage
from ds_rlhf.engines.shared_prompt import supports_shared_prompt
from ds_rlhf.engines.shared_reward import build_shared_reward, shared_reward_refusal
from ds_rlhf.errors import ConfigError
from ds_rlhf.memory.cap import allow_unmapped, apply_trainer_cap, outside_bytes, outside_warning, vllm_memory_fraction
from ds_rlhf.memory.engine_budget import EngineBudget, apply_engine_budget, engine_share, record_engine_budget
from ds_rlhf.memory.kv_cache import KVCacheSize, vllm_kv_cache
from ds_rlhf.memory.meta_models import hf_config
from ds_rlhf.memory.plan import fmt_bytes
from ds_rlhf.recipes.curriculum import CurriculumStream
from ds_rlhf.recipes.policy_update import shared_prompt
from ds_rlhf.recipes.reward_stage import RewardStage
from ds_rlhf.redaction import redact_urls
from ds_rlhf.rewards.judge import JudgeReward
from ds_rlhf.rewards.loading import user_code_specs
from ds_rlhf.rewards.remote import is_remote
from ds_rlhf.rewards.reward_set import RewardSet, RewardSpec, parse_weights
from ds_rlhf.rollout import make_rollout_engine
from ds_rlhf.rollout.weights.canary import SyncCanary
from ds_rlhf.rollout.weights.sync import WeightSync
from ds_rlhf.run.context import RunContext, find_ds_config
from ds_rlhf.run.placement import physical_gpu_count, resolve_placement

if TYPE_CHECKING:
    from ds_rlhf.data.loader import StoreLoader
    from ds_rlhf.rewards.reward_set import RewardSet
    from ds_rlhf.rollout.base import RolloutEngine
    from ds_rlhf.rollout.weights.sync import WeightSync

PROBE_MESSAGES = [{"role": "user", "content": "What is 12 + 30?"},
                  {"role": "assistant", "content": "12 + 30 = 42. #### 42"}]
Engine = Any  # a deepspeed.DeepSpeedEngine (not imported here: importing DeepSpeed is slow)


@dataclass
class RLParts:
    actor: Engine
    critic: Engine | None
    reference: Engine | None  # with model.share_base: engines.shared_base.AdapterOffReference (a view of the actor)
    rollout: RolloutEngine
    sync: WeightSync
    loader: StoreLoader
    loader_iter: Iterator[list[dict]]
    reward: RewardStage
    owns_rollout: bool = True
    environment: Callable[[], Any] | None = None  # env.name: makes one environment per episode
    curriculum: CurriculumStream | None = None  # rl.curriculum pass_rate: it is `loader_iter`

    def engines_to_checkpoint(self) -> dict[str, Engine]:
        """The trained engines (frozen ones are rebuilt from their model paths)."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def close(self) -> None:
        stop_sandbox_calls()  # a tool call still in flight (an abandoned environment step's) and all it started
        self.loader.close()
        self.reward.close()
        self.sync.close()
        if self.owns_rollout:
            self.rollout.close()


def _micro_size(cfg) -> int:
    return max(1, cfg.optim.micro_batch_size)


def build_parts(ctx: RunContext, rollout=None, server_env: dict | None = None) -> RLParts:
    """`rollout`: an existing RolloutEngine to use (tests share one vLLM per session); built here otherwise.
    `server_env`: what each engine process gets on top of this process's environment (the SM split's share)."""
    cfg, dist = ctx.cfg, ctx.dist
    rl = cfg.rl
    check_share_base_critic(cfg)  # before the reward workers, the loader or any model
    functions = reward_functions(cfg, announce=ctx.print) if cfg.reward.fn or cfg.reward.judge else None
    environment = load_environment(cfg.env.name) if cfg.env.name else None  # its file imports here, early
    if environment is not None or cfg.env.sandbox_require:  # every Sandbox's protections, checked before any model
        require_protections(cfg.env.sandbox_require)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", dist.world_size)))
    placement = resolve_placement(cfg, world_size=dist.world_size, local_world_size=local_world,
                                  gpus_on_node=physical_gpu_count())
    loader = _prompt_loader(ctx)
    steps_total = _optimizer_steps(cfg)
    vllm_fraction, fraction, budget = _memory_fractions(ctx, placement.mode)
    if dist.is_main:  # config.json says the share and KV cache the engines get
        record_engine_budget(cfg, budget, ctx.run_dir)
    kv, kv_line = _vllm_kv_cache(ctx, local_world, budget)
    attn = rl_attention(ctx)
    model_opts = dict(attn_impl=attn, gradient_checkpointing=cfg.model.gradient_checkpointing,
                      lora=lora_settings(cfg.model), quantize=cfg.model.quantize_base, kernels=cfg.model.kernels)
    actor = build_actor(ctx.model_path, ctx.ds_config(role="actor", micro_batch_size=_micro_size(cfg),
                                                      lr=cfg.optim.lr, total_steps=steps_total), **model_opts)
    resolve_shared_prompt(ctx, actor)
    critic = None
    if ADVANTAGE_ESTIMATORS.get(rl.algo).meta.get("critic"):
        critic = _build_critic(ctx, actor, ctx.ds_config(role="critic", micro_batch_size=_micro_size(cfg),
                                                         lr=cfg.optim.critic_lr, total_steps=steps_total), model_opts)
    reference = _build_reference(ctx, actor, attn)
    max_len = cfg.context_len()
    owns_rollout = rollout is None
    sync_mode = cfg.rollout.sync_mode()  # rollout.lora_sync: "adapter" sends only the LoRA adapters each step
    lora_engine = {"rank": cfg.model.lora_rank, "targets": cfg.model.lora_targets} if sync_mode == "adapter" else None
    if rollout is None:
        rollout = make_rollout_engine(cfg.rollout.backend, cfg.rollout.placement, model_path=ctx.model_path,
                                      dtype=ctx.rollout_precision, max_model_len=max_len,
                                      gpu_memory_utilization=vllm_fraction, seed=cfg.run.seed,
                                      kv_cache_bytes=kv.bytes if kv and kv.source != "env" else 0,
                                      enable_sleep=(cfg.rollout.sleep and dist.device.type == "cuda"
                                                    and cfg.rollout.placement == "colocated"),
                                      sleep_level=cfg.rollout.sleep_level, **placement.engine_kwargs(),
                                      lora=lora_engine, sidecar_engines=cfg.rollout.sidecar_engines,
                                      **({"server_env": server_env} if server_env else {}),
                                      **cfg.rollout.vllm_options())
        if kv is not None and getattr(rollout, "backend", "") == "vllm":
            ctx.print(kv_line)
        if fraction is not None and placement.mode == "colocated" and hasattr(rollout, "on_unmapped"):
            # PyTorch counts a sleeping vLLM's unmapped pool: the cap follows what the device holds (memory/cap.py)
            rollout.on_unmapped = partial(allow_unmapped, dist.device)
    sync = _weight_sync(ctx, actor, rollout, sync_mode)
    reward = _reward_stage(ctx, functions, attn, actor)
    curriculum = _curriculum(ctx, loader)
    return RLParts(actor=actor, critic=critic, reference=reference, rollout=rollout, sync=sync, loader=loader,
                   loader_iter=curriculum or iter(loader), reward=reward, owns_rollout=owns_rollout,
                   environment=environment, curriculum=curriculum)


def _curriculum(ctx: RunContext, loader: StoreLoader) -> CurriculumStream | None:
    """`rl.curriculum pass_rate`: the loader's stream with prompts always or never solved skipped for a while."""
    rl = ctx.cfg.rl
    if rl.curriculum == "none":
        return None
    tracker = PassRateTracker(ctx.cfg.eval.threshold, rl.curriculum_min_attempts, rl.curriculum_skip_draws)
    return CurriculumStream(iter(loader), tracker, rl.prompts_per_step, scan_limit=len(loader) * rl.prompts_per_step)


def _prompt_loader(ctx: RunContext) -> StoreLoader:
    """This rank's loader of the training prompts (`data.train`), `rl.prompts_per_step` prompts a batch."""
    cfg, dist = ctx.cfg, ctx.dist
    store = open_store(cfg.data.train, tokenizer=ctx.tokenizer, expect_kind="prompts")
    return StoreLoader(store, batch_size=cfg.rl.prompts_per_step, rank=dist.rank, world_size=dist.world_size,
                       seed=cfg.run.seed, shuffle=cfg.data.shuffle, reader=cfg.data.reader,
                       indices=_prompt_rows(ctx, store))


def _optimizer_steps(cfg) -> int:
    """Optimizer steps of the whole run, the ds_config's `total_steps` (LR schedule, 1-bit Adam's freeze step):
    steps x PPO epochs x mini-batches per step."""
    rl = cfg.rl
    samples_per_step = rl.prompts_per_step * cfg.rollout.n_samples
    mini = rl.mini_batch_size or samples_per_step
    return cfg.run.steps * rl.ppo_epochs * -(-samples_per_step // mini)


def _memory_fractions(ctx: RunContext, placement_mode: str) -> tuple[float, float | None, EngineBudget | None]:
    """(vLLM's gpu_memory_utilization, this process's allocator fraction or None, the engines' budget by the work or
    None). On CUDA, where the user left vLLM's memory unset (and no cap), the engines' KV cache is sized by the work
    and their share of the device follows (`memory/engine_budget.py`); run.max_gpu_memory_gb caps this process (and
    colocated vLLM) at the cap; the sidecar split: vLLM's process takes gpu_memory_utilization (of the cap, when
    set), this process the rest (`memory/cap.py`)."""
    cfg, dist = ctx.cfg, ctx.dist
    vllm_fraction, fraction, budget = cfg.rollout.gpu_memory_utilization, None, None
    if dist.device.type == "cuda":
        total = torch.cuda.get_device_properties(dist.device).total_memory
        if (budget := engine_share(cfg, total, world_size=dist.world_size)[1]) is not None:
            apply_engine_budget(cfg, budget)
        fraction = apply_trainer_cap(cfg, dist.device, placement_mode)
        vllm_fraction = vllm_memory_fraction(cfg, total)
        if cfg.run.max_gpu_memory_gb > 0:
            outside = outside_bytes(dist.device)
            ctx.print(f"[rl] run.max_gpu_memory_gb={cfg.run.max_gpu_memory_gb:g}: trainer memory fraction "
                      f"{fraction:.3f}, vLLM gpu_memory_utilization {vllm_fraction:.3f} of the GPU"
                      + ("" if outside is None else f"; {fmt_bytes(outside)} on the GPU outside PyTorch's allocator"))
            if warning := outside_warning(outside):
                ctx.print(warning)
    return vllm_fraction, fraction, budget


def _vllm_kv_cache(ctx: RunContext, local_world: int,
                   budget: EngineBudget | None) -> tuple[KVCacheSize | None, str]:
    """The KV cache of the run's vLLM engines (`memory/kv_cache.py`, the number `ds-rlhf memory` and `ds-rlhf doctor
    --config` report) and its log line: on GPUs the engines' budget's when there is one; else on CPU always, on GPUs
    `rollout.kv_cache_gb`, or bytes 0 (vLLM sizes it from the user's or the cap's gpu_memory_utilization)."""
    cfg, device = ctx.cfg, ctx.dist.device.type
    if budget is not None:
        return budget.kv, budget.line()
    if cfg.rollout.backend == "hf":
        return None, ""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    kv = vllm_kv_cache(cfg, hf_config(ctx.model_path), device=device, host_bytes=host // max(1, local_world),
                       world_size=ctx.dist.world_size)
    return kv, f"[rl] vLLM KV cache{' ' if kv.bytes else ': '}{kv.line()}"


def _build_reference(ctx: RunContext, actor: Engine, attn: str) -> Engine | None:
    """The KL reference when `rl.kl_coef` or `rl.kl_target` > 0 or `rl.distill_loss` is set: the teacher
    (`rl.teacher`, on-policy distillation), or with `model.share_base` the actor with its adapters off (no second
    copy of the base), else a frozen engine of `model.path`."""
    cfg = ctx.cfg
    if not cfg.rl.uses_reference():
        return None
    frozen = ctx.ds_config(role="reference", micro_batch_size=_micro_size(cfg), lr=0.0, total_steps=1, frozen=True)
    if cfg.rl.teacher:
        path = resolve_model_path(cfg.rl.teacher, "rl.teacher")
        ctx.print(f"[rl] rl.teacher: the KL reference is the teacher {path} (on-policy distillation)")
        return build_reference(path, frozen, attn_impl=attn, kernels=cfg.model.kernels)
    if cfg.model.share_base:
        return build_shared_reference(actor)
    return build_reference(ctx.model_path, frozen, attn_impl=attn, kernels=cfg.model.kernels)


def _weight_sync(ctx: RunContext, actor: Engine, rollout: RolloutEngine, sync_mode: str) -> WeightSync:
    """The actor -> rollout weight sync, checked after each sync by a canary prompt (`PROBE_MESSAGES`)."""
    cfg = ctx.cfg
    probe = ctx.tokenizer.apply_chat_template(PROBE_MESSAGES, return_dict=False)
    canary = SyncCanary(list(probe), threshold=cfg.rollout.canary_threshold or None)
    return WeightSync(actor, rollout, bucket_bytes=cfg.rollout.bucket_mb << 20, canary=canary, mode=sync_mode)


def _prompt_rows(ctx: RunContext, store) -> list[int] | None:
    """All rows, or (data.overlong_prompts=drop) those that fit data.max_prompt_len, with the count said."""
    if ctx.cfg.data.overlong_prompts != "drop":
        return None
    lengths = store.column_lengths("input_ids")
    keep = [i for i, n in enumerate(lengths.tolist()) if n <= ctx.cfg.data.max_prompt_len]
    ctx.print(f"[rl] data.overlong_prompts=drop: {len(lengths) - len(keep)} of {len(lengths)} prompts are longer "
              f"than data.max_prompt_len={ctx.cfg.data.max_prompt_len} and are skipped")
    if not keep:
        raise ValueError(f"every prompt in {ctx.cfg.data.train} is longer than data.max_prompt_len")
    return keep


def reward_functions(cfg, announce: Callable[[str], object] | None = print) -> RewardSet:
    """The run's reward function(s), started before any model is built: a user file that fails to import, or a
    worker pool that cannot start, stops the run in seconds."""
    workers = cfg.reward.workers
    if workers < 0:  # built-in rules are ours and cannot hang; user code runs in workers with a timeout
        workers = 2 if user_code_specs(cfg.reward.fn) else 0
    judge = judge_specs(cfg)
    try:
        parts = [p.strip() for p in cfg.reward.fn.split(",") if p.strip()]
        specs = [RewardSpec(p, w) for p, w in zip(parts, parse_weights(cfg.reward.weights or None, len(parts)))]
        return RewardSet(specs + judge, workers=workers,
                         timeout=cfg.reward.timeout, mp_context=cfg.reward.mp_context,
                         import_timeout=cfg.reward.import_timeout, announce=announce,
                         http_batch=cfg.reward.http_batch, http_max_reply_mb=cfg.reward.max_reply_mb)
    except Exception as exc:  # noqa: BLE001 - the user's file: report it in one line, naming the setting
        hint = (" (reward workers start with 'spawn' and re-import the script that started this run: keep its "
                "top-level code under `if __name__ == \"__main__\":`)" if "worker died" in str(exc) else "")
        raise ConfigError(redact_urls(f"reward.fn={cfg.reward.fn!r} cannot be loaded: {type(exc).__name__}: "
                                      f"{exc}{hint}")) from None


def judge_specs(cfg) -> list[RewardSpec]:
    """The LLM judge (`reward.judge`, rewards/judge.py) as a reward function named `judge`; [] without one."""
    judge = cfg.reward.judge
    if not judge:
        return []
    model = judge if is_remote(judge) else resolve_model_path(judge, "reward.judge")
    try:
        fn = JudgeReward(model, cfg.reward.judge_prompt, batch=cfg.reward.judge_batch,
                         max_tokens=cfg.reward.judge_max_tokens, timeout=cfg.reward.timeout,
                         max_reply_bytes=int(cfg.reward.max_reply_mb * (1 << 20)))
    except (ValueError, OSError) as exc:
        raise ConfigError(redact_urls(f"reward.judge={judge!r}: {exc}")) from None
    return [RewardSpec(fn, cfg.reward.judge_weight, name="judge", style="batched")]


def _reward_stage(ctx: RunContext, functions: RewardSet | None, attn: str, actor: Engine) -> RewardStage:
    """Reward functions, the reward model, or both (their scores added under `reward.model_weight` and
    `reward.weights`). The reward model is a frozen engine of its own, or with `model.share_base` and an RM that
    is a LoRA adapter of the actor's base, its adapters + score head on that base (`engines/shared_reward.py`)."""
    if not ctx.cfg.reward.model:
        return RewardStage(ctx, fn=functions)  # neither (rl.teacher alone): every score 0, the KL term teaches
    path = resolve_model_path(ctx.cfg.reward.model, "reward.model")
    ds_config = ctx.ds_config(role="reward", micro_batch_size=_micro_size(ctx.cfg), lr=0.0, total_steps=1,
                              frozen=True)
    if ctx.cfg.model.share_base:
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        why = shared_reward_refusal(path, ctx.model_path, stage)
        if why is None:
            ctx.print(f"[rl] model.share_base: the reward model is {path}'s LoRA adapters + score head on the "
                      "actor's base, no copy of its own")
            return RewardStage(ctx, fn=functions, model=build_shared_reward(actor, path, ds_config))
        ctx.print(f"[rl] model.share_base: the reward model is a separate frozen model with its own weights: {why}")
    return RewardStage(ctx, fn=functions,
                       model=build_reward(path, ds_config, attn_impl=attn, kernels=ctx.cfg.model.kernels))


def resolve_shared_prompt(ctx: RunContext, actor: Engine) -> None:
    """`data.rl_shared_prompt` for the run, once: on or off in `ctx.cfg` (every rank alike), `auto` off where the
    actor cannot run the shared-prompt passes (`engines/shared_prompt.py:supports_shared_prompt`); the layout of the
    log-prob passes printed once."""
    cfg = ctx.cfg
    setting = cfg.data.rl_shared_prompt
    why = supports_shared_prompt(actor) if shared_prompt(cfg) else ""
    if why and setting == "on":
        raise ConfigError(f"data.rl_shared_prompt=on: the actor cannot forward a shared prompt: {why}; set "
                          "--data.rl_shared_prompt off (or auto)")
    cfg.data.rl_shared_prompt = "on" if shared_prompt(cfg) and not why else "off"
    if cfg.data.rl_shared_prompt == "on":
        layout = "shared prompt (each group's prompt forwarded once; micro-batches of whole groups)"
    else:
        layout = "packed rows" if cfg.data.rl_packing else "padded rows"
        layout += f" (data.rl_shared_prompt {setting}{': ' + why if why else ''})"
    ctx.print(f"[rl] log-prob passes: {layout}")


def rl_attention(ctx: RunContext) -> str:
    """The attention kernel of the RL models: `model.attn_impl`, with "auto" resolved for the batches they see
    (padded rows unless `data.rl_packing`; see engines/attention.py:select_attn_impl)."""
    return select_attn_impl(ctx.cfg.model.attn_impl, device=str(ctx.dist.device), dtype=as_dtype(ctx.precision),
                            padded=not ctx.cfg.data.rl_packing)


def check_share_base_critic(cfg) -> None:
    """With `model.share_base` and a critic algorithm, the ZeRO stage the run will use (the `--zero_stage`
    override, else the ds_config file's) must not be 3 (`engines/shared_critic.py`). Reads the ds_config file only,
    so it can run before anything is set up."""
    if not (cfg.model.share_base and ADVANTAGE_ESTIMATORS.get(cfg.rl.algo).meta.get("critic")):
        return
    if cfg.zero_stage >= 0:
        check_shared_critic_stage(cfg.zero_stage, f"--zero_stage {cfg.zero_stage} sets")
        return
    stage = load_ds_config(find_ds_config(cfg.ds_config)).get("zero_optimization", {}).get("stage")
    check_shared_critic_stage(stage, f"ds_config={cfg.ds_config} has")


def _build_critic(ctx: RunContext, actor: Engine, ds_config: dict, model_opts: dict) -> Engine:
    """The critic engine: its own model from `_critic_source`, or with `model.share_base` LoRA adapters + a value
    head on the actor's base (`engines/shared_critic.py`; the value head from the source's `score` when the critic
    starts from a reward model, fresh otherwise)."""
    critic_path, init = _critic_source(ctx)
    if not ctx.cfg.model.share_base:
        return build_critic(critic_path, ds_config, init_from=init, **model_opts)
    head_from = critic_path if init == "reward" else None
    head = (f"the value head is {critic_path}'s score head (its backbone is not loaded)" if head_from else
            "the value head is fresh (critic.init=actor)")
    ctx.print(f"[rl] model.share_base: the critic is LoRA adapters + a value head on the actor's base, no copy "
              f"of its own; {head}")
    return build_shared_critic(actor, ds_config, lora=model_opts["lora"], head_from=head_from)


def _critic_source(ctx: RunContext) -> tuple[str, str]:
    path = ctx.cfg.critic.path or ctx.cfg.reward.model or ctx.model_path
    init = ctx.cfg.critic.init
    if init == "auto":
        init = "reward" if (ctx.cfg.critic.path or ctx.cfg.reward.model) and path != ctx.model_path else "actor"
    key = "critic.path" if ctx.cfg.critic.path else "reward.model" if ctx.cfg.reward.model else "model.path"
    return resolve_model_path(path, key), init
