"""On-policy distillation with the generalized Jensen-Shannon divergence (`rl.distill_loss jsd`): the loss through
our wrapper of DeepSpeed's `generalized_jsd_loss`, the student's response logits, the end-to-end run, and the
config rules."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ds_rlhf.algos.distill import generalized_jsd
from ds_rlhf.config import Config, ConfigError, help_text, parse_config
from ds_rlhf.engines.policy_forward import response_logits
from ds_rlhf.recipes.policy_update import actor_micro_step
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.recipes.trajectory import pad_trajectory
from ds_rlhf.rollout.base import RolloutSample
from ds_rlhf.run.preflight import check_jsd_memory

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


def test_the_micro_step_adds_distill_coef_times_the_jsd_gradient(tiny_model_path):
    """`actor_micro_step` with a teacher: with every advantage 0 (no policy-gradient term) the actor's gradient is
    exactly `distill_coef x share x` the gradient of the generalized JSD between the student's and the teacher's
    response logits at `rollout.temperature`, computed here on its own; `distill/jsd` is that JSD."""
    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    teacher = copy.deepcopy(student).eval()
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    student.backward = lambda loss, scale_wrt_gas=True: loss.backward()  # the DeepSpeedEngine call it makes
    cfg = Config()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=0.7), rl=dataclasses.replace(
        cfg.rl, teacher="teacher", distill_loss="jsd", jsd_beta=0.3, distill_coef=2.5))
    gen = torch.Generator().manual_seed(0)
    samples = [RolloutSample(prompt_index=i, sample_index=0,
                             prompt_ids=torch.randint(10, 400, (p,), generator=gen).tolist(),
                             response_ids=torch.randint(10, 400, (r,), generator=gen).tolist(),
                             logprobs=[-5.0] * r, finish_reason="stop") for i, (p, r) in enumerate([(3, 5), (6, 2)])]
    mb = pad_trajectory(samples, [0.0, 0.0], pad_id=0)
    mb = mb.replace(advantages=torch.zeros_like(mb.action_mask))
    metrics, _ = actor_micro_step(student, mb, cfg, kl_coef=0.0, share=0.4, teacher=teacher)
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    scored = mb.action_mask > 0
    with torch.no_grad():
        target = response_logits(teacher, mb.input_ids, None, scored, attention_mask=mb.attention_mask)
    jsd = generalized_jsd(response_logits(student, mb.input_ids, None, scored, attention_mask=mb.attention_mask),
                          target, beta=0.3, temperature=0.7)
    (2.5 * 0.4 * jsd).backward()
    assert float(metrics["distill/jsd"]) == pytest.approx(jsd.item(), rel=1e-5) and jsd.item() > 0
    assert got["model.embed_tokens.weight"].abs().sum() > 0
    for name, p in student.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-7, rtol=1e-4, msg=name)


# questions with an operand above the stores' `max_operand` (20): never among the run's training prompts
HELD_OUT = ("What is 23 + 7?", "What is 21 + 14?", "What is 9 + 26?", "What is 30 + 30?", "What is 27 + 2?",
            "What is 25 + 18?", "What is 4 + 22?", "What is 29 + 11?")


def _held_out_sequences(teacher, tokenizer, new_tokens=8):
    """Each held-out question in the chat template, continued by the teacher's greedy answer: (ids [1, L], the
    answer's scored positions [1, L-1])."""
    out = []
    for question in HELD_OUT:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            ids = teacher.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=tokenizer.pad_token_id)
        scored = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
        scored[0, prompt.shape[1] - 1:] = True
        out.append((ids, scored))
    return out


def _held_out_jsd(student_path, teacher, sequences) -> float:
    """Token-mean generalized JSD (beta 0.5) between `student_path`'s and the teacher's next-token distributions
    over the teacher's answers to the held-out questions."""
    student = AutoModelForCausalLM.from_pretrained(student_path).eval()
    rows_s, rows_t = [], []
    with torch.no_grad():
        for ids, scored in sequences:
            rows_s.append(response_logits(student, ids, None, scored))
            rows_t.append(response_logits(teacher, ids, None, scored))
    return generalized_jsd(torch.cat(rows_s), torch.cat(rows_t), beta=0.5).item()


def test_the_jsd_loss_moves_the_student_toward_the_teacher(tiny_model_path, sft_run, addition_stores, dist_single,
                                                           tmp_path):
    """The untrained tiny student distils the tiny SFT teacher for 24 steps, and a control run has the same seed,
    reward and settings but no distillation loss. The reward (the share of digits in the response) gives GRPO a
    signal of its own that also pulls toward the teacher's answers; `rl.distill_coef` 20 lets the JSD outweigh it.
    On held-out questions the JSD run must end much closer to the teacher than the control (a JSD whose gradient
    does not reach the student, or a teacher that is the student itself, ends where the control does), and its
    logged `distill/jsd` (on its own samples) must fall."""
    teacher_path = sft_run[0] / "export"
    reward = tmp_path / "digits.py"
    reward.write_text("def digits(prompt, response, ground_truth, metadata):\n"
                      "    return sum(c.isdigit() for c in response) / max(len(response), 1)\n")
    common = ["--model.path", str(tiny_model_path), "--data.train", str(addition_stores["prompts"]),
              "--rl.algo", "reinforce_pp", "--reward.fn", f"{reward}:digits", "--run.steps", "24",
              "--rl.prompts_per_step", "8", "--rollout.n_samples", "2", "--rollout.max_new_tokens", "8",
              "--optim.lr", "3e-3", "--rollout.backend", "hf", "--run.progress", "false", "--run.tensorboard", "false",
              "--run.seed", "0"]
    history = RLTrainer(parse_config([*common, "--rl.teacher", str(teacher_path), "--rl.distill_loss", "jsd",
                                      "--rl.distill_coef", "20", "--run.output_dir", str(tmp_path / "jsd")])).train()
    control = RLTrainer(parse_config([*common, "--run.output_dir", str(tmp_path / "control")])).train()
    assert all("distill/jsd" not in h for h in control) and control[-1]["reward/mean"] > control[0]["reward/mean"]

    teacher = AutoModelForCausalLM.from_pretrained(teacher_path).eval()
    sequences = _held_out_sequences(teacher, AutoTokenizer.from_pretrained(teacher_path))
    held_out = {name: _held_out_jsd(path, teacher, sequences) for name, path in (
        ("untrained", tiny_model_path), ("control", tmp_path / "control" / "export" / "actor"),
        ("jsd", tmp_path / "jsd" / "export" / "actor"))}
    jsd = [h["distill/jsd"] for h in history]
    print("held-out generalized JSD to the teacher:", {k: round(v, 4) for k, v in held_out.items()})
    print("distill/jsd by step", [round(j, 4) for j in jsd])
    assert held_out["jsd"] < 0.85 * held_out["control"], held_out
    assert sum(jsd[-4:]) / 4 < 0.9 * sum(jsd[:4]) / 4, jsd


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


def _jsd_config(tmp_path, vocab, *flags):
    student = tmp_path / "student"
    student.mkdir(exist_ok=True)
    (student / "config.json").write_text(f'{{"model_type": "llama", "vocab_size": {vocab}}}')
    return parse_config(["--model.path", str(student), "--rl.teacher", str(student), "--rl.distill_loss", "jsd",
                         "--rl.jsd_beta", "1", "--rollout.backend", "vllm", "--rollout.gpu_memory_utilization", "0.5",
                         *flags])


def test_a_jsd_micro_batch_too_big_for_the_gpu_is_refused_in_one_line(tmp_path):
    gpu = 140 * 2**30  # an H200
    # 49152 tokens x 49152 vocabulary x (2 bf16 logits + 8 fp32 tensors: 36 bytes) = 81 GiB > 0.8 x 70 GiB left by
    # vLLM (the user's 0.5 of the GPU); 56 GiB / 1.69 MiB per token = 33982 tokens, 33792 in steps of 1024 (the
    # share the work sizes: tests/memory/test_engine_budget_use.py)
    cfg = _jsd_config(tmp_path, 49152, "--data.micro_batch_tokens", "49152")
    with pytest.raises(ConfigError, match=r"data.micro_batch_tokens=49152 response tokens x a 49152-token vocabulary "
                       r"hold 81.0 GiB .* more than 80% of the 70.0 GiB vLLM leaves of this GPU: set "
                       r"--data.micro_batch_tokens 33792 or less"):
        check_jsd_memory(cfg, total_bytes=gpu)
    check_jsd_memory(_jsd_config(tmp_path, 49152, "--data.micro_batch_tokens", "33792"), total_bytes=gpu)
    check_jsd_memory(_jsd_config(tmp_path, 49152, "--data.micro_batch_tokens", "49152", "--rollout.placement",
                                 "disaggregated"), total_bytes=gpu)  # vLLM elsewhere: the whole GPU is the trainer's
    check_jsd_memory(_jsd_config(tmp_path, 49152, "--data.micro_batch_tokens", "49152",
                                 "--run.max_gpu_memory_gb", "48"), total_bytes=gpu)  # a cap sizes it itself
    with pytest.raises(ConfigError, match=r"optim.micro_batch_size x rollout.max_new_tokens = 64 x 1024"):
        check_jsd_memory(_jsd_config(tmp_path, 151936, "--optim.micro_batch_size", "64",
                                     "--rollout.max_new_tokens", "1024"), total_bytes=gpu)


def test_help_explains_the_distillation_settings():
    lines = {line.split()[0]: line for line in help_text().splitlines() if line.strip().startswith("--")}
    assert "# on-policy distillation: a teacher (dir or Hub id" in lines["--rl.teacher"]
    assert "`jsd` = DeepSpeed's generalized Jensen-Shannon" in lines["--rl.distill_loss"]
    assert "reward = reward.model_weight * RM score" in lines["--reward.model_weight"]
