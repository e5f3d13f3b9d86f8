"""The episode runner, token in / token out: generated ids and log-probs recorded exactly as `generate` returned
them, observation ids exactly the chat template's tokenization, masks token by token, budgets, failing tools
reported, and every waiting episode in one generate call per round."""

from __future__ import annotations

import copy
import threading
import time

import agent_helpers as h
import pytest
from scripted_policy import ScriptedPolicy

from ds_rlhf.agent.environment import ToolEnvironment
from ds_rlhf.agent.episode import EpisodeRunner
from ds_rlhf.agent.examples.calculator import CalculatorEnv
from ds_rlhf.agent.rendering import ChatRenderer, plain_tool_turn
from ds_rlhf.agent.sandbox import Sandbox
from ds_rlhf.engines.chat_tokens import end_of_turn_id
from ds_rlhf.rollout import SamplingSpec, make_rollout_engine

SPEC = SamplingSpec(max_new_tokens=256, temperature=1.0, seed=0)
# A Qwen2.5-style template: tools in a system turn, tool results as <tool_response> inside a user turn.
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template without a tool role (as Llama-2/Mistral-style templates refuse roles they do not know).
NO_TOOL_ROLE = (
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be system/user/assistant') }}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def transcript_ids(tok, messages):
    """The whole conversation tokenized at once from the chat template, without the tail after the last turn's end
    token (where the episode stops)."""
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert tok.decode(ids[-1:]) == "\n"
    return ids[:-1]


def expected_mask(ep, policy, key):
    """1 exactly on the ids of the samples the policy returned for this episode, found in order."""
    mask, at = [0] * len(ep.token_ids), 0
    for sample in policy.samples[key]:
        ids = sample.response_ids
        while ep.token_ids[at:at + len(ids)] != ids:
            at += 1
        mask[at:at + len(ids)] = [1] * len(ids)
        at += len(ids)
    return mask


@pytest.mark.parametrize("template", ["tiny", "qwen_like", "no_tool_role"])
def test_tool_episode_ids_equal_the_template_tokenization(tiny_tokenizer, template):
    tok = {"tiny": tiny_tokenizer, "qwen_like": with_template(tiny_tokenizer, QWEN_LIKE),
           "no_tool_role": with_template(tiny_tokenizer, NO_TOOL_ROLE)}[template]
    eot = end_of_turn_id(tok)
    call = ('<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 3"}}</tool_call>'
            if template == "qwen_like" else 'calculator("12 * 3")')
    policy = ScriptedPolicy(tok, {"twelve": [call, "It is 36."]}, eot)
    runner = EpisodeRunner(policy, tok, CalculatorEnv, SPEC, max_turns=4)
    (ep,) = runner.run([{"prompt": "What is twelve times 3?", "answer": 36}])
    assert (ep.end, ep.turns, ep.turn_rewards, ep.reward, ep.truncated) == ("done", 2, [0.0, 1.0], 1.0, False)

    renderer = ChatRenderer(tok, tools=CalculatorEnv().specs)
    assert renderer.tools_in_template == (template == "qwen_like")
    assert renderer.tool_role == (template != "no_tool_role")
    tool_turn = {"role": "tool", "name": "calculator", "content": "36"}
    messages = [{"role": "user", "content": renderer.first_message("What is twelve times 3?")},
                {"role": "assistant", "content": call},
                tool_turn if template != "no_tool_role" else plain_tool_turn(tool_turn),
                {"role": "assistant", "content": "It is 36."}]
    if template == "qwen_like":
        ids = tok.encode(tok.apply_chat_template(messages, tools=renderer.tools, tokenize=False),
                         add_special_tokens=False)[:-1]
    else:
        ids = transcript_ids(tok, messages)
    assert ep.token_ids == ids
    assert ep.observations == [[messages[2]]]
    # the mask, token by token: 1 on the generated ids only, 0 on the prompt and the observation
    assert ep.loss_mask == expected_mask(ep, policy, "twelve")
    gen = [sample.response_ids for sample in policy.samples["twelve"]]
    assert [t for t, m in zip(ep.token_ids, ep.loss_mask) if m] == gen[0] + gen[1]
    assert [lp for lp, m in zip(ep.logprobs, ep.loss_mask) if m] == [
        lp for sample in policy.samples["twelve"] for lp in sample.logprobs]
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
    assert ep.prompt_length == len(renderer.prompt_ids("What is twelve times 3?"))


def test_turn_cut_before_its_end_gets_the_template_closing(tiny_tokenizer):
    """A turn that stopped at max_new_tokens has no end-of-turn token: the template's whole closing follows it,
    masked 0."""
    eot = end_of_turn_id(tiny_tokenizer)
    policy = ScriptedPolicy(tiny_tokenizer, {"cut": ["I think...", "Done."]}, eot)
    (ep,) = EpisodeRunner(policy, tiny_tokenizer, h.EchoEnv, SPEC).run(["cut"])
    first = policy.samples["cut"][0].response_ids
    start = ep.token_ids.index(first[0], ep.prompt_length)
    after = ep.token_ids[start + len(first):]
    assert tiny_tokenizer.decode(after).startswith("<|im_end|>\n<|im_start|>user\nYou said: I think...<|im_end|>")
    assert ep.loss_mask[start + len(first)] == 0 and ep.turns == 2 and ep.end == "done"


def test_budgets_mark_episodes_truncated(tiny_tokenizer):
    eot = end_of_turn_id(tiny_tokenizer)
    chatter = ["Hello there friend"] * 10
    policy = ScriptedPolicy(tiny_tokenizer, {"alpha": chatter, "beta": chatter}, eot)
    nag = type("Nag", (), {"reset": lambda self, row: row, "step": lambda self, text: ("More.", 0.25, False)})
    turns = EpisodeRunner(policy, tiny_tokenizer, nag, SPEC, max_turns=3).run(["alpha", "beta"])
    for ep in turns:
        assert (ep.turns, ep.end, ep.truncated, ep.turn_rewards) == (3, "max_turns", True, [0.25] * 3)
        assert tiny_tokenizer.decode(ep.token_ids).count("More.") == 2  # no observation after the last turn
    # two episodes with different room left share one generate call: it asks for the larger room, the runner cuts
    # the other's turn at its own budget (a prefix of what generate returned, not stepped)
    long_row = "beta " * 4
    policy = ScriptedPolicy(tiny_tokenizer, {"alpha": ["Hello there friend " * 8] * 10,
                                             "beta": ["Hello there friend " * 8] * 10}, eot)
    prompts = {row: len(ChatRenderer(tiny_tokenizer).prompt_ids(row)) for row in ("alpha", long_row)}
    assert prompts["alpha"] < prompts[long_row] < prompts["alpha"] + 30
    budget = prompts["alpha"] + 30
    alpha, beta = EpisodeRunner(policy, tiny_tokenizer, nag, SPEC, max_turns=10,
                                max_total_tokens=budget).run(["alpha", long_row])
    assert policy.specs[0].max_new_tokens == budget - prompts["alpha"]  # never past the largest room
    for ep, key in ((alpha, "alpha"), (beta, "beta")):
        assert (ep.end, ep.truncated, ep.turns, ep.turn_rewards) == ("max_total_tokens", True, 1, [])
        assert len(ep.token_ids) == budget
        kept = [t for t, m in zip(ep.token_ids, ep.loss_mask) if m]
        assert kept == policy.samples[key][0].response_ids[:budget - ep.prompt_length]
    assert len(policy.samples["beta"][0].response_ids) > budget - beta.prompt_length  # the runner did cut it


def test_failing_tools_are_reported_and_the_runner_goes_on(tiny_tokenizer):
    eot = end_of_turn_id(tiny_tokenizer)
    script = {"slow": ["hang()", "I give up."], "raise": ['boom("bad day")', "Oh well."],
              "loud": ["spam(2)", "That was loud."], "calm": ["add(2, 3)", "It is 5."],
              "typo": ["<tool_call>{add}</tool_call>", "Sorry."]}
    policy = ScriptedPolicy(tiny_tokenizer, script, eot)
    sandbox = Sandbox(timeout_s=5.0, max_output_bytes=500)  # no bound under 5 s for the calls that return

    def make_env():
        return ToolEnvironment([h.add, h.hang, h.boom, h.spam], sandbox=sandbox)

    t0 = time.monotonic()
    eps = EpisodeRunner(policy, tiny_tokenizer, make_env, SPEC).run(list(script))
    assert time.monotonic() - t0 < 60
    by = {ep.row: ep for ep in eps}
    assert all(ep.end == "done" and ep.turns == 2 for ep in eps)
    (slow,) = by["slow"].reports
    assert slow["status"] == "timeout" and slow["turn"] == 1 and 5.0 <= slow["seconds"] < 15.0
    assert "5 s wall timeout" in by["slow"].observations[0][0]["content"]
    assert by["raise"].reports[0]["error"] == "RuntimeError: bad day"
    assert by["loud"].reports[0]["dropped_bytes"] == (2 << 20) + 1 - 500
    assert by["calm"].reports == [] and by["calm"].observations[0][0]["content"] == "5"
    assert by["typo"].reports[0]["status"] == "parse_error"


def test_an_environment_that_raises_ends_only_its_episode(tiny_tokenizer):
    class Fragile(h.EchoEnv):
        def step(self, action_text):
            if "crash" in action_text:
                raise KeyError("lost state")
            return super().step(action_text)

    eot = end_of_turn_id(tiny_tokenizer)
    policy = ScriptedPolicy(tiny_tokenizer, {"one": ["please crash"], "two": ["fine", "fine again"]}, eot)
    one, two = EpisodeRunner(policy, tiny_tokenizer, Fragile, SPEC).run(["one", "two"])
    assert one.end == "error"
    assert one.reports == [{"turn": 1, "status": "error", "error": "step: KeyError: 'lost state'"}]
    assert two.end == "done" and two.reward == 1.0


def test_waiting_episodes_share_one_generate_call_without_a_turn_barrier(tiny_tokenizer):
    """Steps that end while the policy generates are all in the next generate call, whatever turn their episodes
    are at; an episode whose step is still running holds nobody back. Gated steps make the order deterministic: a
    step listed in GATES blocks until the policy, generating the turn named in RELEASES, opens its gate (and then
    waits for that step to finish)."""
    gates = {step: threading.Event() for step in [("y", 0), ("z", 0), ("x", 1), ("z", 1)]}
    finished = {step: threading.Event() for step in gates}
    releases = {("x", 1): [("z", 0)], ("z", 1): [("y", 0), ("x", 1)], ("x", 2): [("z", 1)]}
    lengths = {"x": 3, "y": 2, "z": 3}

    class Env:
        def reset(self, row):
            self.row, self.steps = row, 0
            return f"episode {row}"

        def step(self, action_text):
            turn, self.steps = self.steps, self.steps + 1
            if (self.row, turn) in gates:
                assert gates[self.row, turn].wait(30)
                finished[self.row, turn].set()
            return "ok", 0.0, self.steps == lengths[self.row]

    class Policy(ScriptedPolicy):
        def __call__(self, prompts, spec):
            out = super().__call__(prompts, spec)
            for step in [s for key, turn in self.calls[-1] for s in releases.get((key[-1], turn), [])]:
                gates[step].set()
                assert finished[step].wait(30)
            time.sleep(0.3)  # the released steps' futures complete before generate returns
            return out

    script = {f"episode {k}": ["a", "b", "c"] for k in "xyz"}
    policy = Policy(tiny_tokenizer, script, end_of_turn_id(tiny_tokenizer))
    eps = EpisodeRunner(policy, tiny_tokenizer, Env, SPEC, max_turns=5).run(["x", "y", "z"])
    assert [ep.turns for ep in eps] == [3, 2, 3] and all(ep.end == "done" for ep in eps), (eps, policy.calls)
    calls = [sorted((key[-1], turn) for key, turn in call) for call in policy.calls]
    assert calls == [[("x", 0), ("y", 0), ("z", 0)], [("x", 1)], [("z", 1)], [("x", 2), ("y", 1)], [("z", 2)]]


@pytest.fixture(scope="module")
def hf_engine(tiny_model_path):
    engine = make_rollout_engine("hf", model_path=str(tiny_model_path), dtype="float32", batch_size=8)
    yield engine
    engine.close()


def test_tiny_model_episodes_record_what_generate_returned(hf_engine, tiny_tokenizer):
    """The real engine: the runner's generated ids and log-probs are the samples' own, the rest is the prompt and
    the template-rendered observations, each generate call held every episode waiting then."""
    returned: list = []

    def generate(prompts, spec):
        samples = hf_engine.generate(prompts, spec)
        returned.append(list(zip(prompts, samples)))
        return samples

    spec = SamplingSpec(max_new_tokens=12, temperature=1.0, seed=3)
    runner = EpisodeRunner(generate, tiny_tokenizer, h.EchoEnv, spec, max_turns=3)
    rows = ["cats", "dogs", "birds"]
    eps = runner.run(rows)
    renderer = ChatRenderer(tiny_tokenizer)
    assert sum(len(call) for call in returned) == sum(ep.turns for ep in eps) == 6
    for ep in eps:
        mine = [s for call in returned for prompt, s in call if prompt[:ep.prompt_length] == ep.token_ids[
            :ep.prompt_length] and ep.token_ids[:len(prompt)] == prompt]
        assert len(mine) == ep.turns == 2 and ep.end == "done"
        rebuilt, mask, logprobs = renderer.prompt_ids(f"Say something about {ep.row}."), [], []
        mask = [0] * len(rebuilt)
        logprobs = [0.0] * len(rebuilt)
        for k, sample in enumerate(mine):
            rebuilt += sample.response_ids
            mask += [1] * len(sample.response_ids)
            logprobs += sample.logprobs
            if k < len(mine) - 1:
                closed = sample.response_ids[-1] in runner.spec.stop_token_ids
                obs = renderer.observation_ids(ep.observations[k], tiny_tokenizer.decode(sample.response_ids[-1:])
                                               if closed else None)
                rebuilt += obs
                mask += [0] * len(obs)
                logprobs += [0.0] * len(obs)
        assert ep.token_ids == rebuilt and ep.loss_mask == mask and ep.logprobs == logprobs
