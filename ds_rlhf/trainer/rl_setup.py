"""Building what an RL run needs from its config: engines per role, rollout engine, weight sync, data, rewards."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_rlhf.trainer.experience import pad_right
from ds_rlhf.trainer.rewards import load_reward_fn, score_samples
from ds_rlhf.trainer.run_context import RunContext, resolve_model_path

PROBE_MESSAGES = [{"role": "user", "content": "What is 12 + 30?"},
                  {"role": "assistant", "content": "12 + 30 = 42. #### 42"}]


@dataclass
class RLParts:
    actor: object
    critic: object | None
    reference: object | None
    rollout: object
    sync: object
    loader: object
    loader_iter: object
    reward: object
    owns_rollout: bool = True

    def close(self) -> None:
        self.loader.close()
        if self.owns_rollout:
            self.rollout.close()


CHOICES = {"rl.kl_in": ("loss", "reward"), "rl.kl_estimator": ("k1", "k2", "k3"),
           "rl.mismatch": ("tis", "mis", "off"), "rl.on_bad_reward": ("fail", "zero", "drop"),
           "rl.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "const-norm"),
           "rollout.backend": ("auto", "vllm", "hf"), "rollout.placement": ("colocated", "disaggregated"),
           "rollout.sleep_level": (1, 2)}


def check_rl_settings(cfg) -> None:
    """Refuse combinations that would train on wrong numbers, before any model is loaded."""
    from ds_rlhf.config import ConfigError
    from ds_rlhf.trainer.rl_math import ALGOS

    for key, allowed in {**CHOICES, "rl.algo": ALGOS}.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: choose one of {', '.join(map(str, allowed))}")
    r = cfg.rollout
    if cfg.rl.mismatch != "off" and (r.temperature != 1.0 or r.top_p != 1.0 or r.top_k not in (-1, 0)):
        raise ConfigError("rollout/trainer mismatch correction compares the rollout engine's log-probs of the raw "
                          "distribution with the trainer's; with temperature/top_p/top_k sampling they differ by "
                          "construction. Use temperature 1, top_p 1, top_k -1, or set --rl.mismatch off.")
    if cfg.rl.prompts_per_step < 1 or r.n_samples < 1:
        raise ConfigError("rl.prompts_per_step and rollout.n_samples must be >= 1")
    if cfg.rl.algo in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline") and r.n_samples < 2:
        raise ConfigError(f"rl.algo={cfg.rl.algo} compares samples of the same prompt: set rollout.n_samples >= 2")


def _micro_size(cfg) -> int:
    return max(1, cfg.optim.micro_batch_size)


def build_parts(ctx: RunContext, rollout=None) -> RLParts:
    """`rollout`: an existing RolloutEngine to use (tests share one vLLM per session); built here otherwise."""
    from ds_rlhf.data.loader import StoreLoader
    from ds_rlhf.data.store import open_store
    from ds_rlhf.engines.builder import build_actor, build_critic, build_reference
    from ds_rlhf.rollout import make_rollout_engine
    from ds_rlhf.rollout.canary import SyncCanary
    from ds_rlhf.rollout.sync import WeightSync
    from ds_rlhf.trainer.placement import physical_gpu_count, resolve_placement

    cfg, dist = ctx.cfg, ctx.dist
    rl = cfg.rl
    check_rl_settings(cfg)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", dist.world_size)))
    placement = resolve_placement(cfg, world_size=dist.world_size, local_world_size=local_world,
                                  gpus_on_node=physical_gpu_count())
    if not cfg.data.train:
        raise ValueError("data.train is empty: pass --data.train <prompt store dir> (see data_prep/)")
    if not rl.reward_fn and not rl.reward_model:
        raise ValueError("set rl.reward_fn (gsm8k | format | math_shaped | file.py:func) or rl.reward_model")
    store = open_store(cfg.data.train, tokenizer=ctx.tokenizer, expect_kind="prompts")
    loader = StoreLoader(store, batch_size=rl.prompts_per_step, rank=dist.rank, world_size=dist.world_size,
                         seed=cfg.run.seed, shuffle=cfg.data.shuffle, reader=cfg.data.reader)
    samples_per_step = rl.prompts_per_step * cfg.rollout.n_samples
    mini = rl.mini_batch_size or samples_per_step
    steps_total = cfg.run.steps * rl.ppo_epochs * -(-samples_per_step // mini)
    model_opts = dict(attn_impl=cfg.model.attn_impl,
                      gradient_checkpointing=cfg.model.gradient_checkpointing, lora=_lora(cfg))
    actor = build_actor(ctx.model_path, ctx.ds_config(role="actor", micro_batch_size=_micro_size(cfg),
                                                      lr=cfg.optim.lr, total_steps=steps_total), **model_opts)
    critic = None
    if rl.algo == "ppo":
        critic_path, init = _critic_source(ctx)
        critic = build_critic(critic_path, ctx.ds_config(role="critic", micro_batch_size=_micro_size(cfg),
                                                         lr=cfg.optim.critic_lr, total_steps=steps_total),
                              init_from=init, **model_opts)
    reference = None
    if rl.kl_coef > 0 or rl.kl_target > 0:
        reference = build_reference(ctx.model_path, ctx.ds_config(role="reference", micro_batch_size=_micro_size(cfg),
                                                                  lr=0.0, total_steps=1, frozen=True),
                                    attn_impl=cfg.model.attn_impl)
    max_len = cfg.rollout.max_model_len or (cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    owns_rollout = rollout is None
    if rollout is None:
        rollout = make_rollout_engine(cfg.rollout.backend, cfg.rollout.placement, model_path=ctx.model_path,
                                      dtype=ctx.precision, max_model_len=max_len,
                                      gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, seed=cfg.run.seed,
                                      enable_sleep=cfg.rollout.sleep and dist.device.type == "cuda",
                                      sleep_level=cfg.rollout.sleep_level, **placement.engine_kwargs())
    probe = ctx.tokenizer.apply_chat_template(PROBE_MESSAGES, return_dict=False)
    canary = SyncCanary(list(probe), threshold=cfg.rollout.canary_threshold or None)
    sync = WeightSync(actor, rollout, bucket_bytes=cfg.rollout.bucket_mb << 20, canary=canary)
    reward = RewardStage(ctx)
    return RLParts(actor=actor, critic=critic, reference=reference, rollout=rollout, sync=sync, loader=loader,
                   loader_iter=iter(loader), reward=reward, owns_rollout=owns_rollout)


def _lora(cfg) -> dict | None:
    if cfg.model.lora_rank <= 0:
        return None
    return {"r": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha, "targets": cfg.model.lora_targets}


def _critic_source(ctx: RunContext) -> tuple[str, str]:
    rl = ctx.cfg.rl
    path = rl.critic_path or rl.reward_model or ctx.model_path
    init = rl.critic_init
    if init == "auto":
        init = "reward" if (rl.critic_path or rl.reward_model) and path != ctx.model_path else "actor"
    return resolve_model_path(path), init


class RewardStage:
    """Scores rollout samples with the reward model or a reward function and applies the bad-reward policy."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        rl = ctx.cfg.rl
        self.fn = load_reward_fn(rl.reward_fn) if rl.reward_fn else None
        self.model = None
        if rl.reward_model:
            from ds_rlhf.engines.builder import build_reward

            self.model = build_reward(resolve_model_path(rl.reward_model),
                                      ctx.ds_config(role="reward", micro_batch_size=_micro_size(ctx.cfg), lr=0.0,
                                                    total_steps=1, frozen=True), attn_impl=ctx.cfg.model.attn_impl)
        self.bad_total = 0

    def __call__(self, samples, rows: list[dict], step: int):
        tok = self.ctx.tokenizer
        texts = [tok.decode(s.response_ids, skip_special_tokens=True) for s in samples]  # decoded once per step
        if self.model is not None:
            scores = self._model_scores(samples)
            keep = [True] * len(samples)
            bad = []
        else:
            items = [{"prompt": rows[s.prompt_index].get("prompt_text") or "", "response": text,
                      "ground_truth": rows[s.prompt_index].get("ground_truth"),
                      "metadata": {"data_source": rows[s.prompt_index].get("data_source"),
                                   "finish_reason": s.finish_reason},
                      "id": f"step{step}/rank{self.ctx.dist.rank}/row{rows[s.prompt_index].get('row_id')}"
                            f"/sample{s.sample_index}"} for s, text in zip(samples, texts)]
            report = score_samples(self.fn, items, self.ctx.cfg.rl.on_bad_reward)
            scores, keep, bad = report.scores, report.keep, report.bad
        self.bad_total += len(bad)
        for sample_id, reason in bad[:3]:
            print(f"[reward] bad reward for {sample_id}: {reason} (policy {self.ctx.cfg.rl.on_bad_reward})")
        exact = self._exact_match(samples, texts, rows)
        kept = [s for s, k in zip(samples, keep) if k]
        kept_scores = [v for v, k in zip(scores, keep) if k]
        t = torch.tensor(kept_scores) if kept_scores else torch.zeros(1)
        metrics = {"reward/mean": t.mean(), "reward/std": t.std() if len(t) > 1 else 0.0,
                   "reward/max": t.max(), "reward/min": t.min(),
                   "reward/bad": float(len(bad)), "reward/bad_total": float(self.bad_total),
                   "reward/dropped": float(len(samples) - len(kept))}
        if exact is not None:
            metrics["reward/exact_match"] = exact
        return kept, kept_scores, metrics

    def _exact_match(self, samples, texts: list[str], rows: list[dict]) -> float | None:
        """GSM8K-style exact-match rate, logged whenever the prompts carry ground truth (monitoring only)."""
        from ds_rlhf.trainer.rewards import gsm8k_reward

        truths = [rows[s.prompt_index].get("ground_truth") for s in samples]
        if not samples or any(t is None for t in truths):
            return None
        return sum(gsm8k_reward("", text, truth, {}) for text, truth in zip(texts, truths)) / len(samples)

    @torch.no_grad()
    def _model_scores(self, samples) -> list[float]:
        seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
        bs = max(1, self.ctx.cfg.optim.micro_batch_size)
        out = []
        for i in range(0, len(seqs), bs):
            ids, attn = pad_right(seqs[i : i + bs], self.ctx.tokenizer.pad_token_id, self.ctx.dist.device)
            out.extend(self.model(input_ids=ids, attention_mask=attn).float().cpu().tolist())
        return out


def sampling_spec(ctx: RunContext, step: int):
    from ds_rlhf.rollout.base import SamplingSpec

    cfg = ctx.cfg
    r = cfg.rollout
    # Distinct, reproducible seeds per (run seed, step, rank); the engine adds the prompt index.
    seed = cfg.run.seed * 1_000_003 + (step * ctx.dist.world_size + ctx.dist.rank) * 10_007
    return SamplingSpec(n=r.n_samples, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                        top_k=r.top_k, stop_token_ids=(ctx.tokenizer.eos_token_id,), seed=seed)


def truncate_metrics(ctx: RunContext, step: int) -> None:
    """On resume, drop logged steps after the checkpoint so the log matches an uninterrupted run."""
    if not ctx.dist.is_main:
        return
    path = Path(ctx.run_dir) / "metrics.jsonl"
    if path.exists():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in lines))


def export(ctx: RunContext, parts: RLParts) -> None:
    from ds_rlhf.engines.engine_io import export_hf

    export_hf(parts.actor, ctx.tokenizer, Path(ctx.run_dir) / "export" / "actor")
    if parts.critic is not None:
        export_hf(parts.critic, ctx.tokenizer, Path(ctx.run_dir) / "export" / "critic")
    ctx.print(f"[rl] exported Hugging Face model(s) to {Path(ctx.run_dir) / 'export'}")
