"""The split of run.max_gpu_memory_gb (memory/split.py): vLLM's share, the micro-batch tokens and the sidecar engine
count picked from the memory plan for what the user left unset, on the bench's Qwen2-0.5B shape and a 141 GiB GPU
(the H200's). Planned only: config.json files, no weights."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.memory import cap as memory_cap
from ds_rlhf.memory.device import device_peak
from ds_rlhf.memory.plan import GiB, plan_memory
from ds_rlhf.memory.split import KEYS, MARGIN, apply_split, choose_split
from ds_rlhf.ops import autotune
from ds_rlhf.ops import memory as memory_cli
from ds_rlhf.run import preflight

ROOT = Path(__file__).resolve().parents[2]
H200 = int(141 * GiB)
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from transformers import Qwen2Config

    out = tmp_path_factory.mktemp("qwen2-0.5b-shape")
    Qwen2Config(**QWEN2_05B, tie_word_embeddings=True).save_pretrained(out)
    return str(out)


def bench_args(model: str, cap: float, *more: str) -> list[str]:
    """bench/rl_step_gpu.py's workload (GRPO, 32 prompts x 8 samples x 256 new tokens, 128-token prompts, two
    sidecar engines as an entry-point default) under a cap, without --gpu-mem / --micro-batch-tokens."""
    return ["--model.path", model, "--rl.algo", "grpo", "--rl.kl_coef", "0", "--rollout.placement", "sidecar",
            "--rl.prompts_per_step", "32", "--rollout.n_samples", "8", "--rollout.max_new_tokens", "256",
            "--data.max_prompt_len", "128", "--rollout.backend", "vllm", "--run.max_gpu_memory_gb", f"{cap:g}",
            *more]


ENGINES = {"rollout": {"sidecar_engines": 2}}


def planned(cfg, cap_gb: float):
    return plan_memory(cfg, kind="rl", device="cuda", capacity=int(cap_gb * GiB), world_size=1)


def test_the_bench_shape_fits_48_and_80_gib_with_a_larger_micro_batch_at_80(qwen):
    chosen = {}
    for cap in (48, 80):
        cfg = parse_config(bench_args(qwen, cap), ENGINES)
        split = choose_split(cfg, H200)
        assert split.picked == ("rollout.gpu_memory_utilization", "data.micro_batch_tokens")
        assert split.sidecar_engines == 2  # kept: both engines fit
        apply_split(cfg, split)
        plan = planned(cfg, cap)
        assert plan.fits and device_peak(cfg, plan).total <= cap * GiB * (1 - MARGIN)
        assert plan.peak == split.peak and device_peak(cfg, plan) == split.device
        # vLLM's share holds the whole step (256 sequences of 384 tokens) in one wave, in both engines together
        assert not any("waves" in n for n in plan.notes), plan.notes
        assert split.vllm_fraction == pytest.approx(split.gpu_memory_utilization * cap / 141)
        # the trainer's part fits the allocator fraction its process gets beside the sidecar
        trainer = plan.peak - int(split.gpu_memory_utilization * cap * GiB)
        assert trainer < memory_cap.trainer_memory_fraction(cfg, H200, "sidecar") * H200
        assert memory_cap.check_memory_cap(cfg, total_bytes=H200, world_size=1) is not None
        chosen[cap] = split
    assert chosen[48].micro_batch_tokens < chosen[80].micro_batch_tokens
    # the largest candidate: the next one up does not fit
    cfg = parse_config(bench_args(qwen, 48), ENGINES)
    apply_split(cfg, chosen[48])
    bigger = {16384: 24576, 12288: 16384, 24576: 32768}.get(chosen[48].micro_batch_tokens)
    assert bigger, chosen[48]
    cfg.data.micro_batch_tokens = bigger
    over = planned(cfg, 48)
    assert device_peak(cfg, over).total > 48 * GiB * (1 - MARGIN)


# Whole-device NVML peaks measured on one H200 (device total 150109880320 bytes) by `bench/rl_step_gpu.py
# --max-gpu-memory-gb 48` and `... 80` (this file's workload, two sidecar engines, ZeRO-2, synchronous; the JSONs
# `rl_step_cap48_sync.json` / `rl_step_cap80_sync.json`: the largest memory value of `timeline.samples`), with the
# split the run picked then: cap -> (rollout.gpu_memory_utilization, data.micro_batch_tokens, NVML peak GiB)
H200_MEASURED_TOTAL = 150109880320
MEASURED_NVML_PEAKS = {48: (0.19, 16384, 51.04), 80: (0.11, 32768, 72.85)}


def test_the_device_peak_covers_the_nvml_peaks_measured_on_the_h200(qwen):
    for cap, (util, tokens, nvml_gib) in MEASURED_NVML_PEAKS.items():
        cfg = parse_config(bench_args(qwen, cap, "--rollout.gpu_memory_utilization", str(util),
                                      "--data.micro_batch_tokens", str(tokens)), ENGINES)
        plan = planned(cfg, cap)
        peak = device_peak(cfg, plan)
        print(f"cap {cap}: planned device peak {peak.total / GiB:.2f} GiB, measured {nvml_gib} GiB")
        # at or above what NVML read, and not by more than 1 GiB (a looser fit would waste the cap)
        assert nvml_gib * GiB <= peak.total <= (nvml_gib + 1) * GiB, (cap, peak)
        assert peak.engines > 0 and peak.phase == "train"


def test_the_split_keeps_the_device_peak_under_the_cap_on_the_measured_h200(qwen):
    for cap, (_, measured_tokens, nvml_gib) in MEASURED_NVML_PEAKS.items():
        split = choose_split(parse_config(bench_args(qwen, cap), ENGINES), H200_MEASURED_TOTAL)
        print(f"cap {cap}: {split.line(cap)}")
        assert split.device.total <= cap * GiB * (1 - MARGIN)
        if nvml_gib > cap:  # that run went over the cap: the split now takes a smaller micro-batch
            assert split.micro_batch_tokens < measured_tokens
        else:  # that run stayed under: the same micro-batch still fits
            assert split.micro_batch_tokens >= measured_tokens


def test_an_explicit_value_is_never_overridden(qwen, capsys):
    # 0.5 is the schema's default: set on the command line it is the user's all the same
    cfg = parse_config(bench_args(qwen, 48, "--rollout.gpu_memory_utilization", "0.5"), ENGINES)
    split = choose_split(cfg, H200)
    assert "data.micro_batch_tokens" in split.picked and "rollout.gpu_memory_utilization" in split.user
    assert "rollout.gpu_memory_utilization" not in split.picked
    apply_split(cfg, split)
    assert cfg.rollout.gpu_memory_utilization == 0.5 and cfg.data.micro_batch_tokens == split.micro_batch_tokens
    assert "of the cap, yours" in split.line(48)

    both = bench_args(qwen, 80, "--rollout.gpu_memory_utilization", "0.3", "--data.micro_batch_tokens", "4096")
    cfg = parse_config(both, ENGINES)
    assert choose_split(cfg, H200) is None
    preflight.check_memory_cap(cfg, "rl", total_bytes=H200)
    assert (cfg.rollout.gpu_memory_utilization, cfg.data.micro_batch_tokens) == (0.3, 4096)
    assert "run.max_gpu_memory_gb" not in capsys.readouterr().out  # nothing was picked, nothing said

    # from a --config file too
    path = Path(qwen) / "run.yaml"
    path.write_text("data:\n  micro_batch_tokens: 2048\n")
    cfg = parse_config(["--config", str(path), *bench_args(qwen, 48)], ENGINES)
    split = choose_split(cfg, H200)
    assert split.micro_batch_tokens == 2048 and split.picked == ("rollout.gpu_memory_utilization",)


SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536, max_position_embeddings=8192)


def test_gradient_checkpointing_when_it_buys_a_much_larger_small_micro_batch(qwen, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(**SMOLLM2_135M, tie_word_embeddings=True).save_pretrained(tmp_path)
    # bench/learn.py's workload: 32 prompts x 8 samples, 512-token prompts and responses, two sidecar engines
    learn = ["--model.path", str(tmp_path), "--rl.algo", "grpo", "--rollout.placement", "sidecar",
             "--rl.prompts_per_step", "32", "--rollout.n_samples", "8", "--rollout.max_new_tokens", "512",
             "--data.max_prompt_len", "512", "--rollout.backend", "vllm", "--run.max_gpu_memory_gb", "30"]
    split = choose_split(parse_config(learn, ENGINES), int(80 * GiB))
    off = choose_split(parse_config([*learn, "--model.gradient_checkpointing", "false"], ENGINES), int(80 * GiB))
    assert split.gradient_checkpointing and "model.gradient_checkpointing" in split.picked
    assert not off.gradient_checkpointing and "model.gradient_checkpointing" in off.user  # the user's, kept
    assert split.micro_batch_tokens >= 4 * off.micro_batch_tokens, (split.micro_batch_tokens, off.micro_batch_tokens)
    assert "gradient checkpointing" in split.line(30) and split.device.total <= 30 * GiB * (1 - MARGIN)
    cfg = parse_config(learn, ENGINES)
    apply_split(cfg, split)
    assert cfg.model.gradient_checkpointing and cfg.data.micro_batch_tokens == split.micro_batch_tokens
    # the 0.5B bench shape at 48 GiB: its micro-batch without checkpointing is already large in work, kept as it is
    bench = choose_split(parse_config(bench_args(qwen, 48), ENGINES), H200)
    assert not bench.gradient_checkpointing and "model.gradient_checkpointing" not in bench.picked


def test_fewer_sidecar_engines_only_when_the_count_is_not_the_users(qwen):
    cfg = parse_config(bench_args(qwen, 26), ENGINES)  # two engines (a weight copy, warm-up and context each) leave
    # the trainer too little
    split = choose_split(cfg, H200)
    assert split.sidecar_engines == 1 and "rollout.sidecar_engines" in split.picked
    assert any("2 sidecar engines do not fit" in r for r in split.reasons)
    with pytest.raises(ConfigError, match="no split of the cap fits"):
        choose_split(parse_config(bench_args(qwen, 26, "--rollout.sidecar_engines", "2")), H200)


def test_a_cap_too_small_for_anything_is_one_config_error_line(qwen):
    cfg = parse_config(bench_args(qwen, 6), ENGINES)
    with pytest.raises(ConfigError) as err:
        preflight.check_memory_cap(cfg, "rl", total_bytes=H200)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("run.max_gpu_memory_gb=6: no split of the cap fits this rl run")
    assert "to fit:" in msg


def test_preflight_applies_and_prints_the_split(qwen, capsys):
    cfg = parse_config(bench_args(qwen, 48), ENGINES)
    preflight.check_memory_cap(cfg, "rl", total_bytes=H200)
    line = capsys.readouterr().out.strip()
    assert line.startswith("[rl] run.max_gpu_memory_gb=48: vLLM 0.0") and "of the GPU" in line
    assert f"micro-batch {cfg.data.micro_batch_tokens} tokens (planned device peak" in line
    assert cfg.data.micro_batch_tokens > 0 and cfg.rollout.gpu_memory_utilization < 0.5


def test_the_plan_counts_the_sidecar_engines_on_the_training_gpu(qwen):
    cfg = parse_config(bench_args(qwen, 0, "--rollout.gpu_memory_utilization", "0.3",
                                  "--data.micro_batch_tokens", "8192"), ENGINES)
    plan = planned(cfg, 141)
    vllm = next(r for r in plan.roles if r.role == "vllm")
    budget = vllm.params + vllm.activations + vllm.kv_cache
    assert budget == int(0.3 * 141 * GiB)
    actor = next(r for r in plan.roles if r.role == "actor")
    assert plan.phases["rollout"] == actor.resident + budget  # awake in both phases, whatever rollout.sleep says
    assert plan.phases["train"] == actor.states + actor.buffers + actor.activations + budget


def test_memory_cli_prints_the_split_for_a_cap(qwen, capsys):
    args = ["--gpu-memory-gb", "141", *bench_args(qwen, 48, "--rollout.sidecar_engines", "2")]
    assert memory_cli.main(args) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("split: [rl] run.max_gpu_memory_gb=48: vLLM 0.0") and "; 2 engines, yours)" in first
    assert "48.00 GiB)" in out.splitlines()[2]  # the plan is for the cap, not the whole GPU
    assert memory_cli.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["split"]["picked"] == ["rollout.gpu_memory_utilization", "data.micro_batch_tokens"]
    assert data["settings"]["tokens"] == data["split"]["data.micro_batch_tokens"]
    assert data["settings"]["capacity"] == 48 * GiB
    assert memory_cli.main(["--gpu-memory-gb", "141", *bench_args(qwen, 6)]) == 1  # nothing fits
    assert "no split of the cap fits" in capsys.readouterr().err


def test_autotune_runs_only_candidates_that_fit_the_cap(qwen, tmp_path):
    base = bench_args(qwen, 48, "--rollout.sidecar_engines", "2")
    assert autotune._check(base, {"rollout.gpu_memory_utilization": 0.2}) == ("", "")
    status, why = autotune._check(base, {"rollout.gpu_memory_utilization": 0.85})
    assert status == "skipped" and why.startswith("does not fit the cap: run.max_gpu_memory_gb=48")
    ran = []

    def command(argv):
        ran.append(argv)
        return ["true"]

    knobs = {"rollout.gpu_memory_utilization": [0.2, 0.85], "data.micro_batch_tokens": [4096, 8192, 131072]}
    search = autotune.run_search(base, knobs, tmp_path, budget_s=600, command=command, log=lambda _: None)
    assert [t.status for t in search.trials] == ["no-metrics", "skipped", "no-metrics", "skipped"]
    assert len(ran) == 2 and all("0.85" not in a and "131072" not in a for a in ran)


def load_bench(monkeypatch, name: str = "rl_step_gpu"):
    """bench/<name>.py as a module, its folder first on the path as when the script runs (it imports its siblings)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_flag_leaves_the_split_to_the_run_and_keeps_the_defaults(tmp_path, monkeypatch):
    bench = load_bench(monkeypatch)

    def argv_for(*flags):
        monkeypatch.setattr("sys.argv", ["rl_step_gpu.py", *flags])
        captured = {}
        monkeypatch.setattr(bench, "run_one", lambda args, *a, **k: captured.update(args=args))
        monkeypatch.setattr(bench, "build_model", lambda *a: tmp_path)
        monkeypatch.setattr(bench, "build_prompts", lambda *a: tmp_path)
        bench.main()
        args = captured["args"]
        return bench.config_argv(args, tmp_path, tmp_path, "sidecar", tmp_path / "run", [])

    def value(argv, key):
        return argv[argv.index(key) + 1] if key in argv else None

    argv, defaults = argv_for("--workdir", str(tmp_path))
    assert defaults == {} and "--run.max_gpu_memory_gb" not in argv  # the default bench run, unchanged
    assert (value(argv, "--rollout.gpu_memory_utilization"), value(argv, "--data.micro_batch_tokens"),
            value(argv, "--rollout.sidecar_engines")) == ("0.35", "49152", "2")

    argv, defaults = argv_for("--workdir", str(tmp_path), "--max-gpu-memory-gb", "48")
    assert value(argv, "--run.max_gpu_memory_gb") == "48" and defaults == ENGINES
    left = {"--rollout.gpu_memory_utilization", "--data.micro_batch_tokens", "--rollout.sidecar_engines"}
    assert not left & set(argv)
    cfg = parse_config(argv, defaults)
    assert not set(KEYS) & cfg.given and cfg.rollout.sidecar_engines == 2

    argv, _ = argv_for("--workdir", str(tmp_path), "--max-gpu-memory-gb", "48", "--gpu-mem", "0.2")
    assert value(argv, "--rollout.gpu_memory_utilization") == "0.2" and "--data.micro_batch_tokens" not in argv


def test_bench_records_each_process_at_the_device_peak(monkeypatch):
    import os
    import subprocess
    import sys

    bench = load_bench(monkeypatch, "process_memory")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me = os.getpid()
        assert bench.ProcessMemory.role(me) == "trainer" and bench.ProcessMemory.role(child.pid) == "engine"
        assert bench.ProcessMemory.role(1) == "other"
        # three reads (device used GiB, {pid: GiB}): the device peaks at the second, the child's own peak is the third
        reads = iter([(20.0, {me: 6.0, child.pid: 6.3}), (50.6, {me: 37.3, child.pid: 6.4}),
                      (40.0, {me: 27.0, child.pid: 6.5, 999999999: 0.5})])
        processes = bench.ProcessMemory(read=lambda: next(reads))
        for _ in range(3):
            processes.sample()
    finally:
        child.kill()
        child.wait()
    out = processes.summary()  # after the child has exited, as the engines have when a run ends
    peak = out["at_device_peak"]
    assert peak["device_used_gib"] == 50.6 and peak["processes_gib"] == pytest.approx(43.7)
    assert [(p["role"], p["used_gib"]) for p in peak["processes"]] == [("trainer", 37.3), ("engine", 6.4)]
    assert {p["role"]: p["used_gib"] for p in out["process_peaks"]} == {"trainer": 37.3, "engine": 6.5, "other": 0.5}
