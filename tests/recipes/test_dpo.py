"""DPO: each loss variant against hand-computed values; DPO on the addition task's preference pairs raises the eval
margin and accuracy; the whole model at ZeRO-0, 1 and 3 with its frozen reference, LoRA + ZeRO-3, precomputed
reference log-probs, resume and the command line."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from ds_rlhf.algos.preference import log_ratios, preference_loss
from ds_rlhf.algos.registry import DPO_LOSSES
from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.distributed import clean_dist_env
from ds_rlhf.recipes.dpo import pair_spans, response_logps
from ds_rlhf.telemetry.logger import read_metrics

# a fixed table of pairs: policy and reference summed log-probs of chosen / rejected, response lengths
LOGP_C = [-4.0, -10.0, -3.0]
LOGP_R = [-6.0, -9.0, -3.0]
REF_C = [-5.0, -9.5, -2.0]
REF_R = [-5.5, -9.0, -4.0]
N_C = [4, 10, 2]
N_R = [2, 5, 3]


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _run(loss="sigmoid", *, beta=0.1, label_smoothing=0.0, margin=0.0, length_norm=False, reference=True):
    ratio_c, ratio_r = log_ratios(_t(LOGP_C), _t(LOGP_R), _t(REF_C) if reference else None,
                                  _t(REF_R) if reference else None, _t(N_C), _t(N_R), length_norm=length_norm)
    return preference_loss(loss, ratio_c, ratio_r, beta=beta, label_smoothing=label_smoothing, margin=margin)


def _hand_ratios(length_norm: bool, reference: bool) -> list[tuple[float, float]]:
    out = []
    for lc, lr, rc, rr, nc, nr in zip(LOGP_C, LOGP_R, REF_C, REF_R, N_C, N_R):
        c, r = (lc - rc, lr - rr) if reference else (lc, lr)
        out.append((c / nc, r / nr) if length_norm else (c, r))
    return out


def test_dpo_sigmoid_loss_and_rewards_equal_hand_computed_values():
    beta = 0.1
    got = _run(beta=beta)
    # pair 0: (−4 − −5) − (−6 − −5.5) = 1 + 0.5 = 1.5; pair 1: −0.5 − 0 = −0.5; pair 2: −1 − 1 = −2
    hs = [1.5, -0.5, -2.0]
    assert [c - r for c, r in _hand_ratios(False, True)] == hs
    expected = [-_log_sigmoid(beta * h) for h in hs]
    assert torch.allclose(got["loss"], _t(expected), atol=1e-12)
    assert torch.allclose(got["chosen"], _t([beta * 1.0, beta * -0.5, beta * -1.0]), atol=1e-12)
    assert torch.allclose(got["rejected"], _t([beta * -0.5, 0.0, beta * 1.0]), atol=1e-12)
    assert torch.allclose(got["margin"], _t([beta * h for h in hs]), atol=1e-12)
    assert got["correct"].tolist() == [1.0, 0.0, 0.0]


def test_cdpo_label_smoothing_equals_hand_computed_values():
    beta, eps = 0.5, 0.2
    got = _run(beta=beta, label_smoothing=eps)
    expected = [-(1 - eps) * _log_sigmoid(beta * (c - r)) - eps * _log_sigmoid(-beta * (c - r))
                for c, r in _hand_ratios(False, True)]
    assert torch.allclose(got["loss"], _t(expected), atol=1e-12)


def test_ipo_loss_equals_hand_computed_values():
    beta = 0.25  # 1 / (2 beta) = 2
    got = _run("ipo", beta=beta)
    assert torch.allclose(got["loss"], _t([(1.5 - 2) ** 2, (-0.5 - 2) ** 2, (-2.0 - 2) ** 2]), atol=1e-12)


def test_length_normalised_and_reference_free_simpo_equal_hand_computed_values():
    beta, gamma = 2.0, 0.5
    # length-normalised DPO: per-token average log-ratios
    ratios = _hand_ratios(True, True)
    assert ratios[0] == (1.0 / 4, -0.5 / 2)
    got = _run(beta=beta, length_norm=True)
    assert torch.allclose(got["loss"], _t([-_log_sigmoid(beta * (c - r)) for c, r in ratios]), atol=1e-12)
    # SimPO: no reference, average log-probs, target margin gamma: -log sigmoid(beta/|yc| lc - beta/|yr| lr - gamma)
    simpo = [-_log_sigmoid(beta * lc / nc - beta * lr / nr - gamma)
             for lc, lr, nc, nr in zip(LOGP_C, LOGP_R, N_C, N_R)]
    got = _run(beta=beta, margin=gamma, length_norm=True, reference=False)
    assert torch.allclose(got["loss"], _t(simpo), atol=1e-12)
    assert torch.allclose(got["chosen"], _t([beta * lc / nc for lc, nc in zip(LOGP_C, N_C)]), atol=1e-12)


def test_dpo_config_is_checked_at_parse_time():
    assert set(DPO_LOSSES.names()) >= {"sigmoid", "ipo"}
    cfg = parse_config(["--dpo.loss", "ipo", "--dpo.beta", "0.5"])
    assert cfg.dpo.loss == "ipo" and cfg.dpo.beta == 0.5
    for argv, says in [(["--dpo.loss", "ipo", "--dpo.label_smoothing", "0.1"], "dpo.loss=ipo takes no"),
                       (["--dpo.loss", "hinge"], "dpo.loss='hinge': choose one of"),
                       (["--dpo.beta", "0"], "dpo.beta=0.0: must be > 0"),
                       (["--dpo.reference", "false", "--dpo.precompute_ref", "true"], "dpo.precompute_ref=true")]:
        with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
            parse_config(argv)


def test_response_span_skips_the_prompt_and_the_template_tail():
    from ds_rlhf.recipes.dpo import pair_spans

    eot, tail = 9, (5,)
    rows = [{"chosen_ids": [1, 2, 3, 7, 8, 9, 5], "rejected_ids": [1, 2, 3, 6, 9, 5]}]
    (c, cs, ce), (r, rs, re) = pair_spans(rows, eot, tail)
    assert c[cs:ce] == [7, 8, 9] and r[rs:re] == [6, 9]


# ---- training runs ----------------------------------------------------------------------------------------------
def _argv(model, store, out, *extra):
    return ["--model.path", str(model), "--data.train", str(store), "--run.output_dir", str(out),
            "--run.progress", "false", "--run.tensorboard", "false", *extra]


def _train(argv):
    from ds_rlhf.recipes.dpo import DPOTask
    from ds_rlhf.recipes.supervised import SupervisedTrainer

    cfg = parse_config(argv)
    trainer = SupervisedTrainer(cfg, DPOTask(cfg.dpo))
    return trainer, trainer.train()


def test_dpo_raises_eval_margin_and_accuracy_on_the_preference_pairs(sft_run, addition_stores, tmp_path,
                                                                     dist_single):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "dpo"
    _, summary = _train(_argv(sft_run[0] / "export", addition_stores["preference"], out,
                              "--data.eval_fraction", "0.1", "--run.steps", "30", "--optim.lr", "1e-3",
                              "--optim.batch_size", "32", "--optim.micro_batch_size", "16", "--dpo.beta", "0.1"))
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["eval/rewards/margin"] == pytest.approx(0.0, abs=1e-6)  # the policy is its reference
    assert before["eval/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert after["eval/rewards/margin"] > 1.0
    assert before["eval/rewards/accuracy"] == 0.5  # every pair a tie
    assert after["eval/rewards/accuracy"] > 0.65
    assert after["eval/loss"] < 0.7 * before["eval/loss"]
    rows = [r for r in read_metrics(out) if "rewards/margin" in r]
    assert len(rows) == 30 and sum(r["rewards/margin"] for r in rows[-5:]) > sum(r["rewards/margin"] for r in rows[:5])
    AutoModelForCausalLM.from_pretrained(out / "export")  # the export is a causal LM (the RL entry point's start)


def test_precomputed_reference_matches_on_the_fly_and_resume_continues_the_same(tiny_model_path, addition_stores,
                                                                                tmp_path, dist_single):
    """Four steps with the reference run per micro-batch, with its log-probs precomputed, and two + two steps
    resumed from a checkpoint: the same step losses."""
    common = ("--data.eval_fraction", "0.05", "--optim.lr", "1e-3", "--optim.batch_size", "8",
              "--optim.micro_batch_size", "4", "--run.export_hf", "false")
    store = addition_stores["preference"]

    def losses(out):
        return [r["dpo/loss"] for r in read_metrics(out) if "dpo/loss" in r]

    _train(_argv(tiny_model_path, store, tmp_path / "fly", *common, "--run.steps", "4"))
    _train(_argv(tiny_model_path, store, tmp_path / "pre", *common, "--run.steps", "4", "--dpo.precompute_ref", "true"))
    assert losses(tmp_path / "fly")[0] == pytest.approx(math.log(2), abs=1e-5)
    assert losses(tmp_path / "fly")[-1] < losses(tmp_path / "fly")[0]
    assert losses(tmp_path / "pre") == pytest.approx(losses(tmp_path / "fly"), abs=1e-5)

    _train(_argv(tiny_model_path, store, tmp_path / "res", *common, "--run.steps", "2"))
    _train(_argv(tiny_model_path, store, tmp_path / "res", *common, "--run.steps", "4", "--run.resume", "latest"))
    assert losses(tmp_path / "res") == pytest.approx(losses(tmp_path / "fly"), abs=1e-5)


def test_dpo_lora_zero3_trains(tiny_model_path, addition_stores, tmp_path, dist_single):
    """LoRA (the reference is the base with the adapters off) under ZeRO-3: the first step's loss is log 2 (policy ==
    reference) and training moves the margin."""
    out = tmp_path / "lora"
    _train(_argv(tiny_model_path, addition_stores["preference"], out, "--zero_stage", "3", "--model.lora_rank", "8",
                 "--optim.lr", "1e-2", "--optim.batch_size", "8", "--optim.micro_batch_size", "4", "--run.steps",
                 "3", "--run.export_hf", "false", "--data.eval_fraction", "0.05"))
    rows = [r for r in read_metrics(out) if "dpo/loss" in r]
    assert rows[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[-1]["rewards/margin"] != 0.0


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_dpo_full_model_trains_at_each_zero_stage(stage, tiny_model_path, addition_stores, tmp_path, dist_single):
    """The whole model trained (no LoRA) at `--zero_stage` 0, 1 and 3, its reference a frozen copy (partitioned at
    ZeRO-3): both steps run with a finite loss, step 1's rewards are 0 (policy == reference), the exported policy's
    weights and response log-probs moved from the starting model's, and the reference's log-probs after training
    are still the starting model's."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / f"zero{stage}"
    trainer, _ = _train(_argv(tiny_model_path, addition_stores["preference"], out, "--zero_stage", str(stage),
                              "--optim.lr", "1e-2", "--optim.batch_size", "8", "--optim.micro_batch_size", "4",
                              "--run.steps", "2", "--data.eval_fraction", "0.05"))
    assert trainer.engine.zero_optimization_stage() == stage
    # a frozen copy has no optimizer state to shard: ZeRO-3 partitions its weights, below that it is whole
    assert trainer.task.reference.zero_optimization_stage() == (3 if stage == 3 else 0)
    rows = [r for r in read_metrics(out) if "dpo/loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["dpo/loss"]) for r in rows)
    assert rows[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["rewards/rejected"] == pytest.approx(0.0, abs=1e-6)

    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()
    trained = AutoModelForCausalLM.from_pretrained(out / "export", torch_dtype=torch.float32).eval()
    start = initial.state_dict()
    moved = max(float((p.float() - start[k].float()).abs().max()) for k, p in trained.state_dict().items())
    assert moved > 1e-3  # two Adam steps at lr 1e-2 move the weights by about 1e-2

    task, ctx = trainer.task, trainer.ctx
    pairs = trainer.eval_rows[:4]
    spans = pair_spans(pairs, *task.chat_tokens(ctx))
    with torch.no_grad():
        start_logps, _ = response_logps(initial, spans, torch.device("cpu"))
        trained_logps, _ = response_logps(trained, spans, torch.device("cpu"))
    ref_c, ref_r = task._reference_logps(ctx, pairs)
    ref = torch.stack([ref_c, ref_r], dim=1).flatten().float()
    assert torch.allclose(ref, start_logps.float(), atol=1e-4)
    assert float((trained_logps - start_logps).abs().max()) > 1e-2


def test_train_dpo_command_help_and_a_two_step_run(tiny_model_path, addition_stores, tmp_path):
    """Subprocesses with the environment of a fresh shell (no torch.distributed variables of this process)."""
    help_ = subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", "train-dpo", "--help"], capture_output=True,
                           text=True, timeout=300, env=clean_dist_env())
    assert help_.returncode == 0 and "--dpo.loss" in help_.stdout and "ipo: IPO" in help_.stdout
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, "launch/train_dpo.py",
                          *_argv(tiny_model_path, addition_stores["preference"], out, "--run.steps", "2",
                                 "--optim.batch_size", "4", "--optim.micro_batch_size", "4", "--dpo.loss", "ipo",
                                 "--dpo.beta", "0.5", "--data.eval_fraction", "0.05")],
                         capture_output=True, text=True, timeout=600, env=clean_dist_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert len([r for r in read_metrics(out) if "dpo/loss" in r]) == 2
    assert (out / "export" / "config.json").exists()
    bad = subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", "train-dpo", "--dpo.loss", "ipo",
                          "--dpo.margin", "1"], capture_output=True, text=True, timeout=300, env=clean_dist_env())
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "dpo.loss=ipo takes no" in bad.stderr


@pytest.mark.extended
def test_pipeline_runs_dpo_instead_of_rm_and_rl(tmp_path):
    """`ds-rlhf pipeline --dpo`: data -> SFT -> DPO, no reward model or RL run; the summary's margin and accuracy
    rise from the first DPO steps to the last."""
    import json

    out = tmp_path / "pipe"
    run = subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", "pipeline", "--dpo", "--preset", "tiny",
                          "--sft_steps", "60", "--dpo_steps", "20", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env=clean_dist_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "DPO   reward margin" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["margin_last"] > summary["margin_first"] + 0.5
    assert summary["accuracy_last"] > summary["accuracy_first"]
    assert summary["eval_margin"] > 0.5 and summary["eval_accuracy"] > 0.6
    assert (out / "dpo" / "export" / "config.json").exists()
    assert not (out / "rm").exists() and not (out / "rl").exists()
