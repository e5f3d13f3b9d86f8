"""Rewards users bring: `async def` functions are awaited (within reward.timeout), and TRL-style functions get
TRL's conversational form (message lists) for chat prompts; in-process and through the worker pool."""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from ds_rlhf.rewards import RewardSet, score_samples

CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2+3="}]

FUNCS = '''
import asyncio
import json


async def async_sample(prompt, response, ground_truth, metadata):
    await asyncio.sleep(0.01)
    return float(response.strip() == ground_truth)


async def async_trl(prompts, completions, ground_truth, **kwargs):
    await asyncio.sleep(0.01)
    return [float(c == t) for c, t in zip(completions, ground_truth)]


async def async_slow(prompt, response, ground_truth, metadata):
    await asyncio.sleep(float(response))
    return 1.0


async def async_raises(prompt, response, ground_truth, metadata):
    raise ValueError("no score for " + response)


async def async_own_timeout(prompt, response, ground_truth, metadata):
    raise TimeoutError("my API timed out")


def trl_chat(prompts, completions, **kwargs):
    """Scores what TRL would pass: the last user turn and the assistant message for chat prompts, strings else."""
    out = []
    for prompt, completion in zip(prompts, completions):
        if isinstance(prompt, list):
            assert all(set(m) == {"role", "content"} for m in prompt), prompt
            assert isinstance(completion, list) and len(completion) == 1, completion
            assert completion[0]["role"] == "assistant", completion
            question, answer = prompt[-1]["content"], completion[0]["content"]
            out.append(float(prompt[-1]["role"] == "user" and str(eval(question.rstrip("="))) == answer))
        else:
            assert isinstance(prompt, str) and isinstance(completion, str), (prompt, completion)
            out.append(0.5)
    return out
'''


@pytest.fixture
def funcs(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(textwrap.dedent(FUNCS))
    return str(path)


def _items(responses, truths=None, chat=False):
    truths = truths or [None] * len(responses)
    out = []
    for i, (r, t) in enumerate(zip(responses, truths)):
        item = {"prompt": "<|user|>2+3=<|assistant|>", "response": r, "ground_truth": t, "metadata": {}, "id": f"s{i}"}
        if chat:
            item["prompt_messages"] = [dict(m) for m in CHAT]
        out.append(item)
    return out


@pytest.mark.parametrize("workers", [0, 1])
def test_async_functions_are_awaited(funcs, workers):
    items = _items(["5", "4", " 5"], ["5", "5", "5"])
    with RewardSet.from_spec(f"{funcs}:async_sample,{funcs}:async_trl", "1,10", workers=workers,
                             timeout=20) as rewards:
        report = score_samples(rewards, items, "fail")
    assert rewards.styles == ["sample", "trl"]
    # per sample: strip == "5" for "5" and " 5"; TRL-style: exact "5" only
    assert report.components == {"async_sample": [1.0, 0.0, 1.0], "async_trl": [1.0, 0.0, 0.0]}
    assert report.scores == [11.0, 0.0, 1.0]


@pytest.mark.parametrize("workers", [0, 1])
def test_async_function_past_the_timeout_is_a_bad_reward(funcs, workers):
    with RewardSet.from_spec(f"{funcs}:async_slow", workers=workers, timeout=1.0) as rewards:
        report = score_samples(rewards, _items(["0", "30"]), "zero")
    assert report.scores == [1.0, 0.0]
    assert report.bad == [("s1", "timed out after 1s")]


def test_async_errors_are_reported_per_sample(funcs):
    report = score_samples(RewardSet.from_spec(f"{funcs}:async_raises,{funcs}:async_own_timeout"), _items(["x"]),
                           "zero")
    (sid, reason), = report.bad
    assert sid == "s0" and "async_raises raised ValueError: no score for x" in reason
    # a TimeoutError the function raises itself is its error, not the reward timeout
    assert "async_own_timeout raised TimeoutError: my API timed out" in reason


def test_async_reward_awaited_inside_a_running_event_loop(funcs):
    async def main():
        return score_samples(RewardSet.from_spec(f"{funcs}:async_sample"), _items(["5"], ["5"]), "fail")

    assert asyncio.run(main()).scores == [1.0]


@pytest.mark.parametrize("workers", [0, 1])
def test_trl_functions_get_conversational_prompts_as_messages(funcs, workers):
    with RewardSet.from_spec(f"{funcs}:trl_chat", workers=workers, timeout=20) as rewards:
        chat = score_samples(rewards, _items(["5", "6"], chat=True), "fail")
        plain = score_samples(rewards, _items(["5", "6"]), "fail")
    assert chat.scores == [1.0, 0.0]  # the function read the user turn and the assistant message
    assert plain.scores == [0.5, 0.5]  # plain-string prompts stay strings


def test_other_styles_keep_strings_for_chat_prompts():
    seen = []

    def ours(prompt, response, ground_truth, metadata):
        seen.append((prompt, response))
        return 1.0

    score_samples(ours, _items(["5"], chat=True), "fail")
    assert seen == [("<|user|>2+3=<|assistant|>", "5")]


CHAT_CHECK = '''
def chat_form(prompts, completions, **kwargs):
    """1 where TRL's conversational form arrived: the prompt's messages, the completion as one assistant message."""
    return [float(isinstance(p, list) and p[-1] == {"role": "user", "content": "2+3="}
                  and isinstance(c, list) and c[0]["role"] == "assistant") for p, c in zip(prompts, completions)]
'''


def test_a_conversational_prompt_store_reaches_a_trl_function_as_messages(tiny_model_path, tiny_tokenizer,
                                                                          dist_single, tmp_path):
    from ds_rlhf.config import parse_config
    from ds_rlhf.data.prep import prep_prompts
    from ds_rlhf.recipes.rl import RLTrainer

    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps({"prompt": CHAT, "label": "5"}) + "\n" for _ in range(4)))
    store = prep_prompts(source, tmp_path / "store", tiny_tokenizer, progress=False).path
    (tmp_path / "r.py").write_text(CHAT_CHECK)
    history = RLTrainer(parse_config([
        "--model.path", str(tiny_model_path), "--data.train", str(store), "--reward.fn",
        f"{tmp_path / 'r.py'}:chat_form@trl", "--run.output_dir", str(tmp_path / "run"), "--run.steps", "1",
        "--rl.prompts_per_step", "2", "--rollout.n_samples", "2", "--rollout.max_new_tokens", "4",
        "--rollout.backend", "hf", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.export_hf", "false"])).train()
    assert history[-1]["reward/mean"] == 1.0
