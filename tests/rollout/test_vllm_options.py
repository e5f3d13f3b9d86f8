"""vLLM engine options (rollout.async_scheduling, max_num_seqs, max_num_batched_tokens, cudagraph_sizes,
enforce_eager): refused at parse time when malformed, absent from the engine arguments at their defaults, and
passed to `vllm.LLM(...)` through every placement (colocated; sidecar and disaggregated through the server's
'start'). `vllm.LLM` is replaced by a recorder that stops before an engine starts, so no vLLM engine runs here."""

from __future__ import annotations

import pytest
from rollout_helpers import LLMBuilt

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rollout.base import RolloutError
from ds_rlhf.rollout.vllm_adapter import engine_arg_names, engine_option_kwargs
from ds_rlhf.rollout.vllm_mapping import ENGINE_OPTIONS

pytest.importorskip("vllm")

OPTIONS = ["--rollout.async_scheduling", "true", "--rollout.max_num_seqs", "256",
           "--rollout.max_num_batched_tokens", "8192", "--rollout.cudagraph_sizes", "64,8,16"]


def test_defaults_pass_no_engine_option():
    assert parse_config([]).rollout.vllm_options() == {}
    assert engine_option_kwargs(cpu=False, version="x") == {"logprobs_mode": "processed_logprobs",
                                                              "enforce_eager": False}
    assert engine_option_kwargs(cpu=True, version="x") == {"logprobs_mode": "processed_logprobs",
                                                             "enforce_eager": True}


def test_config_options_become_engine_arguments():
    opts = parse_config(OPTIONS).rollout.vllm_options()
    assert opts == {"async_scheduling": True, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                    "cudagraph_sizes": [64, 8, 16]}
    kw = engine_option_kwargs(cpu=False, version="x", **opts)
    assert kw == {"logprobs_mode": "processed_logprobs", "enforce_eager": False, "async_scheduling": True,
                  "max_num_seqs": 256, "max_num_batched_tokens": 8192, "cudagraph_capture_sizes": [8, 16, 64]}
    assert engine_option_kwargs(cpu=False, version="x", **parse_config(
        ["--rollout.async_scheduling", "false", "--rollout.enforce_eager", "true"]).rollout.vllm_options()) == {
        "logprobs_mode": "processed_logprobs", "enforce_eager": True, "async_scheduling": False}


def test_every_option_exists_in_the_installed_vllm():
    names = engine_arg_names()
    assert {"logprobs_mode", *ENGINE_OPTIONS.values()} <= names


def test_an_option_the_installed_vllm_lacks_is_refused_naming_it_and_the_version():
    names = engine_arg_names() - {"async_scheduling"}
    with pytest.raises(RolloutError, match=r"vLLM 0\.26\.0 does not support rollout\.async_scheduling"):
        engine_option_kwargs(cpu=False, version="0.26.0", arg_names=names, async_scheduling=True)
    engine_option_kwargs(cpu=False, version="0.26.0", arg_names=names)  # at its default it is not passed
    with pytest.raises(RolloutError, match=r"vLLM 0\.25\.0 has no logprobs_mode='processed_logprobs'"):
        engine_option_kwargs(cpu=False, version="0.25.0", modes=("raw_logprobs", "raw_logits"))


def test_cpu_refuses_async_scheduling_and_ignores_cudagraph_sizes():
    with pytest.raises(RolloutError, match="rollout.async_scheduling=true: vLLM 0.32.0 on CPU"):
        engine_option_kwargs(cpu=True, version="0.32.0", async_scheduling=True)
    kw = engine_option_kwargs(cpu=True, version="0.32.0", async_scheduling=False, cudagraph_sizes=[8])
    assert kw["async_scheduling"] is False and "cudagraph_capture_sizes" not in kw
    with pytest.raises(RolloutError, match="eager mode captures no CUDA graphs"):
        engine_option_kwargs(cpu=False, version="x", enforce_eager=True, cudagraph_sizes=[8])


@pytest.mark.parametrize("argv, message", [
    (["--rollout.async_scheduling", "yes"], "rollout.async_scheduling='yes': choose one of auto, true, false"),
    (["--rollout.max_num_seqs", "-1"], "rollout.max_num_seqs=-1: must be >= 0"),
    (["--rollout.max_num_batched_tokens", "-8"], "rollout.max_num_batched_tokens=-8: must be >= 0"),
    (["--rollout.cudagraph_sizes", "8,x"], "rollout.cudagraph_sizes='8,x': give a comma list"),
    (["--rollout.cudagraph_sizes", "0,8"], "rollout.cudagraph_sizes='0,8': give a comma list"),
    (["--rollout.cudagraph_sizes", "8", "--rollout.enforce_eager", "true"], "eager mode captures no CUDA graphs"),
    (["--rollout.max_num_seqs", "512", "--rollout.max_num_batched_tokens", "256"],
     "rollout.max_num_batched_tokens=256 is smaller than rollout.max_num_seqs=512"),
    (["--rollout.cudagraph_sizes", "8,512", "--rollout.max_num_batched_tokens", "256"], "can never run"),
    (["--rollout.enforce_eager", "maybe"], "bad value 'maybe' for 'rollout.enforce_eager'"),
])
def test_bad_option_values_are_refused_at_parse_time(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_config(argv)


def test_yaml_booleans_read_as_the_async_scheduling_choice(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  async_scheduling: false\n")
    assert parse_config(["--config", str(path)]).rollout.async_scheduling == "false"


def test_colocated_engine_passes_the_options_to_llm(tiny_model_path, llm_calls, as_gpu):
    from ds_rlhf.rollout import make_rollout_engine

    with pytest.raises(LLMBuilt):
        make_rollout_engine("vllm", "colocated", model_path=str(tiny_model_path), max_model_len=256,
                            **parse_config(OPTIONS).rollout.vllm_options())
    (kw,) = llm_calls
    assert {k: kw[k] for k in ("async_scheduling", "max_num_seqs", "max_num_batched_tokens",
                               "cudagraph_capture_sizes", "logprobs_mode", "enforce_eager")} == {
        "async_scheduling": True, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
        "cudagraph_capture_sizes": [8, 16, 64], "logprobs_mode": "processed_logprobs", "enforce_eager": False}


def test_default_colocated_engine_arguments_are_unchanged(tiny_model_path, llm_calls, as_gpu):
    from ds_rlhf.rollout import make_rollout_engine

    with pytest.raises(LLMBuilt):
        make_rollout_engine("vllm", "colocated", model_path=str(tiny_model_path), max_model_len=256,
                            **parse_config([]).rollout.vllm_options())
    (kw,) = llm_calls
    assert not {"async_scheduling", "max_num_seqs", "max_num_batched_tokens", "cudagraph_capture_sizes"} & set(kw)
    assert kw["enforce_eager"] is False and kw["logprobs_mode"] == "processed_logprobs"


@pytest.mark.parametrize("placement", ["sidecar", "disaggregated"])
def test_server_placements_pass_the_options_to_llm(placement, tiny_model_path, llm_calls, as_gpu, monkeypatch):
    """The client sends its engine keywords in 'start'; the server builds its VLLMRolloutEngine from them."""
    from ds_rlhf.rollout import make_rollout_engine
    from ds_rlhf.rollout.server import client as remote
    from ds_rlhf.rollout.server import server as remote_server
    from ds_rlhf.rollout.server.client import RemoteVLLMEngine

    sent = {}

    def fake_start(self, process, model_path, startup_timeout_s, engine_kwargs):
        sent.update(process=process, model_path=model_path, kwargs=engine_kwargs)
        return {"error": "stopped before starting a server"}

    monkeypatch.setattr(remote, "ServerProcess", lambda **kw: ("no process", kw))  # nothing is spawned
    monkeypatch.setattr(RemoteVLLMEngine, "_start", fake_start)
    with pytest.raises(RolloutError, match="stopped before"):
        make_rollout_engine("vllm", placement, model_path=str(tiny_model_path), max_model_len=256,
                            **parse_config(OPTIONS).rollout.vllm_options())
    assert sent["kwargs"]["max_num_seqs"] == 256 and sent["kwargs"]["cudagraph_sizes"] == [64, 8, 16]
    assert sent["process"][0] == "no process"  # the engine spawned its own server (none was handed to it)
    with pytest.raises(LLMBuilt):
        remote_server.ServerSession().handle("start", (sent["model_path"], sent["kwargs"]))
    (kw,) = llm_calls
    assert (kw["async_scheduling"], kw["max_num_seqs"], kw["max_num_batched_tokens"],
            kw["cudagraph_capture_sizes"], kw["logprobs_mode"]) == (True, 256, 8192, [8, 16, 64],
                                                                     "processed_logprobs")


def test_hf_backend_says_it_ignores_the_vllm_options(tiny_model_path, caplog):
    import logging

    from ds_rlhf.rollout import make_rollout_engine

    with caplog.at_level(logging.WARNING, logger="ds_rlhf.rollout.factory"):
        engine = make_rollout_engine("hf", model_path=str(tiny_model_path), dtype="float32", max_num_seqs=64)
    engine.close()
    assert "ignores the vLLM engine options rollout.max_num_seqs=64" in caplog.text


def test_the_trainer_builds_its_engine_with_the_configured_options(tiny_model_path, llm_calls, tmp_path,
                                                                   dist_single):
    """RL runs: rl_build.build_parts hands the config's vLLM options to the engine it builds (vLLM backend)."""
    from ds_rlhf.data.synthetic import write_addition_datasets
    from ds_rlhf.recipes.rl import RLTrainer

    stores = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=16, n_sft=8, n_pref=8,
                                     max_operand=20)
    argv = ["--model.path", str(tiny_model_path), "--data.train", str(stores["prompts"]), "--run.output_dir",
            str(tmp_path / "run"), "--rollout.backend", "vllm", "--rollout.max_num_seqs", "64",
            "--rollout.max_num_batched_tokens", "4096", "--reward.fn", "math_shaped", "--run.progress", "false",
            "--run.tensorboard", "false"]
    with pytest.raises(LLMBuilt):
        RLTrainer(parse_config(argv))
    assert llm_calls[-1]["max_num_seqs"] == 64 and llm_calls[-1]["max_num_batched_tokens"] == 4096
