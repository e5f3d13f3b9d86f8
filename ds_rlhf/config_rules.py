"""The config's cross-section rules: every rule that reads settings of more than one section (or the DeepSpeed
config file) lives here, on the whole config; a section's own `check` reads only its own fields. `Config.check` runs
the sections' checks, then `check_cross_section`; each error is one line naming the keys to change.
"""

from __future__ import annotations

from typing import Protocol

from ds_rlhf.algos.registry import ADVANTAGE_ESTIMATORS
from ds_rlhf.config_rl import RLConfig
from ds_rlhf.config_rl_sections import EnvConfig, EvalConfig
from ds_rlhf.config_sections import DataConfig, ModelConfig, RolloutConfig, RunConfig
from ds_rlhf.ds_config_file import load_ds_config
from ds_rlhf.errors import ConfigError


class WholeConfig(Protocol):
    """What the rules read of `config.Config`."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    rl: RLConfig
    eval: EvalConfig
    env: EnvConfig
    run: RunConfig
    ds_config: str
    zero_stage: int

    def context_len(self) -> int: ...


def check_cross_section(cfg: WholeConfig) -> None:
    """Every cross-section rule; raises ConfigError naming the keys."""
    _check_quantize_base(cfg)
    _check_rollout(cfg)
    _check_rl(cfg)
    _check_env(cfg)
    _check_eval(cfg)


def fp8_mismatch_note(cfg: WholeConfig) -> str | None:
    """FP8 rollouts (`rollout.quantization fp8`) sample from FP8 weights while the trainer scores its own weights,
    so their log-probs differ more than in bf16; the mismatch correction (`rl.mismatch`, default `tis`) corrects
    that and stays on unless set off. Returns the one line a run prints about it (None without FP8 rollouts)."""
    if cfg.rollout.quantization == "none":
        return None
    where = f"rollout.quantization={cfg.rollout.quantization}"
    if cfg.rl.mismatch == "off":
        return (f"[rl] {where} with rl.mismatch=off (as set): the FP8 rollouts' log-prob mismatch trains "
                "uncorrected; --rl.mismatch tis corrects it")
    return (f"[rl] {where}: the mismatch correction rl.mismatch={cfg.rl.mismatch} (cap rl.tis_cap="
            f"{cfg.rl.tis_cap:g}) corrects the FP8 rollouts' log-prob mismatch; --rl.mismatch off turns it off")


def _check_quantize_base(cfg: WholeConfig) -> None:
    """A quantized base is whole on each rank (ZeRO-0/1/2: ZeRO-3's partitioning drops bitsandbytes' quantization
    state); the stage is --zero_stage, else the ds_config file's when readable."""
    model = cfg.model
    if model.quantize_base == "none":
        return
    stage, source = cfg.zero_stage, "--zero_stage 3"
    if stage < 0:
        source = f"ds_config {cfg.ds_config} (zero_optimization.stage 3)"
        try:
            stage = load_ds_config(cfg.ds_config).get("zero_optimization", {}).get("stage", -1)
        except (OSError, ValueError):
            stage = -1  # unreadable here: the engine build checks the resolved stage (quantized.check_ds_config)
    if stage == 3:
        raise ConfigError(f"model.quantize_base={model.quantize_base} needs ZeRO stage 0, 1 or 2, got {source}: "
                          "ZeRO-3 would partition bitsandbytes' packed weights apart from their quantization "
                          "state; set --zero_stage 2 or --model.quantize_base none")


def _check_rollout(cfg: WholeConfig) -> None:
    r, rl = cfg.rollout, cfg.rl
    if r.lora_sync == "adapter" and cfg.model.lora_rank <= 0:
        raise ConfigError(f"rollout.lora_sync=adapter sends only LoRA adapters, but model.lora_rank="
                          f"{cfg.model.lora_rank} trains the whole model (allowed: auto, merged, adapter): set "
                          "--model.lora_rank (e.g. 16) or --rollout.lora_sync merged")
    if r.partial_tokens:
        where = f"rollout.partial_tokens={r.partial_tokens}"
        if rl.dynamic_sampling:
            raise ConfigError(f"{where} with rl.dynamic_sampling: dynamic sampling regenerates whole groups in "
                              "rounds; use one of the two (--rollout.partial_tokens 0 or --rl.dynamic_sampling false)")
        if cfg.env.name:
            raise ConfigError(f"{where} with env.name: episodes already end each turn at a tool call; use "
                              "--rollout.partial_tokens 0 with multi-turn episodes")
        if rl.mismatch == "off":
            raise ConfigError(f"{where} continues samples with newer weights; it needs the mismatch correction "
                              "against the rollout policy: set --rl.mismatch tis or mis")
    if r.async_generation and rl.mismatch == "off":
        raise ConfigError("rollout.async_generation trains on batches generated with older weights; it needs "
                          "the mismatch correction against the rollout policy: set --rl.mismatch tis or mis")
    if r.max_model_len and r.max_model_len < cfg.data.max_prompt_len + r.max_new_tokens:
        raise ConfigError(f"rollout.max_model_len={r.max_model_len} is shorter than data.max_prompt_len + "
                          f"rollout.max_new_tokens = {cfg.data.max_prompt_len + r.max_new_tokens}")


def _check_rl(cfg: WholeConfig) -> None:
    r, rl = cfg.rollout, cfg.rl
    if ADVANTAGE_ESTIMATORS.get(rl.algo).meta.get("groups") and r.n_samples < 2:
        raise ConfigError(f"rl.algo={rl.algo} compares samples of the same prompt: set rollout.n_samples >= 2")
    if rl.dynamic_sampling and r.async_generation:
        raise ConfigError("rl.dynamic_sampling generates more prompts when a batch has too few with differing "
                          "rewards, in the step that trains on it; rollout.async_generation generates the next "
                          "batch before this step trains, so the extra rounds would run with other weights: use "
                          "one of the two (--rollout.async_generation false)")
    if rl.dynamic_sampling and r.n_samples < 2:
        raise ConfigError("rl.dynamic_sampling keeps prompts whose samples' rewards differ: set "
                          "rollout.n_samples >= 2")
    if rl.overlong_buffer > r.max_new_tokens:
        raise ConfigError(f"rl.overlong_buffer={rl.overlong_buffer} is longer than the generation budget "
                          f"rollout.max_new_tokens={r.max_new_tokens} (the penalty starts at max_new_tokens - "
                          "overlong_buffer; 0 = off)")
    samples = rl.prompts_per_step * r.n_samples
    if rl.mini_batch_size > samples:
        raise ConfigError(f"rl.mini_batch_size={rl.mini_batch_size} is larger than the {samples} rollouts of "
                          "a step per rank (rl.prompts_per_step x rollout.n_samples); 0 = all of them")


def _check_env(cfg: WholeConfig) -> None:
    """What multi-turn episodes (`env.name`) run with; the rest is refused here, one line each. Critic estimators
    (PPO) run too: the critic's GAE and value loss read the action mask, so observation tokens get no advantage, no
    value target and no value loss, and the GAE chain links the generated tokens across each observation
    (algos/advantages.py)."""
    env, rl = cfg.env, cfg.rl
    if not env.name:
        return
    key = f"env.name={env.name!r}"
    if rl.dynamic_sampling:
        raise ConfigError(f"{key}: rl.dynamic_sampling is not supported with episodes; set --rl.dynamic_sampling false")
    if rl.overlong_buffer:
        raise ConfigError(f"{key}: rl.overlong_buffer measures a single response against rollout.max_new_tokens, "
                          "not an episode; set --rl.overlong_buffer 0 (rl.overlong_mask drops truncated episodes)")
    if env.max_tokens > cfg.context_len():
        raise ConfigError(f"env.max_tokens={env.max_tokens} is longer than the rollout context of "
                          f"{cfg.context_len()} tokens; raise --rollout.max_model_len to at least it")


def _check_eval(cfg: WholeConfig) -> None:
    ev, run = cfg.eval, cfg.run
    context = cfg.context_len()
    if cfg.data.max_prompt_len + ev.max_new_tokens > context:
        raise ConfigError(f"eval.max_new_tokens={ev.max_new_tokens}: data.max_prompt_len + it exceeds the rollout "
                          f"context of {context} tokens; raise --rollout.max_model_len")
    if ev.best_metric and run.eval_every <= 0:
        raise ConfigError(f"eval.best_metric={ev.best_metric!r} needs evaluations: set --run.eval_every N > 0")
