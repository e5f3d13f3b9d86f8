"""The engines' budget by the work where the run uses it beyond the engines (`memory/engine_budget.py`): the JSD
memory preflight leaves the trainer what the run's engines leave (the same `engine_share` as the RL build), and the
run directory records the share and KV cache the engines got (config.json, engine_budget.json) so `--config
config.json` starts the same engines."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.memory.engine_budget import (
    BUDGET_FILE,
    apply_engine_budget,
    choose_engine_budget,
    engine_share,
    record_engine_budget,
)
from ds_rlhf.memory.kv_cache import GiB, vllm_kv_cache
from ds_rlhf.memory.meta_models import hf_config
from ds_rlhf.memory.plan import jsd_bytes_per_token
from ds_rlhf.recipes import rl_build
from ds_rlhf.run.preflight import check_jsd_memory
from ds_rlhf.run.run_dir import foreign_entries
from tests.memory import smol_shape
from tests.memory.smol_shape import H100, SMOL, SMOL_WORK

smol = smol_shape.smol  # the module's fixture





def _cfg(model: str, *args: str):
    return parse_config(["--model.path", model, "--rollout.backend", "vllm", "--rl.algo", "grpo", "--rl.kl_coef", "0",
                         *SMOL_WORK, *args])


def _build_fractions(cfg, monkeypatch, model_path: str = ""):
    """The RL build's (vLLM share, trainer fraction, budget) and KV cache on a faked H100."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H100))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: None)
    ctx = SimpleNamespace(cfg=cfg, dist=SimpleNamespace(device=torch.device("cuda", 0), world_size=1), print=print,
                          model_path=model_path)
    vllm_fraction, _, budget = rl_build._memory_fractions(ctx, "colocated")
    return vllm_fraction, budget, rl_build._vllm_kv_cache(ctx, 1, budget)[0]


def _jsd(smol: str, tokens: int, *args: str):
    return _cfg(smol, "--rl.teacher", smol, "--rl.distill_loss", "jsd", "--rl.jsd_beta", "1",
                "--data.micro_batch_tokens", str(tokens), *args)


def test_the_jsd_preflight_leaves_the_trainer_what_the_engines_budget_leaves(smol, monkeypatch):
    share, budget = engine_share(_jsd(smol, 1024), H100)
    assert budget is not None and share == budget.fraction < 0.2
    assert _build_fractions(_jsd(smol, 1024), monkeypatch)[0] == share  # the share the run starts vLLM with
    room = 0.8 * H100 * (1 - share)
    fits = int(room // jsd_bytes_per_token(SMOL["vocab_size"], "bf16", 1.0)) // 1024 * 1024
    with pytest.raises(ConfigError, match=rf"more than 80% of the {H100 * (1 - share) / GiB:.1f} GiB vLLM leaves of "
                       rf"this GPU: set --data.micro_batch_tokens {fits} or less"):
        check_jsd_memory(_jsd(smol, 200_000), total_bytes=H100)
    check_jsd_memory(_jsd(smol, fits), total_bytes=H100)  # under the budget's share: fits
    with pytest.raises(ConfigError, match="39.6 GiB vLLM leaves"):  # the user's share of 0.5 leaves less
        check_jsd_memory(_jsd(smol, fits, "--rollout.gpu_memory_utilization", "0.5"), total_bytes=H100)
    assert engine_share(_jsd(smol, 1024, "--rollout.placement", "disaggregated"), H100) == (0.0, None)
    assert engine_share(_jsd(smol, 1024, "--rollout.backend", "hf"), H100) == (0.0, None)


def test_the_run_directory_records_the_budget_and_its_config_starts_the_same_engines(smol, tmp_path, monkeypatch):
    cfg = _cfg(smol)
    budget = choose_engine_budget(cfg, H100)
    apply_engine_budget(cfg, budget)
    record_engine_budget(cfg, budget, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rollout"]["gpu_memory_utilization"] == budget.fraction < 0.2
    assert saved["rollout"]["kv_cache_gb"] * GiB == budget.kv.bytes and cfg.rollout.kv_cache_gb == 0
    recorded = json.loads((tmp_path / BUDGET_FILE).read_text())
    assert recorded["chosen_settings"] == {"rollout.gpu_memory_utilization": budget.fraction,
                                           "rollout.kv_cache_gb": budget.kv.bytes / GiB}
    assert recorded["kv_cache_bytes"] == budget.kv.bytes and recorded["kv_source"] == "work"
    assert not set(recorded["chosen_settings"]) & cfg.given  # the run's choice, never a key the user gave
    assert foreign_entries(tmp_path) == []  # a run's own files: a later run in this directory is not refused

    again = parse_config(["--config", str(tmp_path / "config.json")])
    assert engine_share(again, H100) == (budget.fraction, None)  # the user's now: no budget, the same share
    vllm_fraction, none, kv = _build_fractions(again, monkeypatch, smol)
    assert (vllm_fraction, none, kv.bytes, kv.source) == (budget.fraction, None, budget.kv.bytes, "setting")
    assert vllm_kv_cache(again, hf_config(smol), device="cuda", host_bytes=H100).bytes == budget.kv.bytes

    record_engine_budget(again, None, tmp_path)  # a run without a budget leaves no earlier one behind
    assert not Path(tmp_path / BUDGET_FILE).exists()
