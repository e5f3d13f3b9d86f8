"""Non-finite numbers of an RL step (`recipes/nonfinite.py`, `rl.on_nonfinite`): a reward, an advantage, a loss or
a gradient norm that is not finite stops the run in one line naming the step and the source, before the optimizer
step; under `skip` the step (or the micro-batch) is left out with a warning; the tiny model, a plain engine."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from ds_rlhf.cli import run_entry
from ds_rlhf.config import Config, ConfigError, parse_config
from ds_rlhf.entrypoints.train import PPO_DEFAULTS, run_ppo
from ds_rlhf.recipes.nonfinite import NonFinite, NonFiniteError, guard_step
from ds_rlhf.recipes.policy_update import policy_update
from ds_rlhf.recipes.trajectory import pad_trajectory, with_advantages
from ds_rlhf.rollout.base import RolloutSample

SHAPES = [(3, 5), (6, 2), (2, 6), (5, 4)]


def _cfg(policy: str = "fail") -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, micro_batch_size=1),
                               rl=dataclasses.replace(cfg.rl, on_nonfinite=policy))


def _traj(cfg: Config, scores=(0.9, 0.1, 0.2, 0.7)):
    gen = torch.Generator().manual_seed(0)
    samples = [RolloutSample(prompt_index=i // 2, sample_index=i % 2,
                             prompt_ids=torch.randint(10, 400, (p,), generator=gen).tolist(),
                             response_ids=torch.randint(10, 400, (r,), generator=gen).tolist(),
                             logprobs=(-6.0 + torch.rand(r, generator=gen)).tolist(), finish_reason="stop")
               for i, (p, r) in enumerate(SHAPES)]
    return with_advantages(pad_trajectory(samples, list(scores), pad_id=0), cfg.rl, 0.0)


class Engine:
    """The slice of DeepSpeedEngine that `policy_update` calls, on a plain module: counts backward passes, records
    the gradient at each step (then applies SGD), reports a chosen gradient norm and whether the step applied."""

    def __init__(self, module, norm: float | None = None, applied: bool = True):
        self.module, self.norm, self.applied = module, norm, applied
        self.backwards, self.grads = 0, []
        self.opt = torch.optim.SGD(module.parameters(), lr=0.1)

    def __getattr__(self, name):
        return getattr(self.module, name)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss, scale_wrt_gas=True):
        self.backwards += 1
        loss.backward()

    def step(self):
        self.grads.append({n: p.grad.clone() for n, p in self.module.named_parameters() if p.grad is not None})
        self.opt.step()
        self.opt.zero_grad()

    def get_global_grad_norm(self):
        return self.norm

    def was_step_applied(self):
        return self.applied


@pytest.fixture(scope="module")
def actor(tiny_model_path):
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is as fast, and far faster on a busy CPU
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.config.use_cache = False
    yield model
    torch.set_num_threads(threads)


def _update(actor, cfg, traj, **engine):
    engine = Engine(copy.deepcopy(actor), **engine)
    result = policy_update(engine, None, traj, cfg, kl_coef=0.0, generator=torch.Generator().manual_seed(0))
    return engine, result


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_non_finite_reward_stops_the_update_before_any_backward(actor, policy):
    cfg = _cfg(policy)
    traj = _traj(cfg).replace(scores=torch.tensor([0.9, float("inf"), 0.2, 0.7]))
    engine = Engine(copy.deepcopy(actor))
    with pytest.raises(NonFinite, match="reward: sample 1 of this rank: inf") as info:
        policy_update(engine, None, traj, cfg, kl_coef=0.0, generator=torch.Generator())
    assert engine.backwards == 0 and engine.grads == [] and not info.value.applied


def test_finite_rewards_whose_advantages_overflow_name_the_advantage(actor):
    cfg = _cfg()
    traj = _traj(cfg, scores=(3e38, 3e38, 1.0, 2.0))  # finite in float32; their group mean is not
    with pytest.raises(NonFinite, match="advantage: sample 0 of this rank: nan"):
        _update(actor, cfg, traj)


def _nan_row(traj, row: int = 2):
    """Row `row`'s rollout log-probs NaN (its importance weights, so its loss, are NaN; its reward is finite)."""
    logp = traj.rollout_logp.clone()
    logp[row][traj.action_mask[row].bool()] = float("nan")
    return traj.replace(rollout_logp=logp)


def test_a_non_finite_loss_fails_before_the_optimizer_step(actor):
    cfg = _cfg("fail")
    with pytest.raises(NonFinite, match=r"loss: actor loss nan in the micro-batch of rows \[2\]") as info:
        _update(actor, cfg, _nan_row(_traj(cfg)))
    assert not info.value.applied


def test_skip_leaves_the_non_finite_micro_batch_out_of_the_update(actor):
    cfg = _cfg("skip")
    traj = _traj(cfg)
    skipped, result = _update(actor, cfg, _nan_row(traj))
    assert result.metrics["guard/nonfinite_micro_batches"] == 1.0
    assert all(torch.isfinite(torch.tensor(float(v))) for v in result.metrics.values())
    # the same update as with that row's loss (and gradient) zero: its advantages 0, its weights finite
    advantages = traj.advantages.clone()
    advantages[2] = 0.0
    clean, reference = _update(actor, cfg, traj.replace(advantages=advantages))
    assert reference.metrics["guard/nonfinite_micro_batches"] == 0.0
    (got,), (expected,) = skipped.grads, clean.grads
    assert got.keys() == expected.keys() and any(g.abs().sum() > 0 for g in got.values())
    for name, g in got.items():
        assert torch.isfinite(g).all() and torch.allclose(g, expected[name], atol=1e-7), name


@pytest.mark.parametrize("applied", [False, True])
def test_a_non_finite_gradient_norm_says_whether_the_engine_applied_it(actor, applied):
    cfg = _cfg("skip")
    with pytest.raises(NonFinite, match="grad norm: actor gradient norm inf") as info:
        _update(actor, cfg, _traj(cfg), norm=float("inf"), applied=applied)
    assert info.value.applied == applied


def test_an_fp16_loss_scalers_skipped_step_is_no_error(actor, monkeypatch):
    monkeypatch.setattr(Engine, "fp16_enabled", lambda self: True, raising=False)
    cfg = _cfg("fail")
    engine, result = _update(actor, cfg, _traj(cfg), norm=float("inf"), applied=False)
    assert result.metrics["actor/optimizer_steps"] == 1 and len(engine.grads) == 1


def test_guard_step_stops_or_skips_naming_the_step_and_the_source(capsys):
    def raising(found):
        def run():
            raise found
        return run

    with pytest.raises(NonFiniteError, match=r"^step 7: the loss is not finite \(actor loss nan\); lower optim.lr.*"
                                             r"or --rl.on_nonfinite skip to skip such steps$"):
        guard_step(raising(NonFinite("loss", "actor loss nan")), step=7, policy="fail")
    popped = []
    metrics = guard_step(raising(NonFinite("reward", "sample 3: inf")), step=8, policy="skip",
                         on_skip=lambda: popped.append(1))
    assert metrics == {"guard/skipped_steps": 1.0} and popped == [1]
    assert "warning: step 8: the reward is not finite (sample 3: inf)" in capsys.readouterr().out
    with pytest.raises(NonFiniteError, match="step 9: .*the optimizer applied it, so the weights are not finite"):
        guard_step(raising(NonFinite("grad norm", "actor gradient norm nan", applied=True)), step=9, policy="skip")
    assert guard_step(lambda: {"guard/nonfinite_micro_batches": 2.0}, step=10, policy="skip")
    assert "step 10: the loss of 2 micro-batch(es) was not finite" in capsys.readouterr().out


def test_tiny_sapo_temperatures_are_refused_at_parse_time():
    for key in ("--rl.sapo_tau_pos", "--rl.sapo_tau_neg"):
        with pytest.raises(ConfigError, match=rf"{key[2:]}=1e-45: must be >= 1e-06"):
            parse_config(["--rl.policy_loss", "sapo", key, "1e-45"])
    assert parse_config(["--rl.sapo_tau_pos", "1e-6"]).rl.sapo_tau_pos == 1e-6


def test_a_run_whose_advantages_overflow_stops_in_one_line_or_skips_its_steps(tiny_model_path, dist_single, tmp_path,
                                                                             monkeypatch, capsys):
    from tests.recipes.stores import prompt_store

    monkeypatch.delenv("DS_RLHF_DEBUG", raising=False)
    reward = tmp_path / "huge.py"
    reward.write_text("def huge(prompt, response, ground_truth, metadata):\n    return 3e38\n")
    run = tmp_path / "run"
    argv = ["--model.path", str(tiny_model_path), "--data.train", str(prompt_store(tmp_path, tiny_model_path)),
            "--reward.fn", f"{reward}:huge", "--rl.prompts_per_step", "2", "--rollout.n_samples", "2",
            "--rollout.max_new_tokens", "4", "--run.steps", "2", "--rollout.backend", "hf", "--run.progress", "false",
            "--run.tensorboard", "false", "--run.output_dir", str(run)]
    with pytest.raises(SystemExit) as info:
        run_entry("doc", PPO_DEFAULTS, run_ppo, argv)
    print(info.value.code)
    assert str(info.value.code).startswith("error: step 1: the advantage is not finite (sample 0 of this rank: nan")
    assert "\n" not in str(info.value.code)
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and status["error"]["type"] == "NonFiniteError" and status["step"] == 0
    # under skip the run goes on: each step skipped with a warning, none trained on
    skip = tmp_path / "skip"
    run_entry("doc", PPO_DEFAULTS, run_ppo, [*argv, "--rl.on_nonfinite", "skip", "--run.output_dir", str(skip)])
    records = [json.loads(line) for line in (skip / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["guard/skipped_steps"]) for r in records] == [(1, 1.0), (2, 1.0)]
    assert "step 2: the advantage is not finite" in capsys.readouterr().out
    assert json.loads((skip / "status.json").read_text())["status"] == "finished"
