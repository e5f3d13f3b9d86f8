"""On-policy distillation with the generalized Jensen-Shannon divergence (`rl.distill_loss jsd`): the loss through
our wrapper of DeepSpeed's `generalized_jsd_loss`, the student's response logits, the end-to-end run, and the
config rules."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from ds_rlhf.algos.distill import generalized_jsd
from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.engines.policy_forward import response_logits
from ds_rlhf.recipes.rl import RLTrainer

STUDENT = [[2.0, 0.5, -1.0], [0.0, 1.0, 0.3]]
TEACHER = [[0.1, 1.5, -0.5], [1.2, -0.4, 0.0]]


def _softmax(row):
    z = [math.exp(x) for x in row]
    return [x / sum(z) for x in z]


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def _by_hand(beta):
    """Token mean of beta KL(t || m) + (1 - beta) KL(s || m), m = beta t + (1 - beta) s; the KLs at beta 0 / 1."""
    out = []
    for s_row, t_row in zip(STUDENT, TEACHER, strict=True):
        s, t = _softmax(s_row), _softmax(t_row)
        if beta == 0:
            out.append(_kl(t, s))
        elif beta == 1:
            out.append(_kl(s, t))
        else:
            m = [beta * b + (1 - beta) * a for a, b in zip(s, t, strict=True)]
            out.append(beta * _kl(t, m) + (1 - beta) * _kl(s, m))
    return sum(out) / len(out)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_generalized_jsd_matches_the_formula(beta):
    got = generalized_jsd(torch.tensor(STUDENT), torch.tensor(TEACHER), beta=beta)
    assert got.item() == pytest.approx(_by_hand(beta), abs=1e-6)


def test_beta_one_is_the_exact_reverse_kl_and_temperature_divides_both():
    s, t = torch.tensor(STUDENT), torch.tensor(TEACHER)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    reverse = (ls.exp() * (ls - lt)).sum(-1).mean()
    assert generalized_jsd(s, t, beta=1.0).item() == pytest.approx(reverse.item(), abs=1e-6)
    assert generalized_jsd(s, t, beta=0.3, temperature=2.0).item() == pytest.approx(
        generalized_jsd(s / 2, t / 2, beta=0.3).item(), abs=1e-6)


def test_response_logits_are_the_full_forwards_rows(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, 7:] = 0
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 3:8], mask[1, 2:6] = True, True
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        rows = response_logits(model, ids, None, mask, attention_mask=attention)
    assert rows.shape == (9, model.config.vocab_size)
    torch.testing.assert_close(rows, full[mask], atol=1e-5, rtol=0)
    nothing = response_logits(model, ids, None, torch.zeros_like(mask), attention_mask=attention)
    assert nothing.shape == (0, model.config.vocab_size)


def test_the_jsd_to_the_teacher_falls(tiny_model_path, sft_run, addition_stores, dist_single, tmp_path):
    teacher = sft_run[0] / "export"
    history = RLTrainer(parse_config([
        "--model.path", str(tiny_model_path), "--data.train", str(addition_stores["prompts"]),
        "--rl.teacher", str(teacher), "--rl.distill_loss", "jsd", "--rl.algo", "reinforce_pp",
        "--run.output_dir", str(tmp_path / "run"), "--run.steps", "12",
        "--rl.prompts_per_step", "8", "--rollout.n_samples", "2", "--rollout.max_new_tokens", "8",
        "--optim.lr", "3e-3", "--rollout.backend", "hf", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.export_hf", "false"])).train()
    jsd = [h["distill/jsd"] for h in history]
    print("generalized JSD to the teacher by step", [round(j, 4) for j in jsd])
    assert all(h["reward/mean"] == 0.0 for h in history)  # no reward, no KL coefficient: the JSD alone teaches
    assert sum(jsd[-4:]) / 4 < sum(jsd[:4]) / 4, jsd


def test_the_jsd_loss_needs_a_teacher():
    with pytest.raises(ConfigError, match="rl.distill_loss=jsd distils into a teacher's distributions: set "
                                          "--rl.teacher"):
        parse_config(["--rl.distill_loss", "jsd"])


def test_jsd_settings_need_the_jsd_loss():
    with pytest.raises(ConfigError, match="rl.jsd_beta=0.2 is a setting of the JSD distillation loss"):
        parse_config(["--rl.jsd_beta", "0.2"])
    with pytest.raises(ConfigError, match="rl.distill_coef=2 is a setting of the JSD distillation loss"):
        parse_config(["--rl.teacher", "t", "--rl.kl_coef", "1", "--rl.distill_coef", "2"])
    assert parse_config(["--rl.teacher", "t", "--rl.distill_loss", "jsd"]).rl.kl_coef == 0  # the JSD alone is enough
