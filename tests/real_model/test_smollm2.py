"""The real pretrained model end to end on CPU: SmolLM2-135M-Instruct from its GGUF (`conftest.py`) through
`ds-rlhf convert-gguf`'s code, GSM8K prep with its chat template, a short GRPO run through vLLM with the `gsm8k` reward
(responses end at `<|im_end|>`, rollout and trainer log-probs agree, the exported checkpoint generates the trainer's
greedy tokens), and one SFT and one RM step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from real_model_kit import GSM8K_INSTRUCTION, hf_greedy

from ds_rlhf.config import parse_config
from ds_rlhf.data import open_store
from ds_rlhf.engines.gguf_import import REPORT_NAME, fix_special_tokens
from ds_rlhf.engines.model_source import resolve_model_source
from ds_rlhf.entrypoints.main import main as ds_rlhf
from ds_rlhf.telemetry.logger import read_metrics
from ds_rlhf.testing.multiproc import clean_env

HERE = Path(__file__).resolve().parent
QUESTIONS = ["What is the capital of France?", "What is 17 + 25?", "Name a primary colour."]
GREEDY_TOKENS = 24
IM_START, IM_END = 1, 2  # SmolLM2's ChatML ids
STEPS = 2


def chat_prompts(tok) -> list[list[int]]:
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         return_dict=False)) for q in QUESTIONS]


# ---- the converted directory ------------------------------------------------------------------------------------
def test_converted_directory_has_chatml_special_tokens(smollm2_path, smollm2_tokenizer):
    from transformers import AutoConfig, GenerationConfig

    report = json.loads((smollm2_path / REPORT_NAME).read_text())
    assert report["quantization"] == "Q4_1" and report["parameters"] == 134_515_008
    assert report["model_class"] == "LlamaForCausalLM" and report["dtype"] == "bf16"
    tok = smollm2_tokenizer
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", IM_END)
    assert tok.pad_token_id is not None and tok.pad_token != "<|im_start|>"
    assert GenerationConfig.from_pretrained(smollm2_path).eos_token_id in (IM_END, [IM_END])
    config = AutoConfig.from_pretrained(smollm2_path)
    assert getattr(config, "quantization_config", None) is None and config.eos_token_id == IM_END
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                   tokenize=False)
    assert "<|im_start|>assistant\nyo<|im_end|>" in text


def test_a_gguf_model_path_resolves_to_its_cached_conversion(smollm2_gguf, smollm2_path):
    """`--model.path FILE.gguf` (and every other model setting) reads the file's one cached conversion."""
    assert resolve_model_source(str(smollm2_gguf), "model.path") == str(smollm2_path)


def test_fix_up_corrects_an_eos_read_as_im_start(smollm2_path):
    """transformers 5.17 reads this GGUF's eos as <|im_start|>: the fix-up puts <|im_end|> back everywhere."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    config, gen = AutoConfig.from_pretrained(smollm2_path), GenerationConfig.from_pretrained(smollm2_path)
    tok.eos_token = tok.pad_token = "<|im_start|>"
    config.eos_token_id = gen.eos_token_id = config.pad_token_id = gen.pad_token_id = IM_START
    changes = fix_special_tokens(tok, config, gen)
    assert (tok.eos_token_id, gen.eos_token_id, config.eos_token_id) == (IM_END, IM_END, IM_END)
    assert (tok.pad_token_id, gen.pad_token_id, config.pad_token_id) == (IM_END, IM_END, IM_END)
    assert {c["field"] for c in changes} == {"tokenizer.eos_token", "generation_config.eos_token_id",
                                             "config.eos_token_id", "tokenizer.pad_token",
                                             "generation_config.pad_token_id", "config.pad_token_id"}
    assert fix_special_tokens(tok, config, gen) == []  # agreeing tokens are left alone


# ---- GSM8K prep with the model's chat template ----------------------------------------------------------------
def test_gsm8k_prompts_use_the_models_chat_template(smollm2_gsm8k_store, smollm2_tokenizer, gsm8k_rows):
    tok = smollm2_tokenizer
    store = open_store(smollm2_gsm8k_store, tok, "prompts")
    questions = [json.loads(line)["question"] for line in gsm8k_rows.read_text().splitlines()]
    assert len(store) >= 60
    for row in store.rows(list(range(0, len(store), 7))):
        question = questions[row["row_id"] - 1]
        expected = tok.apply_chat_template(
            [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}], add_generation_prompt=True,
            tokenize=False)
        assert tok.decode(row["input_ids"]) == expected
        assert list(row["input_ids"]) == tok(expected, add_special_tokens=False)["input_ids"]
        assert expected.startswith("<|im_start|>system\n") and expected.endswith("<|im_start|>assistant\n")


# ---- GRPO through vLLM ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grpo_run(smollm2_path, smollm2_gsm8k_store, smollm2_tokenizer, tmp_path_factory):
    """Two GRPO steps (2 prompts x 4 samples, 64 new tokens, gsm8k reward) in a fresh process with its own vLLM
    engine; returns (run dir, what grpo_worker.py recorded)."""
    from ds_rlhf.rollout.vllm_adapter import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not importable here")
    tmp = tmp_path_factory.mktemp("smollm2_grpo")
    run = tmp / "run"
    args = ["--model.path", str(smollm2_path), "--data.train", str(smollm2_gsm8k_store), "--run.output_dir", str(run),
            "--run.steps", str(STEPS), "--run.save_every", str(STEPS), "--rl.algo", "grpo", "--reward.fn", "gsm8k",
            "--rl.prompts_per_step", "2", "--rollout.n_samples", "4", "--rollout.max_new_tokens", "64",
            "--rollout.backend", "vllm", "--data.max_prompt_len", "320", "--optim.lr", "1e-5",
            "--optim.micro_batch_size", "8", "--run.progress", "false", "--run.tensorboard", "false",
            "--run.export_hf", "false"]
    out = tmp / "record.json"
    proc = subprocess.run([sys.executable, str(HERE / "grpo_worker.py"), json.dumps(args),
                           json.dumps(chat_prompts(smollm2_tokenizer)), str(GREEDY_TOKENS), str(out)],
                          env=clean_env(), capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0 and out.is_file(), (proc.stdout[-2000:], proc.stderr[-4000:])
    return run, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the module's GRPO run is set up by the first of them
def test_transformers_and_vllm_greedy_agree(grpo_run, smollm2_path, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    _, record = grpo_run
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    expected = hf_greedy(model, chat_prompts(smollm2_tokenizer), IM_END, GREEDY_TOKENS)
    print("greedy:", [smollm2_tokenizer.decode(t) for t in expected])
    assert record["vllm_greedy"] == expected
    assert any(t[-1] == IM_END for t in expected)  # a chat model that ends its turns
    assert "Paris" in smollm2_tokenizer.decode(expected[0])  # real pretrained weights, not noise


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the module's GRPO run is set up by the first of them
def test_grpo_responses_end_at_im_end(grpo_run):
    _, record = grpo_run
    assert record["stop_token_ids"] == [[IM_END]] * STEPS
    samples = [s for step in record["samples"] for s in step]
    assert len(samples) == STEPS * 8
    stopped = [s for s in samples if s["finish_reason"] == "stop"]
    assert stopped, "no response ended within 64 tokens"
    for s in stopped:
        assert s["response_ids"][-1] == IM_END and IM_START not in s["response_ids"], s
    for s in samples:
        if s["finish_reason"] == "length":
            assert len(s["response_ids"]) == 64 and IM_END not in s["response_ids"], s
    # the loss trains every response token, the final <|im_end|> (the pad id too) included
    for traj in record["trajectories"]:
        assert traj["trained_tokens"] == traj["response_lens"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the module's GRPO run is set up by the first of them
def test_grpo_step1_rollout_and_trainer_logprobs_agree(grpo_run):
    run, _ = grpo_run
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    first = metrics[0]
    print("step 1 mismatch:", {k: v for k, v in first.items() if k.startswith("mismatch/")})
    assert first["mismatch/kl_rollout_trainer"] <= 1e-3
    assert first["mismatch/abs_logp_diff_mean"] <= 1e-3
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in metrics)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the module's GRPO run is set up by the first of them
def test_grpo_export_generates_the_trainers_greedy_tokens(grpo_run, smollm2_path, smollm2_tokenizer, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, record = grpo_run
    out = tmp_path / "hf"
    assert ds_rlhf(["export", str(run / "checkpoints" / f"step_{STEPS:08d}"), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert hf_greedy(model, chat_prompts(smollm2_tokenizer), IM_END, GREEDY_TOKENS) == record["trainer_greedy"]
    base = load_file(smollm2_path / "model.safetensors")
    exported = model.state_dict()
    changed = any(not torch.equal(exported[k], v.float()) for k, v in base.items())
    # GRPO moves the weights exactly when some group's rewards differ (else every advantage is 0): the export holds
    # the trained weights, not the base's, whenever there was something to learn
    signal = any(m["reward/frac_zero_std"] < 1.0 for m in read_metrics(run))
    assert changed == signal, (changed, signal)


# ---- SFT and RM -------------------------------------------------------------------------------------------------
def _supervised(task, argv):
    from ds_rlhf.recipes.supervised import SupervisedTrainer

    return SupervisedTrainer(parse_config(argv), task).train()


@pytest.mark.slow
def test_sft_one_step(smollm2_path, gsm8k_rows, tmp_path, dist_single):
    from ds_rlhf.recipes.sft import SFTTask

    store = tmp_path / "sft"
    assert ds_rlhf(["prep-sft", "--tokenizer", str(smollm2_path), "--input", str(gsm8k_rows), "--output", str(store),
                    "--prompt_key", "question", "--response_key", "answer", "--max_len", "512", "--quiet"]) == 0
    run = tmp_path / "run"
    _supervised(SFTTask(), ["--model.path", str(smollm2_path), "--data.train", str(store), "--data.eval_fraction",
                            "0", "--run.output_dir", str(run), "--run.steps", "1", "--optim.batch_size", "4",
                            "--optim.micro_batch_size", "4", "--optim.lr", "1e-5", "--run.progress", "false",
                            "--run.tensorboard", "false", "--run.export_hf", "false"])
    losses = [m["train/loss"] for m in read_metrics(run) if "train/loss" in m]
    print("sft loss:", losses)
    # a pretrained chat model on worked GSM8K answers: far below a uniform guess (ln 49152 = 10.8 nats)
    assert len(losses) == 1 and 0.1 < losses[0] < 3.0


@pytest.mark.slow
def test_rm_one_step(smollm2_path, hh_rows, tmp_path, dist_single):
    from ds_rlhf.recipes.rm import RewardModelTask

    store = tmp_path / "pref"
    assert ds_rlhf(["prep-preferences", "--tokenizer", str(smollm2_path), "--input", str(hh_rows), "--output",
                    str(store), "--max_len", "384", "--quiet"]) == 0
    run = tmp_path / "run"
    _supervised(RewardModelTask(), ["--model.path", str(smollm2_path), "--data.train", str(store),
                                    "--data.eval_fraction", "0", "--run.output_dir", str(run), "--run.steps", "1",
                                    "--data.max_len", "384", "--optim.batch_size", "4",
                                    "--optim.micro_batch_size", "4", "--optim.lr", "1e-5", "--run.progress", "false",
                                    "--run.tensorboard", "false", "--run.export_hf", "false"])
    metrics = [m for m in read_metrics(run) if "train/loss" in m]
    print("rm:", metrics)
    assert len(metrics) == 1 and 0.0 < metrics[0]["train/loss"] < 5.0
