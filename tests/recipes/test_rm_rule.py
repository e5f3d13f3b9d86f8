"""A reward model reads its score at one token in every use (engines/rm_scoring.py): RM training, RM evaluation,
RL scoring and the exported model in plain transformers score the same conversation the same; an RM run's fresh
score head prefers neither side of a pair."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.engines.hf_export import write_export
from ds_rlhf.engines.models import RewardModel
from ds_rlhf.engines.rm_scoring import REWARD_INFO, ScoreRule, score_ids, score_rule, score_text
from ds_rlhf.recipes.reward_stage import RewardStage
from ds_rlhf.recipes.rm import RewardModelTask
from ds_rlhf.recipes.trajectory import RolloutBatch
from ds_rlhf.rollout.base import RolloutSample

MESSAGES = [{"role": "user", "content": "what is the sum of 12 plus 7"},
            {"role": "assistant", "content": "the sum is 19 and the answer is 19"}]
OTHER = [{"role": "user", "content": "please compute 3 plus 4 and show the step"},
         {"role": "assistant", "content": "sure here is the result of the step 3 plus 4 equals 7 thanks"}]


def _tokenizer(tiny_tokenizer, kind: str):
    """The tiny ChatML tokenizer as is (pad <|pad|>); padding with its end-of-turn token as SmolLM2-Instruct's
    does; or a base model's tokenizer: no chat template, pad = eos = <|endoftext|>."""
    tok = copy.deepcopy(tiny_tokenizer)
    if kind == "pad_is_end_of_turn":
        tok.pad_token = "<|im_end|>"
    elif kind == "no_template":
        tok.chat_template = None
        tok.eos_token = tok.pad_token = "<|endoftext|>"
    return tok


@pytest.fixture(scope="module")
def reward_model(tiny_reward_path):
    torch.manual_seed(0)
    rm = RewardModel.from_pretrained(tiny_reward_path, dtype="fp32", attn_impl="eager").eval()
    with torch.no_grad():  # a score head that reads the token it is given (the tiny one is near zero)
        rm.model.score.weight.normal_(0.0, 1.0)
    return rm


def _ctx(tokenizer):
    cfg = parse_config(["--optim.micro_batch_size", "4"])
    return SimpleNamespace(cfg=cfg, tokenizer=tokenizer, dist=SimpleNamespace(rank=0, world_size=1,
                                                                              device=torch.device("cpu")))


def _encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _conversation(tok, messages):
    """(text of the whole conversation as a preference pair stores it, prompt ids, response ids): rendered by the
    chat template, or without one `prompt + response` followed by the EOS."""
    if tok.chat_template:
        prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        return tok.apply_chat_template(messages, tokenize=False), _encode(tok, prompt), \
            _encode(tok, messages[1]["content"])
    prompt, response = f"Question: {messages[0]['content']}\nAnswer:", " " + messages[1]["content"]
    return prompt + response + tok.eos_token, _encode(tok, prompt), _encode(tok, response)


def test_rule_ends_every_form_of_a_conversation_at_the_end_of_turn_token(tiny_tokenizer):
    tok = _tokenizer(tiny_tokenizer, "pad_is_end_of_turn")
    rule = score_rule(tok)
    im_end, newline = tok.convert_tokens_to_ids("<|im_end|>"), _encode(tok, "\n")
    assert rule.score_id == im_end and rule.tail == tuple(newline)
    text, prompt, response = _conversation(tok, MESSAGES)
    rendered = _encode(tok, text)
    assert rendered[-2:] == [im_end, *newline]  # ChatML renders a newline after the turn
    expected = rendered[:-1]
    assert prompt + response + [im_end] == expected
    assert score_ids(rendered, rule) == expected  # a preference pair: the template's tail removed
    assert score_ids(prompt + response + [im_end], rule) == expected  # a rollout stopped at end-of-turn
    assert score_ids(prompt + response, rule) == expected  # a truncated rollout: end-of-turn appended
    assert score_ids(prompt + response + newline, rule) == prompt + response + newline + [im_end]  # text's own \n
    other_stop = tok.convert_tokens_to_ids("<|endoftext|>")
    eos_apart = ScoreRule(im_end, rule.tail, frozenset({other_stop}))  # an EOS that is not the end-of-turn
    assert score_ids(prompt + response + [other_stop], eos_apart) == expected
    assert score_ids(expected, rule) == expected


def test_without_a_chat_template_the_eos_is_the_score_token(tiny_tokenizer):
    tok = _tokenizer(tiny_tokenizer, "no_template")
    rule = score_rule(tok)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert rule == ScoreRule(eos, (), frozenset())  # pad == eos: nothing else is removed
    text, prompt, response = _conversation(tok, MESSAGES)
    assert score_ids(prompt + response, rule) == prompt + response + [eos] == score_text(text, tok)
    tok.eos_token = None
    with pytest.raises(ConfigError, match="neither a chat template with an end-of-turn token nor an EOS"):
        score_rule(tok)


@pytest.mark.parametrize("kind", ["chatml", "pad_is_end_of_turn", "no_template"])
def test_same_conversation_scores_the_same_in_rm_training_evaluation_rl_and_plain_transformers(
        tiny_tokenizer, reward_model, tmp_path, kind):
    tok, rm = _tokenizer(tiny_tokenizer, kind), reward_model
    score_id = score_rule(tok).score_id
    (text, prompt, response), (other, other_prompt, other_response) = (_conversation(tok, m) for m in (MESSAGES,
                                                                                                       OTHER))
    chosen, rejected = _encode(tok, text), _encode(tok, other)  # as data prep stores a preference pair
    task, ctx = RewardModelTask(), _ctx(tok)
    with torch.no_grad():
        margin = float(task.loss_terms(rm, ctx, [{"chosen_ids": chosen, "rejected_ids": rejected}])[1]["train/margin"])
        evaluated = task.evaluate(rm, ctx, [{"chosen_ids": chosen, "rejected_ids": rejected}])

    samples = [RolloutSample(0, 0, prompt, response + [score_id], [0.0] * (len(response) + 1), "stop"),
               RolloutSample(0, 1, prompt, response, [0.0] * len(response), "length"),
               RolloutSample(0, 2, other_prompt, other_response, [0.0] * len(other_response), "length")]
    scored = RewardStage(_ctx(tok), model=rm)(RolloutBatch(rows=[{"row_id": 0}], samples=samples,
                                                             weights_version=0), step=0)
    at_stop, truncated, rl_other = scored.raw_scores

    write_export(rm, rm.state_dict(), tok, tmp_path)
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    info = json.loads((tmp_path / REWARD_INFO).read_text())
    assert (info["score_token_id"], info["score_token"]) == (score_id, tok.convert_ids_to_tokens(score_id))
    assert hf_tok.pad_token_id != score_id and hf.config.pad_token_id == hf_tok.pad_token_id == info["pad_token_id"]
    batch = hf_tok.pad({"input_ids": [score_text(text, hf_tok), score_text(other, hf_tok)]}, return_tensors="pt")
    assert batch["input_ids"].shape[1] > len(score_text(text, hf_tok))  # the conversation is padded
    with torch.no_grad():
        hf_score, hf_other = hf(**batch).logits.squeeze(-1).tolist()

    assert margin == pytest.approx(at_stop - rl_other, abs=1e-4)
    assert evaluated["eval/loss"] == pytest.approx(-math.log(1 / (1 + math.exp(-(at_stop - rl_other)))), abs=1e-4)
    assert truncated == pytest.approx(at_stop, abs=1e-5)
    assert hf_score == pytest.approx(at_stop, abs=1e-4) and hf_other == pytest.approx(rl_other, abs=1e-4)
    with torch.no_grad():  # the position matters: the score one token earlier or later is another number
        plain = chosen if tok.chat_template else chosen[:-1]  # the template's trailing newline; the text before EOS
        ids = torch.tensor([plain])
        elsewhere = float(rm(input_ids=ids, attention_mask=torch.ones_like(ids)))
    assert abs(elsewhere - at_stop) > 1e-3


def test_fresh_score_head_prefers_neither_side(tiny_model_path, tiny_tokenizer):
    """An RM run starts from a causal LM with a new head at zero: every pair ties, accuracy 0.5, loss log 2."""
    rm = RewardModel.from_pretrained(tiny_model_path, dtype="fp32", attn_impl="eager", new_head=True).eval()
    pairs = [{"chosen_ids": _encode(tiny_tokenizer, _conversation(tiny_tokenizer, a)[0]),
              "rejected_ids": _encode(tiny_tokenizer, _conversation(tiny_tokenizer, b)[0])}
             for a, b in ((MESSAGES, OTHER), (OTHER, MESSAGES))]
    with torch.no_grad():
        evaluated = RewardModelTask().evaluate(rm, _ctx(tiny_tokenizer), pairs)
    assert evaluated == pytest.approx({"eval/accuracy": 0.5, "eval/loss": math.log(2)})
