"""Curriculum by difficulty (`rl.curriculum pass_rate`): the pass-rate tracker's rule, the draw that skips settled
prompts and revisits them, its metrics, its exact resume, and the report line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.algos.curriculum import PassRateTracker
from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.ops.report_sections import curriculum_html
from ds_rlhf.recipes.curriculum import CurriculumStream, prompt_key
from ds_rlhf.rollout.base import RolloutEngine, RolloutSample
from tests.recipes.stores import prompt_store


# ---- the tracker's rule --------------------------------------------------------------------------------------------
def test_settled_prompts_are_skipped_for_n_draws_then_revisited_and_mixed_ones_kept():
    t = PassRateTracker(threshold=1.0, min_attempts=2, skip_draws=3)
    t.observe("easy", [1.0, 1.0], draw=1)
    t.observe("hard", [0.0, 0.5], draw=1)
    t.observe("mixed", [1.0, 0.0], draw=1)
    assert not any(t.skipped(k, 1) for k in ("easy", "hard", "mixed"))  # one attempt: not yet
    for k, r in (("easy", [1.0, 1.0]), ("hard", [0.0, 0.0]), ("mixed", [0.0, 0.0])):
        t.observe(k, r, draw=2)
    assert [t.skipped("easy", d) for d in range(2, 6)] == [True, True, True, False]  # draws 2-4, then revisited
    assert [t.skipped("hard", d) for d in range(2, 6)] == [True, True, True, False]
    assert not any(t.skipped("mixed", d) for d in range(2, 6))
    assert (t.pass_rate("easy"), t.pass_rate("hard"), t.pass_rate("mixed")) == (1.0, 0.0, 0.25)
    t.observe("easy", [1.0, 1.0], draw=5)  # revisited, still solved: skipped again
    assert t.skipped("easy", 7) and not t.skipped("easy", 8)
    t.observe("hard", [1.0, 0.0], draw=5)  # revisited, now mixed: kept
    assert not t.skipped("hard", 5)
    assert t.histogram() == {"0.0-0.2": 1, "0.2-0.4": 1, "0.4-0.6": 0, "0.6-0.8": 0, "0.8-1.0": 1}
    fresh = PassRateTracker(1.0, 2, 3)
    fresh.load_state_dict(t.state_dict())
    assert fresh.records == t.records


def test_curriculum_settings_default_off_and_are_checked():
    cfg = parse_config([])
    assert cfg.rl.curriculum == "none"
    assert parse_config(["--rl.curriculum", "pass_rate"]).rl.curriculum == "pass_rate"
    with pytest.raises(ConfigError):
        parse_config(["--rl.curriculum", "easy_first"])


# ---- the draw, on a fake engine, the real loader, rollout service and reward stage -----------------------------------
class EchoRollout(RolloutEngine):
    """Prompts of an even number of tokens: every sample stops (always solved); odd ones alternate stop / length."""

    def generate(self, prompts, spec):
        return [RolloutSample(i, j, list(p), [7, 8], [-0.1, -0.1], "stop" if len(p) % 2 == 0 or j % 2 else "length")
                for i, p in enumerate(prompts) for j in range(spec.n)]

    def logprobs(self, sequences):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError


def even_solved_reward(prompt, response, ground_truth, metadata):
    """1 for a sample that stopped, 0 for a truncated one."""
    return float(metadata["finish_reason"] == "stop")


class NoSync:
    pending = False


def _run(tmp_path, tiny_model_path, tiny_tokenizer, steps, state=None):
    from ds_rlhf.data.loader import StoreLoader
    from ds_rlhf.recipes.reward_stage import RewardStage
    from ds_rlhf.recipes.rl_service import rollout_service
    from ds_rlhf.telemetry import PhaseTimer

    store = tmp_path / "prompts"
    if not store.exists():
        prompt_store(tmp_path, tiny_model_path, lengths=range(2, 10))  # 8 prompts: 4 even (solved), 4 odd
    cfg = parse_config(["--data.train", str(store), "--rl.prompts_per_step", "4", "--rollout.n_samples", "2",
                        "--rollout.max_new_tokens", "4", "--rl.curriculum", "pass_rate",
                        "--rl.curriculum_min_attempts", "1", "--rl.curriculum_skip_draws", "4"])
    ctx = SimpleNamespace(cfg=cfg, tokenizer=tiny_tokenizer, print=print,
                          dist=SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), is_main=True))
    loader = StoreLoader(store, batch_size=4, seed=0, tokenizer=tiny_tokenizer, expect_kind="prompts")
    stream = CurriculumStream(iter(loader), PassRateTracker(1.0, 1, 4), 4, scan_limit=len(loader) * 4)
    if state is not None:
        loader.load_state_dict(state["loader"])
        stream.load_state_dict(state["curriculum"])
    parts = SimpleNamespace(environment=None, loader=loader, loader_iter=stream, rollout=EchoRollout(),
                            reward=RewardStage(ctx, fn=even_solved_reward), sync=NoSync(), curriculum=stream)
    timer = PhaseTimer()
    service = rollout_service(parts, ctx, timer)
    drawn, metrics = [], []
    for step in steps:
        scored = parts.reward(service.batch(step), step=step)
        stream.observe(scored)  # as RLTrainer.train_step does
        drawn.append([len(r["input_ids"]) for r in scored.rollout.rows])
        metrics.append(stream.metrics())
    return drawn, metrics, {"loader": loader.state_dict(), "curriculum": stream.state_dict()}


def test_solved_prompts_are_skipped_in_later_draws_then_revisited(tmp_path, tiny_model_path, tiny_tokenizer):
    drawn, metrics, _ = _run(tmp_path, tiny_model_path, tiny_tokenizer, range(6))
    # draws 0-1: the first epoch, every prompt once; draws 2-3 (the second epoch): the solved (even) prompts sit out
    assert sorted(drawn[0] + drawn[1]) == list(range(2, 10))
    assert all(n % 2 == 1 for n in drawn[2] + drawn[3]), drawn
    assert metrics[2]["curriculum/skipped"] > 0 and metrics[0]["curriculum/skipped"] == 0
    assert metrics[1]["curriculum/tracked"] == 8
    assert metrics[1]["curriculum/pass_rate_hist/0.8-1.0"] == 4 and metrics[1]["curriculum/pass_rate_hist/0.4-0.6"] == 4
    # after 4 draws the solved prompts come back
    assert any(n % 2 == 0 for d in drawn[4:] for n in d), drawn


def test_a_resumed_stream_draws_what_an_uninterrupted_one_draws(tmp_path, tiny_model_path, tiny_tokenizer):
    straight, _, _ = _run(tmp_path, tiny_model_path, tiny_tokenizer, range(8))
    first, _, state = _run(tmp_path, tiny_model_path, tiny_tokenizer, range(6))
    assert state["curriculum"]["buffer"], "the split point leaves rows read but not handed out"
    resumed, _, _ = _run(tmp_path, tiny_model_path, tiny_tokenizer, range(6, 8), state=state)
    assert first + resumed == straight


def test_report_shows_the_curriculum_line():
    rec = {"step": 3, "curriculum/tracked": 8.0, "curriculum/skipped": 2.0, "curriculum/pass_rate_hist/0.0-0.2": 1.0}
    line = curriculum_html([{"step": 2}, rec])
    assert "8 prompts tracked" in line and "2 skipped" in line and "0.0-0.2: 1" in line
    assert curriculum_html([{"step": 1, "reward/mean": 0.5}]) == ""
    assert prompt_key({"input_ids": [3, 4]}) == prompt_key({"input_ids": torch.tensor([3, 4]).numpy()})


# ---- a short RL run on the tiny model: the trainer's wiring, metrics, checkpoint and resume -------------------------
REWARD_FILE = '''
def by_prompt(prompt, response, ground_truth, metadata):
    """'easy' prompts always pass; the others pass by the response's characters (mixed within a group)."""
    return 1.0 if ground_truth == "easy" else float(sum(map(ord, response)) % 2)
'''


def _store(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    from ds_rlhf.data.store import tokenizer_fingerprint
    from ds_rlhf.data.writer import write_store

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = [{"input_ids": list(range(3, 3 + n)), "ground_truth": "easy" if n % 2 == 0 else "open"}
            for n in range(2, 10)]
    write_store(tmp_path / "mixed", "prompts", rows, tokenizer_name=str(tiny_model_path),
                tokenizer_fingerprint=tokenizer_fingerprint(tok))
    return tmp_path / "mixed"


def _args(tmp_path, tiny_model_path, store, out, *extra):
    reward = tmp_path / "by_prompt.py"
    reward.write_text(REWARD_FILE)
    return parse_config(["--model.path", str(tiny_model_path), "--data.train", str(store), "--reward.fn",
                         f"{reward}:by_prompt", "--rl.prompts_per_step", "4", "--rollout.n_samples", "8",
                         "--rollout.max_new_tokens", "4", "--run.steps", "4", "--rollout.backend", "hf",
                         "--run.progress", "false", "--run.tensorboard", "false", "--run.save_every", "2",
                         "--run.sample_log_every", "1", "--run.sample_log_k", "32", "--rl.curriculum", "pass_rate",
                         "--rl.curriculum_min_attempts", "1", "--rl.curriculum_skip_draws", "4",
                         "--run.output_dir", str(out), *extra])


def _by_step(run_dir, field):
    import json

    out: dict[int, set] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], set()).add(rec[field])
    return out


def test_an_rl_run_skips_always_solved_prompts_and_resumes_exactly(tiny_model_path, dist_single, tmp_path):
    from ds_rlhf.recipes.rl import RLTrainer

    store = _store(tmp_path, tiny_model_path)
    straight = RLTrainer(_args(tmp_path, tiny_model_path, store, tmp_path / "a")).train()
    seen = _by_step(tmp_path / "a", "ground_truth")
    assert seen[1] | seen[2] == {"easy", "open"}  # the first epoch: every prompt once
    assert seen[3] == seen[4] == {"open"}, seen  # then the always-solved ones sit out
    assert straight[2]["curriculum/skipped"] > 0 and straight[1]["curriculum/tracked"] == 8
    assert straight[1]["curriculum/pass_rate_hist/0.8-1.0"] >= 4
    resume = ["--run.resume", str(tmp_path / "a" / "checkpoints" / "step_00000002")]
    resumed = RLTrainer(_args(tmp_path, tiny_model_path, store, tmp_path / "b", *resume)).train()
    prompts_a, prompts_b = _by_step(tmp_path / "a", "prompt"), _by_step(tmp_path / "b", "prompt")
    assert [prompts_b[s] for s in (3, 4)] == [prompts_a[s] for s in (3, 4)]  # the same prompts drawn
    for a, b in zip(straight[2:], resumed):
        for key in ("reward/mean", "curriculum/skipped", "curriculum/tracked", "curriculum/pass_rate_hist/0.8-1.0"):
            assert a[key] == pytest.approx(b[key]), key
