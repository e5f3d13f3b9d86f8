"""Low-memory RL on CPU: the recipe file, the memory cap checked before loading, the vLLM / trainer
memory fractions, the plan without a reference copy, and a tiny PPO run on a LoRA actor with a shared base. The
cap around vLLM's sleeping pool: test_low_memory_sleeping_pool.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.memory.cap import check_memory_cap, trainer_memory_fraction, vllm_memory_fraction
from ds_rlhf.memory.plan import GiB

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "ds_configs" / "low_memory_24g.yaml")


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory) -> str:
    """A config.json of an 8B Llama-3 shape (no weights: the plan reads shapes only)."""
    from transformers import LlamaConfig

    out = tmp_path_factory.mktemp("llama8b")
    LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False).save_pretrained(out)
    return str(out)


def _recipe(*extra):
    return parse_config(["--config", RECIPE, "--rollout.backend", "vllm", *extra])


def _roles(plan):
    return {r.role: r for r in plan.roles}


def test_low_memory_recipe_parses():
    cfg = parse_config(["--config", RECIPE])
    m = cfg.model
    assert (m.lora_rank, m.share_base, m.gradient_checkpointing, m.dtype) == (16, True, True, "bf16")
    assert cfg.run.max_gpu_memory_gb == 24 and cfg.offload and cfg.ds_config == "ds_configs/low_memory_24g.json"
    assert cfg.rollout.sleep and cfg.rl.kl_coef > 0  # the KL reference comes from the shared base


def test_recipe_plan_fits_24gib_for_an_8b_model(llama8b):
    plan = check_memory_cap(_recipe("--model.path", llama8b), total_bytes=int(141 * GiB))
    assert plan is not None and plan.fits and plan.settings.capacity == 24 * GiB  # the cap, not the card
    ref = _roles(plan)["reference"]
    assert ref.num_params == ref.params == ref.host == 0 and "share_base" in ref.detail
    assert plan.peak + plan.settings.reserve <= 24 * GiB


def test_share_base_drops_the_reference_copy_from_the_plan(llama8b):
    args = ("--model.path", llama8b, "--offload", "false", "--zero_stage", "2", "--run.max_gpu_memory_gb", "1000")
    own = check_memory_cap(_recipe(*args, "--model.share_base", "false"), total_bytes=int(1000 * GiB))
    shared = check_memory_cap(_recipe(*args), total_bytes=int(1000 * GiB))
    ref_own, ref_shared = _roles(own)["reference"], _roles(shared)["reference"]
    assert ref_own.params > 14 * GiB and ref_shared.params == 0  # a frozen bf16 copy of 8B parameters, or nothing
    assert own.phases["rollout"] - shared.phases["rollout"] == ref_own.params


def _ppo_plans(llama8b, *extra):
    """The recipe's PPO plan at ZeRO-2 (a critic on the shared base needs ZeRO 0-2) without and with share_base."""
    args = ("--model.path", llama8b, "--rl.algo", "ppo", "--zero_stage", "2", "--run.max_gpu_memory_gb", "1000",
            *extra)
    return tuple(check_memory_cap(_recipe(*args, "--model.share_base", share), total_bytes=int(1000 * GiB))
                 for share in ("false", "true"))


def test_share_base_critic_plans_no_copy_of_the_base(llama8b):
    """PPO with share_base: the critic's row holds its LoRA adapters and value head only; both phase peaks drop by
    the reference's copy plus the separate critic's base, exactly."""
    own, shared = _ppo_plans(llama8b)
    c_own, c_shared, ref_own = _roles(own)["critic"], _roles(shared)["critic"], _roles(own)["reference"]
    assert c_own.params > 13 * GiB and c_shared.params < 0.01 * c_own.params  # bf16 8B base, or 42M adapters
    assert c_shared.params == 2 * c_shared.num_params and c_shared.num_params == c_shared.grads // 2  # all trained
    assert (c_shared.grads, c_shared.activations, c_shared.host) == (c_own.grads, c_own.activations, c_own.host)
    assert "share_base" in c_shared.detail and "no base weights" in c_shared.detail
    assert ref_own.params > 14 * GiB and _roles(shared)["reference"].params == 0
    for phase in ("rollout", "train"):
        assert own.phases[phase] - shared.phases[phase] == ref_own.params + c_own.params - c_shared.params, phase


def test_quantized_shared_base_critic_counts_no_base(llama8b):
    """quantize_base nf4 + share_base: the actor's base is quantized, the critic still has no base to count (the
    same row as without quantization); a separate critic's quantized base is what share_base takes away."""
    q_own, q_shared = _ppo_plans(llama8b, "--model.quantize_base", "nf4")
    plain = _roles(_ppo_plans(llama8b)[1])
    c_own, c_shared = _roles(q_own)["critic"], _roles(q_shared)["critic"]
    assert c_shared == plain["critic"] and "base nf4" not in c_shared.detail
    assert "base nf4" in c_own.detail and c_shared.params < 0.02 * c_own.params  # 80 MiB against 4.4 GiB of nf4
    actor = _roles(q_shared)["actor"]
    assert "base nf4" in actor.detail and actor.params < plain["actor"].params - 9 * GiB
    ref_own = _roles(q_own)["reference"].params
    for phase in ("rollout", "train"):
        assert q_own.phases[phase] - q_shared.phases[phase] == ref_own + c_own.params - c_shared.params, phase


def test_cap_refuses_a_plan_that_cannot_fit_before_loading(llama8b, addition_stores, monkeypatch):
    """Full fine-tuning with its own reference under a 24 GiB cap: one line naming the contributors and the fixes,
    raised by the trainer's preflight before any process group or weight."""
    import transformers

    from ds_rlhf.recipes import rl as rl_trainer

    def no_loading(*_, **__):
        raise AssertionError("a model started loading before the cap was checked")

    monkeypatch.setattr(rl_trainer, "setup_run", no_loading)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    cfg = _recipe("--model.path", llama8b, "--model.lora_rank", "0", "--model.share_base", "false",
                  "--offload", "false", "--data.train", str(addition_stores["prompts"]),
                  "--reward.fn", "math_shaped")
    with pytest.raises(ConfigError) as err:
        rl_trainer.RLTrainer(cfg)  # on a machine without a GPU: planned for a GPU of exactly the cap
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("run.max_gpu_memory_gb=24: this rl run needs about")
    assert "biggest: actor" in msg and "reference" in msg
    for fix in ("--model.share_base true", "--model.lora_rank 16", "--offload true"):
        assert fix in msg, (fix, msg)
    # the same run with the recipe's settings passes the same check
    fits = _recipe("--model.path", llama8b, "--data.train", str(addition_stores["prompts"]),
                   "--reward.fn", "math_shaped")
    assert check_memory_cap(fits, total_bytes=int(24 * GiB)).fits
    # vLLM's share of the cap too small for its weights: the vLLM setting is named
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        check_memory_cap(_recipe("--model.path", llama8b, "--rollout.gpu_memory_utilization", "0.3"),
                         total_bytes=int(24 * GiB))


def test_share_base_needs_lora():
    with pytest.raises(ConfigError, match="model.lora_rank"):  # at parse time, before anything loads
        parse_config(["--model.share_base", "true"])
    assert parse_config(["--model.share_base", "true", "--model.lora_rank", "4"]).model.share_base


def test_memory_fractions_follow_the_cap():
    total = 140 * GiB
    capped = _recipe()  # 24 GiB cap, vLLM 0.85 of it
    assert vllm_memory_fraction(capped, total) == pytest.approx(0.85 * 24 / 140)
    assert trainer_memory_fraction(capped, total, "colocated") == pytest.approx(24 / 140)
    assert trainer_memory_fraction(capped, total, "disaggregated") == pytest.approx(24 / 140)
    assert trainer_memory_fraction(capped, total, "sidecar") == pytest.approx(max(0.05, 24 / 140 * 0.15 - 0.02))
    small = 16 * GiB  # a card smaller than the cap: the card is the limit
    assert vllm_memory_fraction(capped, small) == pytest.approx(0.85)
    assert trainer_memory_fraction(capped, small, "colocated") == pytest.approx(1.0)
    plain = parse_config(["--rollout.gpu_memory_utilization", "0.4"])  # no cap: as before
    assert vllm_memory_fraction(plain, total) == 0.4
    assert trainer_memory_fraction(plain, total, "colocated") is None
    assert trainer_memory_fraction(plain, total, "sidecar") == pytest.approx(1.0 - 0.4 - 0.02)
    assert check_memory_cap(plain) is None


LOW_MEMORY_PPO = ["--model.lora_rank", "16", "--model.lora_alpha", "32", "--model.share_base", "true",
                  "--rl.kl_coef", "0.01", "--optim.lr", "3e-3", "--optim.critic_lr", "1e-3"]


def test_share_base_critic_refuses_zero3_before_loading(monkeypatch):
    """A critic on the shared base needs ZeRO 0-2: build_parts refuses ZeRO-3 first, in one line naming the keys."""

    import transformers

    from ds_rlhf.recipes import rl_build

    def no_loading(*_, **__):
        raise AssertionError("a model started loading before the ZeRO stage was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(rl_build, "reward_functions", no_loading)
    lora = ("--model.lora_rank", "8", "--model.share_base", "true", "--rl.algo", "ppo")
    for args, names in ((lora + ("--zero_stage", "3"), "--zero_stage 3"),
                        (("--config", RECIPE, "--rl.algo", "ppo"), "ds_config=ds_configs/low_memory_24g.json")):
        with pytest.raises(ConfigError) as err:
            rl_build.build_parts(SimpleNamespace(cfg=parse_config(list(args)), dist=None))
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("model.share_base=true with a critic") and names in msg, msg
        assert "--zero_stage 2" in msg and "--model.share_base false" in msg
    rl_build.check_share_base_critic(parse_config([*lora, "--zero_stage", "2"]))  # ZeRO-2: fine
    rl_build.check_share_base_critic(parse_config(["--config", RECIPE]))  # GRPO (no critic) at ZeRO-3: fine


@pytest.mark.extended
@pytest.mark.slow
def test_ppo_learns_with_lora_and_shared_base(sft_run, addition_stores, vllm_colocated, tmp_path):
    """The tiny PPO task with the low-memory code path: LoRA actor, reference = the actor with its adapters off
    (KL in the loss), critic = LoRA adapters + value head on the actor's base. No reference engine and no second
    base are built; the base does not change; the reward rises as in test_rl_e2e."""
    import torch

    from ds_rlhf.engines.models import unwrap
    from ds_rlhf.engines.shared_base import AdapterOffReference
    from ds_rlhf.engines.shared_critic import actor_decoder, owned_parameters
    from ds_rlhf.recipes.rl import RLTrainer
    from tests.recipes.test_rl_e2e import _mean, rl_args

    trainer = RLTrainer(parse_config(rl_args(tmp_path, sft_run[0] / "export", addition_stores, "ppo", 14,
                                             LOW_MEMORY_PPO)), rollout=vllm_colocated)
    parts = trainer.parts
    assert isinstance(parts.reference, AdapterOffReference) and parts.reference.actor is parts.actor
    assert sum(p.numel() for p in parts.reference.parameters()) == 0
    base = {n: p for n, p in unwrap(parts.actor).named_parameters() if "lora_" not in n}
    own = owned_parameters(parts.critic.module, actor_decoder(parts.actor))
    assert own and all("lora_" in n or n.startswith("value_head.") for n, _ in own)
    base_ptrs = {p.data_ptr() for p in base.values()}
    own_ids = {id(p) for _, p in own}
    assert all(p.data_ptr() in base_ptrs for p in parts.critic.module.parameters() if id(p) not in own_ids)
    base_before = {n: p.detach().clone() for n, p in base.items()}
    history = trainer.train()
    rewards = [h["reward/mean"] for h in history]
    print("lora + share_base ppo rewards", [round(r, 3) for r in rewards])
    print("critic loss", [round(h["critic/loss"], 4) for h in history])
    assert _mean(rewards[-4:]) > _mean(rewards[:4]) + 0.1, rewards
    assert "critic/loss" in history[-1] and "actor/kl_loss" in history[-1]
    assert all(torch.equal(p.detach(), base_before[n]) for n, p in base.items())  # one frozen base, unchanged
    assert set(parts.engines_to_checkpoint()) == {"actor", "critic"}
    # step 1 trains from B = 0: the actor is its base, so the reference's KL starts at ~0 and grows as it learns
    assert abs(history[0]["kl/mean"]) < 1e-3 and history[-1]["kl/mean"] > history[0]["kl/mean"]
    # vLLM got the adapters merged in after every sync (never the adapter-disabled base): its log-probs are the actor's
    assert max(h["mismatch/kl_rollout_trainer"] for h in history) < 1e-3


def test_supervised_runs_apply_the_cap(tiny_model_path, tmp_path, monkeypatch, dist_single):
    """SFT and RM (one SupervisedTrainer): the allocator cap is applied when the run builds (a no-op on CPU, so
    the call is recorded)."""
    from ds_rlhf.data.synthetic import write_addition_datasets
    from ds_rlhf.memory import cap as memory_cap
    from ds_rlhf.recipes.sft import SFTTask
    from ds_rlhf.recipes.supervised import SupervisedTrainer

    calls = []
    monkeypatch.setattr(memory_cap, "apply_trainer_cap", lambda cfg, device, placement: calls.append(
        (cfg.run.max_gpu_memory_gb, str(device), placement)))
    stores = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=8, n_sft=32, n_pref=8,
                                     max_operand=20)
    SupervisedTrainer(parse_config(["--model.path", str(tiny_model_path), "--data.train", str(stores["sft"]),
                                    "--run.output_dir", str(tmp_path / "sft"), "--run.steps", "1",
                                    "--run.max_gpu_memory_gb", "24", "--run.progress", "false",
                                    "--run.tensorboard", "false"]), SFTTask())
    assert calls == [(24.0, "cpu", "colocated")]


def test_adapter_sync_keeps_vllm_on_the_actor_every_step(addition_stores, lora_rollout, tmp_path):
    """`rollout.lora_sync adapter` through the trainer (build_parts' wiring): every step's sync sends the LoRA
    adapters only, the canary passes, and vLLM's sampling log-probs are the trainer's (the KL between them ~ 0)
    while the adapters move the policy away from the base (a reward that varies on the random tiny model's text)."""
    from ds_rlhf.recipes.rl import RLTrainer

    cfg = parse_config(["--model.path", "tiny", "--data.train", str(addition_stores["prompts"]), "--run.output_dir",
                        str(tmp_path), "--run.steps", "3", "--rl.algo", "grpo", "--reward.fn",
                        f"{ROOT / 'bench' / 'bench_rewards.py'}:distinct_ratio", "--reward.workers", "0",
                        "--model.lora_rank", "8", "--model.lora_alpha", "16", "--rollout.lora_sync", "adapter",
                        "--rollout.sleep", "false", "--optim.lr", "1e-2", "--rl.prompts_per_step", "4",
                        "--rollout.n_samples", "4", "--rollout.max_new_tokens", "8", "--data.max_prompt_len", "64",
                        "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false"])
    trainer = RLTrainer(cfg, rollout=lora_rollout)
    reports, sync = [], trainer.parts.sync.sync

    def recorded(**kwargs):
        reports.append(sync(**kwargs))
        return reports[-1]

    trainer.parts.sync.sync = recorded
    history = trainer.train()
    assert len(history) == 3 and len(reports) >= 3
    for r in reports[-3:]:
        assert r["mode"] == "adapter" and 0 < r["adapter_bytes"] == r["bytes"] and not r["base_bytes"], r
        assert r["canary_max_abs_diff"] is not None and r["canary_max_abs_diff"] < 1e-3, r
    versions = [r["adapter_version"] for r in reports]
    assert versions == sorted(set(versions))  # a new adapter each sync, not vLLM's cached one
    for h in history:
        assert abs(h["mismatch/kl_rollout_trainer"]) < 1e-4, h["mismatch/kl_rollout_trainer"]
    lora_b = [p for n, p in trainer.parts.actor.module.named_parameters() if "lora_B" in n]
    assert lora_b and max(float(p.detach().abs().max()) for p in lora_b) > 0  # the adapters did move
