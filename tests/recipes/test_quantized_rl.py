"""`model.quantize_base` wired through the builders: an SFT run and a PPO run on the tiny model with an
nf4 base, LoRA, `model.share_base` (reference = adapters off, critic = adapters + value head on the same packed
base). The HF generate backend keeps it in-process and cheap; the vLLM sync of a quantized base is tested in
tests/engines/test_quantized_base.py."""

from __future__ import annotations

import math

import pytest
import torch

from ds_rlhf.config import ConfigError, parse_config

COMMON = ["--model.path", "tiny", "--model.lora_rank", "8", "--model.quantize_base", "nf4", "--zero_stage", "2",
          "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false"]


@pytest.fixture(scope="module")
def small_stores(tiny_model_path, tmp_path_factory):
    from ds_rlhf.data.synthetic import write_addition_datasets

    return write_addition_datasets(tmp_path_factory.mktemp("quant_rl_data"), tiny_model_path, n_prompts=32, n_sft=32,
                                   n_pref=8, max_operand=20)


def _packed(module) -> int:
    return sum(1 for p in module.parameters() if p.dtype in (torch.uint8, torch.int8))


def test_ppo_with_an_nf4_shared_base(small_stores, dist_single, tmp_path):
    from ds_rlhf.engines.models import unwrap
    from ds_rlhf.recipes.rl import RLTrainer

    cfg = parse_config([*COMMON, "--data.train", str(small_stores["prompts"]), "--run.output_dir", str(tmp_path),
                        "--run.steps", "2", "--rl.algo", "ppo", "--reward.fn", "math_shaped", "--model.share_base",
                        "true", "--rl.kl_coef", "0.05", "--rl.prompts_per_step", "4", "--rollout.n_samples", "2",
                        "--rollout.max_new_tokens", "8", "--rollout.backend", "hf"])
    trainer = RLTrainer(cfg)
    actor, critic = unwrap(trainer.parts.actor), unwrap(trainer.parts.critic)
    assert _packed(actor) > 0  # the base really is stored packed
    packed = {p.data_ptr() for p in actor.parameters() if p.dtype == torch.uint8}
    assert packed <= {p.data_ptr() for p in critic.parameters()}  # the critic reads the same packed tensors
    before = {n: p.detach().clone() for n, p in actor.named_parameters() if p.dtype == torch.uint8}
    history = trainer.train()
    assert len(history) == 2
    for h in history:
        assert all(math.isfinite(v) for k, v in h.items() if isinstance(v, float)), h
    assert any(k.startswith("critic/") for k in history[-1]), sorted(history[-1])  # the critic trained too
    after = dict(actor.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in before.items())  # the frozen base never moved


def test_sft_with_an_nf4_base_and_the_zero3_refusal(small_stores, dist_single, tmp_path):
    from ds_rlhf.recipes.sft import SFTTask
    from ds_rlhf.recipes.supervised import SupervisedTrainer

    args = [*COMMON, "--data.train", str(small_stores["sft"]), "--run.output_dir", str(tmp_path), "--run.steps", "2",
            "--optim.batch_size", "8", "--optim.micro_batch_size", "8", "--optim.lr", "1e-2"]
    trainer = SupervisedTrainer(parse_config(args), SFTTask())
    assert _packed(trainer.engine.module) > 0
    trainer.train()
    with pytest.raises(ConfigError, match="quantize_base"):
        parse_config([*args, "--zero_stage", "3"])
