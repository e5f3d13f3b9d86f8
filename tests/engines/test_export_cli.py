"""`ds-rlhf export`: a mid-run DeepSpeed checkpoint of a real (tiny, CPU) SFT run -> a Hugging Face directory that
transformers and vLLM load and that generates exactly the trainer's greedy tokens; ZeRO 0 / 2 / 3, LoRA merged and
as an adapter; and the RL loop's periodic export (`run.export_every`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.config import parse_config
from ds_rlhf.entrypoints.main import main as ds_rlhf

QUESTIONS = ["What is 3 + 4?", "What is 12 + 7?", "What is 20 + 19?"]
NEW_TOKENS = 12
STAGE0 = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9}
VLLM_GREEDY = r'''
import json, sys
from ds_rlhf.distributed import ensure_distributed
ensure_distributed()
from transformers import AutoTokenizer
from ds_rlhf.rollout import SamplingSpec, make_rollout_engine
path, prompts = sys.argv[1], json.loads(sys.argv[2])
tok = AutoTokenizer.from_pretrained(path)
engine = make_rollout_engine("vllm", "colocated", model_path=path, dtype="auto", max_model_len=256, seed=0)
spec = SamplingSpec(max_new_tokens=int(sys.argv[3]), temperature=0.0, stop_token_ids=(tok.eos_token_id,))
print("GREEDY", json.dumps([s.response_ids for s in engine.generate(prompts, spec)]))
engine.close()
'''


@pytest.fixture(scope="module")
def sft_store(tiny_model_path, tmp_path_factory):
    from ds_rlhf.data.synthetic import write_addition_datasets

    out = tmp_path_factory.mktemp("export_data")
    return write_addition_datasets(out, tiny_model_path, n_prompts=16, n_sft=256, n_pref=16, seed=0,
                                   max_operand=20)["sft"]


def prompts_of(tokenizer) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               return_dict=False)) for q in QUESTIONS]


@torch.no_grad()
def greedy(model, prompts: list[list[int]], eos: int) -> list[list[int]]:
    """Greedy response ids per prompt, up to and including the first EOS."""
    model.eval()
    out = []
    for prompt in prompts:
        ids = model.generate(input_ids=torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                             use_cache=True)
        out.append(ids[0, len(prompt):].tolist())
    return out


def assert_varied(tokens: list[list[int]]) -> None:
    """Greedy continuations that can tell weights apart (not one token repeated, as the untrained tiny model does)."""
    assert len({t for row in tokens for t in row}) >= 3, tokens


def _plain_model(model_path, state: dict):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    return model


def train_sft(tmp_path, model_path, store, *extra, steps: int = 40, every: int = 20, lr: str = "3e-3"):
    """An SFT run of `steps` optimizer steps with a checkpoint after each; returns (run dir, what the trainer's model
    was at each save: gathered state dict (LoRA folded in: `merged`) and greedy tokens). The tiny model's random
    initialisation repeats one token greedily; a few dozen steps make its continuations varied (a real check)."""
    from ds_rlhf.engines.hf_export import gather_state_dict
    from ds_rlhf.engines.models import merge_lora_state_dict, unwrap
    from ds_rlhf.recipes.sft import SFTTask
    from ds_rlhf.recipes.supervised import SupervisedTrainer

    run = tmp_path / "run"
    cfg = parse_config(["--model.path", str(model_path), "--data.train", str(store), "--data.eval_fraction", "0",
                        "--run.output_dir", str(run), "--run.steps", str(steps), "--run.save_every", str(every),
                        "--run.keep_last", "0", "--optim.lr", lr, "--optim.batch_size", "8",
                        "--optim.micro_batch_size", "8", "--run.progress", "false", "--run.tensorboard", "false",
                        "--run.export_hf", "false", *extra])
    trainer = SupervisedTrainer(cfg, SFTTask())
    tok = trainer.ctx.tokenizer
    prompts, saved = prompts_of(tok), {}
    original = trainer.ckpt.save

    def save(step, engines, state):
        path = original(step, engines, state)
        engine = engines["sft"]
        weights = gather_state_dict(engine.module)
        if engine.zero_optimization_stage() == 3:  # parameters are partitioned: generate from the gathered copy
            tokens = greedy(_plain_model(model_path, merge_lora_state_dict(dict(weights), engine.module)), prompts,
                            tok.eos_token_id)
        else:  # the trainer's own module (a PeftModel for LoRA runs)
            tokens = greedy(unwrap(engine), prompts, tok.eos_token_id)
            engine.module.train()
        saved[step] = {"path": path, "state": weights, "greedy": tokens,
                       "merged": merge_lora_state_dict(dict(weights), engine.module)}
        return path

    trainer.ckpt.save = save
    trainer.train()
    assert sorted(saved) == list(range(every, steps + 1, every))
    return run, saved, tok


def _export(ckpt, out, *args) -> None:
    assert ds_rlhf(["export", str(ckpt), str(out), *args]) == 0


def _check_export_dir(out: Path, tok, prompts, expected, *, step: int, lora="none"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "generation_config.json",
            "ds_config.resolved.json", "ds_rlhf_export.json"} <= names, names
    assert not list(out.parent.glob(f".tmp_{out.name}_*"))
    info = json.loads((out / "ds_rlhf_export.json").read_text())
    assert info["checkpoint"].startswith("verified") and info["lora"] == lora and info["step"] == step
    loaded_tok = AutoTokenizer.from_pretrained(out)
    assert loaded_tok.chat_template and prompts_of(loaded_tok) == prompts  # the chat template travels
    model = AutoModelForCausalLM.from_pretrained(out)
    assert greedy(model, prompts, tok.eos_token_id) == expected
    return model


@pytest.fixture(scope="module")
def zero2_run(tiny_model_path, sft_store, tmp_path_factory, dist_single):
    return train_sft(tmp_path_factory.mktemp("zero2"), tiny_model_path, sft_store, steps=80, every=40)


def test_export_mid_run_checkpoint_generates_the_trainers_greedy_tokens(zero2_run, tmp_path):
    run, saved, tok = zero2_run
    mid = saved[40]
    assert any(not torch.equal(mid["state"][k], saved[80]["state"][k]) for k in mid["state"])  # it trained on
    assert mid["greedy"] != saved[80]["greedy"]
    assert_varied(mid["greedy"])
    out = tmp_path / "hf_mid"
    _export(mid["path"], out)
    model = _check_export_dir(out, tok, prompts_of(tok), mid["greedy"], step=40)
    exported = model.state_dict()
    for name, tensor in mid["state"].items():  # bit for bit the trainer's weights at that save (fp32 on CPU)
        assert torch.equal(exported[name], tensor), name
    # the engine directory, its tag directory and the run directory (its newest checkpoint) work too
    _export(mid["path"] / "sft", tmp_path / "from_engine_dir")
    _export(mid["path"] / "sft" / "state", tmp_path / "from_tag_dir")
    _export(run, tmp_path / "latest")
    assert json.loads((tmp_path / "latest" / "ds_rlhf_export.json").read_text())["step"] == 80
    _export(mid["path"], out, "--overwrite")  # re-exporting over an export (asked for) swaps it in whole
    assert (out / "model.safetensors").is_file() and not list(tmp_path.glob(".tmp_*"))


@pytest.mark.extended
def test_exported_checkpoint_loads_in_vllm_with_the_same_greedy_tokens(zero2_run, tmp_path):
    from ds_rlhf.testing.multiproc import clean_env

    run, saved, tok = zero2_run
    out = tmp_path / "hf_mid"
    _export(saved[40]["path"], out)
    prompts = prompts_of(tok)
    proc = subprocess.run([sys.executable, "-c", VLLM_GREEDY, str(out), json.dumps(prompts), str(NEW_TOKENS)],
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(li for li in proc.stdout.splitlines() if li.startswith("GREEDY "))
    assert json.loads(line.removeprefix("GREEDY ")) == saved[40]["greedy"]


@pytest.mark.parametrize("stage", [0, 3])
def test_export_other_zero_stages(stage, tiny_model_path, sft_store, tmp_path, dist_single):
    extra = ["--zero_stage", "3"]
    if stage == 0:
        ds = tmp_path / "stage0.json"
        ds.write_text(json.dumps(STAGE0))
        extra = ["--ds_config", str(ds)]
    _, saved, tok = train_sft(tmp_path, tiny_model_path, sft_store, *extra)
    out = tmp_path / "hf"
    _export(saved[20]["path"], out)
    assert_varied(saved[20]["greedy"])
    model = _check_export_dir(out, tok, prompts_of(tok), saved[20]["greedy"], step=20)
    exported = model.state_dict()
    for name, tensor in saved[20]["state"].items():
        assert torch.equal(exported[name], tensor), name


def test_export_lora_merged_and_as_adapter(tiny_model_path, sft_store, tmp_path, dist_single):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, saved, tok = train_sft(tmp_path, tiny_model_path, sft_store, "--model.lora_rank", "8", "--model.lora_alpha",
                              "16", steps=80, every=40, lr="1e-2")
    mid = saved[40]
    prompts, expected = prompts_of(tok), mid["greedy"]
    assert_varied(expected)
    merged = tmp_path / "merged"
    _export(mid["path"], merged)  # --lora merge is the default
    exported = _check_export_dir(merged, tok, prompts, expected, step=40, lora="merge").state_dict()
    assert set(exported) >= set(mid["merged"]) and not any("lora" in k for k in exported)
    for name, tensor in mid["merged"].items():  # W + scaling * B @ A, as the trainer's own export folds it
        assert torch.allclose(exported[name], tensor, rtol=0, atol=1e-6), name
    adapter = tmp_path / "adapter"
    _export(mid["path"], adapter, "--lora", "adapter")
    names = {p.name for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= names, names
    assert "model.safetensors" not in names
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    assert greedy(PeftModel.from_pretrained(base, adapter), prompts, tok.eos_token_id) == expected


def test_export_refuses_what_it_cannot_do(zero2_run, tmp_path, capsys):
    run, saved, _ = zero2_run
    assert ds_rlhf(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert ds_rlhf(["export", str(saved[40]["path"]), str(tmp_path / "out"), "--lora", "adapter"]) == 2
    assert "--lora adapter needs a LoRA run" in capsys.readouterr().err
    assert ds_rlhf(["export", str(saved[40]["path"]), str(tmp_path / "out"), "--role", "actor"]) == 2
    assert "has no 'actor' engine" in capsys.readouterr().err
    # a corrupt file is caught by the checkpoint's manifest before anything is unpickled
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(saved[80]["path"].parent.parent, broken)
    states = next((broken / "checkpoints" / "step_00000080" / "sft" / "state").glob("*model_states.pt"))
    states.write_bytes(states.read_bytes()[:-10] + b"0123456789")
    assert ds_rlhf(["export", str(broken / "checkpoints" / "step_00000080"), str(tmp_path / "out")]) == 2
    assert "does not verify" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_every_writes_step_directories(zero2_run, tiny_model_path, tmp_path):
    """`run.export_every` (rl_export.export_if_due, called by the RL loop after each step): due steps only, each a
    loadable directory, swapped in atomically."""
    from transformers import AutoModelForCausalLM

    from ds_rlhf.engines.model_source import resolve_model_path
    from ds_rlhf.recipes.rl_export import export_if_due

    _, _, tok = zero2_run
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(str(tiny_model_path)), dtype=torch.float32)
    cfg = parse_config(["--run.export_every", "2"])
    ctx = SimpleNamespace(cfg=cfg, run_dir=tmp_path, tokenizer=tok, print=print)
    parts = SimpleNamespace(actor=model)
    assert export_if_due(ctx, parts, 1) is None and export_if_due(ctx, parts, 0) is None
    out = export_if_due(ctx, parts, 4)
    assert out == tmp_path / "export" / "step_00000004" and (out / "model.safetensors").is_file()
    assert (out / "tokenizer_config.json").is_file() and not list(out.parent.glob(".tmp_*"))
    assert torch.equal(AutoModelForCausalLM.from_pretrained(out).lm_head.weight, model.lm_head.weight)
    ctx.cfg = parse_config([])
    assert export_if_due(ctx, parts, 4) is None  # 0 = off


def test_every_export_writes_use_cache_true_and_leaves_the_trained_module_as_it_was(tiny_model_path, tmp_path):
    """The trainer turns the KV cache off for its forwards; an export (the run's own or `ds-rlhf export`) is for
    generation, so its config.json says use_cache: true, and the live module keeps its own setting."""
    from transformers import AutoModelForCausalLM

    from ds_rlhf.engines.hf_export import write_export

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.config.use_cache = False
    write_export(model, model.state_dict(), None, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False
