"""ds-rlhf autotune: a coordinate search over trial runs within a budget; failures, OOMs and overruns are recorded,
never fatal; the winners are a YAML that --config takes."""

from __future__ import annotations

import json
import sys
import time

import pytest
import yaml

from ds_rlhf.config import parse_config
from ds_rlhf.ops import autotune
from ds_rlhf.ops.autotune import default_knobs, parse_budget, run_search

FAKE_TRAINER = r'''
import json, sys, time
from pathlib import Path
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
out = Path(args["--run.output_dir"]); out.mkdir(parents=True, exist_ok=True)
tokens = int(args.get("--data.micro_batch_tokens", "0"))
fast = args.get("--rollout.async_generation") == "true"
if tokens == 2048:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB", flush=True)
    sys.exit(1)
if tokens == 4096:
    time.sleep(120)
if tokens == 512:
    sys.exit(3)
with open(out / "metrics.jsonl", "w") as f:
    for step in (1, 2):
        rate = (10.0 if step == 2 else 1.0) + 5.0 * fast + tokens / 1000
        f.write(json.dumps({"step": step, "time/wall": 1.0, "throughput/completions_per_s": rate,
                            "throughput/tokens_per_s": 100 * rate}) + "\n")
'''


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    return lambda argv: [sys.executable, str(script), *argv]


def test_budget_parsing():
    assert parse_budget("10m") == 600 and parse_budget("90s") == 90 and parse_budget("1.5h") == 5400
    assert parse_budget("45") == 45
    with pytest.raises(ValueError):
        parse_budget("ten minutes")


def test_default_knobs_skip_what_does_not_exist_or_apply():
    cfg = parse_config(["--rollout.backend", "hf", "--data.max_prompt_len", "128", "--rollout.max_new_tokens", "256"])
    knobs, skipped = default_knobs(cfg, {})
    assert knobs["rollout.async_generation"] == [False, True]
    assert knobs["data.micro_batch_tokens"] == [0, 2048, 6144, 24576]  # multiples of 384 tokens, rounded to 1 KiB
    assert "no effect" in skipped["rollout.max_num_seqs"]  # vLLM's knobs: no effect with the HF backend
    assert "no effect" in skipped["rollout.gpu_memory_utilization"]
    misspelt = "rollout.max_num_sequences"
    assert "not a config key" in default_knobs(cfg, {misspelt: ["8"]})[1][misspelt]
    vllm_knobs, vllm_skipped = default_knobs(parse_config(["--rollout.backend", "vllm"]), {})
    assert vllm_knobs["rollout.max_num_seqs"] == [0, 64, 128, 256, 512]  # 0 = vLLM's default, then the candidates
    assert "needs rollout.placement sidecar" in vllm_skipped["rollout.sidecar_engines"]  # colocated: one engine
    # vLLM's share left unset: the baseline passes none (the run sizes the KV cache by the work), yours is passed
    assert vllm_knobs["rollout.gpu_memory_utilization"] == ["auto", 0.3, 0.5, 0.7, 0.85]
    assert autotune._knob_args({"rollout.gpu_memory_utilization": "auto", "rollout.max_num_seqs": 0}) == [
        "--rollout.max_num_seqs", "0"]
    assert autotune.overrides_mapping({"rollout.gpu_memory_utilization": "auto"}) == {}
    given, _ = default_knobs(parse_config(["--rollout.backend", "vllm", "--rollout.gpu_memory_utilization", "0.4"]), {})
    assert given["rollout.gpu_memory_utilization"] == [0.4, 0.3, 0.5, 0.7, 0.85]
    sidecar, _ = default_knobs(parse_config(["--rollout.backend", "vllm", "--rollout.placement", "sidecar",
                                             "--rollout.sidecar_engines", "2"]), {})
    assert sidecar["rollout.sidecar_engines"] == [2, 1, 3]  # the run's value first, then the other candidates
    knobs, skipped = default_knobs(cfg, {"data.micro_batch_tokens": ["4096", "0"], "rl.mini_batch_size": ["16"],
                                         "rollout.async_generation": []})
    assert knobs["data.micro_batch_tokens"] == [0, 4096] and knobs["rl.mini_batch_size"] == [0, 16]
    assert "rollout.async_generation" not in knobs and "left out" in skipped["rollout.async_generation"]


def test_search_records_oom_failure_and_timeout_and_stays_in_budget(tmp_path, fake):
    knobs = {"rollout.async_generation": [False, True], "data.micro_batch_tokens": [0, 1024, 2048, 512, 4096, 8192]}
    start = time.monotonic()
    search = run_search(["--model.path", "tiny"], knobs, tmp_path / "tune", budget_s=8, command=fake)
    elapsed = time.monotonic() - start
    assert elapsed < 8 + 1.5, elapsed  # the sleeping trial was killed at the budget's end
    by_change = {autotune._describe(t): t for t in search.trials}
    assert by_change["baseline"].status == "ok" and by_change["baseline"].objective == pytest.approx(10.0)
    assert by_change["rollout.async_generation=true"].objective == pytest.approx(15.0)
    # the micro-batch knob is searched from the best point (async on)
    assert by_change["data.micro_batch_tokens=1024"].knobs["rollout.async_generation"] is True
    assert by_change["data.micro_batch_tokens=2048"].status == "oom"
    assert "out of memory" in by_change["data.micro_batch_tokens=2048"].error
    assert by_change["data.micro_batch_tokens=512"].status == "failed"
    assert by_change["data.micro_batch_tokens=512"].exit_code == 3
    assert by_change["data.micro_batch_tokens=4096"].status == "timeout"
    assert "data.micro_batch_tokens=8192" not in by_change and search.stopped.startswith("budget")
    best = search.best()
    assert best.knobs == {"rollout.async_generation": True, "data.micro_batch_tokens": 1024}
    table = json.loads((tmp_path / "tune" / "trials.json").read_text())
    assert [t["status"] for t in table["trials"]] == ["ok", "ok", "ok", "oom", "failed", "timeout"]
    assert table["best"]["index"] == best.index
    overrides = tmp_path / "tune" / "overrides.yaml"
    assert yaml.safe_load(overrides.read_text()) == {"rollout": {"async_generation": True},
                                                     "data": {"micro_batch_tokens": 1024}}
    cfg = parse_config(["--config", str(overrides)])
    assert cfg.rollout.async_generation is True and cfg.data.micro_batch_tokens == 1024
    assert "best: trial 2" in autotune.format_table(search)


def test_a_combination_the_config_refuses_is_invalid_not_run(tmp_path, fake):
    search = run_search(["--rl.mismatch", "off"], {"rollout.async_generation": [False, True]}, tmp_path,
                        budget_s=30, command=fake, max_trials=5)
    assert [t.status for t in search.trials] == ["ok", "invalid"]
    assert "rl.mismatch" in search.trials[1].error and not (tmp_path / "trials" / "01.log").exists()


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert autotune.main(["--budget", "soon", "--out", str(tmp_path)]) == 2
    assert autotune.main(["--rl.ppo_epochs", "0", "--out", str(tmp_path)]) == 2
    assert "rl.ppo_epochs" in capsys.readouterr().err


@pytest.mark.extended
@pytest.mark.slow
def test_autotune_on_the_tiny_model_finishes_in_budget(tiny_model_path, tmp_path):
    """Real trials (train-ppo subprocesses, HF generate on CPU), 2 steps each, 3 trials, a 3-minute budget."""
    from ds_rlhf.data.synthetic import write_addition_datasets

    stores = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=64, n_sft=8, n_pref=8,
                                     max_operand=20)
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump({"model": {"path": "tiny"}, "data": {"train": str(stores["prompts"])},
                                        "rollout": {"backend": "hf", "n_samples": 2, "max_new_tokens": 8},
                                        "rl": {"prompts_per_step": 4}, "reward": {"fn": "math_shaped"}}))
    out = tmp_path / "tune"
    start = time.monotonic()
    code = autotune.main(["--config", str(run_yaml), "--budget", "3m", "--steps", "2", "--max-trials", "3",
                          "--out", str(out), "--search", "data.micro_batch_tokens=1024",
                          "--run.output_dir", str(tmp_path / "never_used")])
    assert time.monotonic() - start < 180
    assert code == 0
    table = json.loads((out / "trials.json").read_text())
    assert len(table["trials"]) == 3 and all(t["status"] == "ok" for t in table["trials"]), table["trials"]
    assert "rollout.max_num_seqs" in table["skipped_knobs"]
    assert not (tmp_path / "never_used").exists()  # trials write under --out only
    overrides = out / "overrides.yaml"
    cfg = parse_config(["--config", str(run_yaml), "--config", str(overrides)])
    assert cfg.data.micro_batch_tokens == table["best"]["knobs"]["data.micro_batch_tokens"]
    assert parse_config(["--config", str(overrides)]).rollout.async_generation == \
        table["best"]["knobs"]["rollout.async_generation"]
