"""`ds-rlhf memory`: the plan's model states match a real AdamW step; roles, ZeRO, LoRA, vLLM and the fit verdict."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ds_rlhf.algos.distill import generalized_jsd
from ds_rlhf.config import parse_config
from ds_rlhf.engines.memory import activation_bytes
from ds_rlhf.memory.device import device_peak
from ds_rlhf.memory.kv_cache import kv_bytes_per_token
from ds_rlhf.memory.plan import JSD_FP32_TENSORS, GiB, plan_memory
from ds_rlhf.memory.split import MARGIN, choose_split
from ds_rlhf.ops import memory as memory_cli
from ds_rlhf.recipes.policy_update import _logprobs_from_logits

# In a fresh process: load the model as the trainer's actor is loaded (fp32), take one AdamW step, then report
# (a) the bytes of every parameter, gradient and optimizer-state tensor (unique storages) and (b) the growth of
# the resident set over the build + step, measured after a warm-up step on the tiny model so lazy imports, thread
# pools and allocator set-up are not counted.
MEASURE = r"""
import gc, json, sys
import torch
from ds_rlhf.engines.models import load_causal_lm
from ds_rlhf.engines.model_source import resolve_model_path
torch.set_num_threads(1)

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def step(path):
    model = load_causal_lm(path, dtype="fp32", attn_impl="sdpa").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model, opt

warm = step(resolve_model_path("tiny"))
del warm
path = resolve_model_path(sys.argv[1])  # built here on a fresh checkout: not part of the measured growth
gc.collect()
before = rss()
model, opt = step(path)
gc.collect()
grown = rss() - before
storages = {}
for t in [p for p in model.parameters()] + [p.grad for p in model.parameters()] + [
        v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]:
    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
print(json.dumps({"tensor_bytes": sum(storages.values()), "rss_growth": grown}))
"""


def _plan(*args, device="cpu", capacity=16 * GiB, world_size=1, kind="rl"):
    return plan_memory(parse_config(list(args)), kind=kind, device=device, capacity=capacity, world_size=world_size)


def _tiny():
    from ds_rlhf.engines.tiny_models import build_tiny_model

    return build_tiny_model()


def _roles(plan):
    return {r.role: r for r in plan.roles}


@pytest.mark.parametrize("model", ["tiny:small"])
def test_actor_states_match_a_real_adamw_step(model):
    """Tolerances: the tensor bytes within 0.1% (the only difference is AdamW's 4-byte `step` counters);
    the resident-set growth between 50% and 200% of the plan (allocator page reuse and one-time buffers)."""
    out = subprocess.run([sys.executable, "-c", MEASURE, model], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    actor = _roles(_plan("--model.path", model, "--zero_stage", "0", "--model.dtype", "fp32"))["actor"]
    assert actor.params == actor.grads and actor.optimizer_states == 2 * actor.params  # fp32: 4 + 4 + 8 bytes
    assert abs(measured["tensor_bytes"] - actor.states) <= 0.001 * actor.states, (measured, actor)
    # RSS is a coarse cross-check only: glibc reuses pages the warm-up step freed (growth below the states, seen
    # 0.90x on a fresh clone) and one-time buffers come on top; the tensor bytes above are the exact check.
    assert 0.5 * actor.states <= measured["rss_growth"] <= 2.0 * actor.states, (measured, actor.states)


def test_roles_follow_the_algorithm():
    assert set(_roles(_plan("--rollout.backend", "hf"))) == {"actor", "rollout (HF)"}
    ppo = _roles(_plan("--rl.algo", "ppo", "--rl.kl_coef", "0.05", "--reward.model", "tiny",
                       "--rollout.backend", "hf"))
    assert set(ppo) == {"actor", "critic", "reference", "reward", "rollout (HF)"}
    hidden = __import__("transformers").AutoConfig.from_pretrained(_tiny()).hidden_size
    assert ppo["critic"].num_params == ppo["actor"].num_params + hidden  # the tied LM head adds none, a value head h
    assert ppo["reference"].grads == ppo["reference"].optimizer_states == 0
    assert set(_roles(_plan(kind="sft"))) == {"actor"}
    assert set(_roles(_plan(kind="rm"))) == {"reward"} and _roles(_plan(kind="rm"))["reward"].grads > 0


def test_zero_stages_divide_by_world_size():
    one = _roles(_plan("--zero_stage", "0", "--model.dtype", "bf16", "--rl.kl_coef", "0.1", world_size=4))
    two = _roles(_plan("--zero_stage", "2", "--model.dtype", "bf16", "--rl.kl_coef", "0.1", world_size=4))
    three = _roles(_plan("--zero_stage", "3", "--model.dtype", "bf16", "--rl.kl_coef", "0.1", world_size=4))
    n = one["actor"].num_params
    assert one["actor"].params == 2 * n and one["actor"].optimizer_states == 12 * n
    assert two["actor"].grads == 2 * n // 4 and two["actor"].optimizer_states == 12 * n // 4
    assert two["reference"].params == 2 * n  # frozen at ZeRO-2: a full replica (builder.frozen_config)
    assert three["actor"].params == 2 * n // 4 and three["reference"].params == 2 * n // 4
    assert three["actor"].grads == 2 * (2 * n // 4) and three["actor"].resident == three["actor"].states  # fp32, kept
    # ZeRO's gradient-reduction bucket (reduce_bucket_size "auto" -> DeepSpeed's 5e8 elements) for trained roles
    assert two["actor"].buffers == 500_000_000 * 2 and one["actor"].buffers == two["reference"].buffers == 0
    plan = _plan("--zero_stage", "2", "--model.dtype", "bf16", "--rollout.backend", "hf", world_size=4)
    actor, hf = _roles(plan)["actor"], _roles(plan)["rollout (HF)"]
    assert plan.phases["rollout"] == actor.params + actor.optimizer_states + hf.device_total  # no gradients then
    assert plan.phases["train"] == actor.device_total + hf.device_total
    off = _roles(_plan("--zero_stage", "3", "--offload", "true", "--model.dtype", "bf16", world_size=4))["actor"]
    assert off.optimizer_states == 0 and off.params == 0 and off.host == 2 * n // 4 + 12 * n // 4


def test_lora_trains_only_the_adapters():
    full = _roles(_plan("--zero_stage", "0"))["actor"]
    lora = _roles(_plan("--zero_stage", "0", "--model.lora_rank", "4"))["actor"]
    assert lora.num_params > full.num_params and 0 < lora.grads < full.grads / 10
    assert "trainable" in lora.detail


def test_lora_reward_model_trains_only_its_adapters_and_score_in_an_rm_run():
    full = _roles(_plan("--zero_stage", "0", kind="rm"))["reward"]
    lora = _roles(_plan("--zero_stage", "0", "--model.lora_rank", "4", kind="rm"))["reward"]
    assert lora.num_params > full.num_params and 0 < lora.grads < full.grads / 10
    assert "trainable" in lora.detail
    # in an RL run the reward model is frozen: LoRA settings (the actor's) add nothing to it
    frozen = _roles(_plan("--zero_stage", "0", "--model.lora_rank", "4", "--reward.model", "tiny"))["reward"]
    assert frozen.grads == 0 and frozen.num_params == full.num_params


def test_chunked_head_keeps_no_full_logits(tmp_path):
    """The actor's log-prob head costs one chunk's logits plus 12 bytes a token, not [tokens x vocab] fp32."""
    from transformers import AutoConfig, Qwen2Config

    Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True).save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    heads = {}
    for tokens in (16384, 32768):
        plan = _plan("--model.path", str(tmp_path), "--data.micro_batch_tokens", str(tokens), "--rollout.backend",
                     "hf", device="cuda", capacity=80 * GiB)
        body = activation_bytes(cfg, tokens, 2, gradient_checkpointing=False, lm_head=False)
        heads[tokens] = _roles(plan)["actor"].activations - body
        assert 0 < heads[tokens] < tokens * cfg.vocab_size * 4 / 2
    assert heads[32768] - heads[16384] == 16384 * 12


def test_vllm_budget_and_kv_cache(tmp_path, monkeypatch):
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False).save_pretrained(tmp_path)
    args = ("--model.path", str(tmp_path), "--rollout.backend", "vllm", "--rollout.gpu_memory_utilization", "0.4")
    plan = _plan(*args, "--zero_stage", "3", device="cuda", capacity=80 * GiB, world_size=8)
    vllm = _roles(plan)["vllm"]
    assert vllm.params + vllm.activations + vllm.kv_cache == int(0.4 * 80 * GiB)  # the budget vLLM claims
    assert kv_bytes_per_token(__import__("transformers").AutoConfig.from_pretrained(tmp_path), 2) == 57344
    assert plan.fits and plan.phases["rollout"] > plan.phases["train"]  # vLLM sleeps while DeepSpeed trains
    crowded = _plan(*args, "--zero_stage", "2", "--rl.algo", "ppo", "--rl.kl_coef", "0.1", device="cuda",
                    capacity=80 * GiB, world_size=8)
    assert not crowded.fits and any("zero_stage 3" in n or "gpu_memory_utilization" in n for n in crowded.notes)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cpu = _roles(_plan("--rollout.backend", "vllm"))["vllm"]
    assert cpu.kv_cache == GiB
    # rollout.sidecar_engines: every sidecar engine holds its own weights and profiling pass inside the one budget
    sidecar = ("--model.path", str(tmp_path), "--rollout.backend", "vllm", "--rollout.placement", "sidecar")
    one = _roles(_plan(*sidecar, "--rollout.gpu_memory_utilization", "0.9", device="cuda", capacity=80 * GiB))["vllm"]
    three = _plan(*sidecar, "--rollout.gpu_memory_utilization", "0.9", "--rollout.sidecar_engines", "3",
                  device="cuda", capacity=80 * GiB)
    v3 = _roles(three)["vllm"]
    assert (v3.params, v3.activations) == (3 * one.params, 3 * one.activations)
    assert v3.params + v3.activations + v3.kv_cache == int(0.9 * 80 * GiB) and 0 < v3.kv_cache < one.kv_cache
    assert "over 3 sidecar engines" in v3.detail
    tight = _plan(*sidecar, "--rollout.gpu_memory_utilization", "0.4", "--rollout.sidecar_engines", "3",
                  device="cuda", capacity=80 * GiB)  # 3 x 15 GiB of weights > 32 GiB
    assert not tight.fits and any("fewer rollout.sidecar_engines (3" in n for n in tight.notes), tight.notes


def test_cli_table_json_and_exit_status(tmp_path, capsys):
    assert memory_cli.main(["--device", "cpu", "--rollout.backend", "hf", "--world-size", "1"]) == 0
    table = capsys.readouterr().out
    assert "actor" in table and "FITS" in table and "train phase peak" in table
    assert memory_cli.main(["--gpu-memory-gb", "0.001", "--json", "--rollout.backend", "hf"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and plan["settings"]["device"] == "cuda" and plan["roles"][0]["role"] == "actor"
    assert memory_cli.main(["--rl.algo", "nonsense"]) == 2


def test_share_base_critic_holds_only_its_adapters_and_value_head():
    """With model.share_base the PPO critic is LoRA adapters + a value head on the actor's base
    (engines/shared_critic.py): no base weights of its own, the same trained states and activations."""
    from transformers import AutoConfig

    args = ("--rl.algo", "ppo", "--model.lora_rank", "4", "--zero_stage", "2", "--rollout.backend", "hf",
            "--rl.kl_coef", "0")
    own_plan, shared_plan = _plan(*args), _plan(*args, "--model.share_base", "true")
    own, shared = _roles(own_plan), _roles(shared_plan)
    sep, crit = own["critic"], shared["critic"]
    hidden = AutoConfig.from_pretrained(_tiny()).hidden_size
    assert crit.num_params == own["actor"].grads // 4 + hidden  # the actor's adapter count (fp32) + a value head
    assert crit.params == crit.grads == 4 * crit.num_params  # everything it holds trains (fp32 plan)
    assert (crit.grads, crit.optimizer_states, crit.activations, crit.buffers, crit.host) == (
        sep.grads, sep.optimizer_states, sep.activations, sep.buffers, sep.host)
    base = sep.params - crit.params  # the separate LoRA critic's frozen base, bytes
    assert base == 4 * (sep.num_params - crit.num_params) > 0
    assert "share_base" in crit.detail and "no base weights" in crit.detail
    assert shared["actor"] == own["actor"]
    for phase in ("rollout", "train"):
        assert own_plan.phases[phase] - shared_plan.phases[phase] == base, phase
    # ZeRO-3 with a critic on the shared base is refused by the trainer (rl_build.check_share_base_critic)
    zero3 = _plan(*args[:4], "--zero_stage", "3", *args[6:], "--model.share_base", "true")
    assert not zero3.fits and any(n.startswith("FAIL: model.share_base with a critic") for n in zero3.notes)


@pytest.fixture(scope="module")
def rm_adapter(tmp_path_factory):
    """A LoRA RM adapter of the tiny model as peft writes it (SEQ_CLS, trained score), and its trained count."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    seqcls = AutoModelForSequenceClassification.from_pretrained(_tiny(), num_labels=1)
    peft = get_peft_model(seqcls, LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules="all-linear"))
    out = tmp_path_factory.mktemp("rm_adapter")
    peft.save_pretrained(out)
    return str(out), sum(p.numel() for p in peft.parameters() if p.requires_grad)  # adapters + the score copy


def test_share_base_lora_rm_adapter_holds_only_its_adapters_and_score(rm_adapter):
    path, trained = rm_adapter
    args = ("--model.lora_rank", "4", "--zero_stage", "2", "--rollout.backend", "hf", "--rl.kl_coef", "0")
    shared_plan = _plan(*args, "--reward.model", path, "--model.share_base", "true")
    separate_plan = _plan(*args, "--reward.model", path)  # no share_base: its own frozen model of the base
    rm, sep = _roles(shared_plan)["reward"], _roles(separate_plan)["reward"]
    full = _roles(_plan(*args, "--reward.model", "tiny"))["reward"]  # a full RM of the same shape
    assert rm.num_params == trained and rm.params == 4 * trained  # adapters + score head, fp32 plan
    assert rm.grads == rm.optimizer_states == rm.host == 0 and rm.activations == full.activations > 0
    assert "share_base" in rm.detail and "no base weights" in rm.detail
    assert sep == full  # the adapter planned separately: a whole RM of its base
    for phase in ("rollout", "train"):
        assert separate_plan.phases[phase] - shared_plan.phases[phase] == sep.params - rm.params, phase
    # what shared_reward.py keeps separate keeps its whole row: a full RM, or the adapter at ZeRO-3
    full_shared = _roles(_plan(*args, "--reward.model", "tiny", "--model.share_base", "true"))["reward"]
    assert full_shared == full
    zero3 = _roles(_plan(*args[:2], "--zero_stage", "3", *args[4:], "--reward.model", path,
                         "--model.share_base", "true"))["reward"]
    assert zero3.num_params == full.num_params and "share_base" not in zero3.detail


def test_a_teacher_is_planned_as_the_reference_with_its_own_size(tmp_path):
    """On-policy distillation (`rl.teacher`): the reference row is the teacher model, a frozen copy of its own size,
    even with `model.share_base` (the teacher is not the actor's base)."""
    from transformers import AutoConfig

    student = AutoConfig.from_pretrained(_tiny())
    teacher = AutoConfig.from_pretrained(_tiny(), num_hidden_layers=2 * student.num_hidden_layers, layer_types=None)
    teacher.save_pretrained(tmp_path)
    roles = _roles(_plan("--rl.kl_coef", "1", "--rl.teacher", str(tmp_path), "--rollout.backend", "hf"))
    plain = _roles(_plan("--rl.kl_coef", "1", "--rollout.backend", "hf"))
    assert plain["reference"].num_params == roles["actor"].num_params
    assert roles["reference"].num_params > roles["actor"].num_params and roles["reference"].grads == 0
    assert student.num_hidden_layers < teacher.num_hidden_layers
    shared = _roles(_plan("--rl.kl_coef", "1", "--rl.teacher", str(tmp_path), "--model.lora_rank", "8",
                          "--model.share_base", "true", "--rollout.backend", "hf"))
    assert shared["reference"].num_params == roles["reference"].num_params


def _jsd_shape(tmp_path, vocab_size=1000):
    """A small Qwen2-shaped student (and teacher) of `vocab_size` tokens."""
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=vocab_size, tie_word_embeddings=True).save_pretrained(tmp_path)
    return str(tmp_path)


def test_the_jsd_loss_adds_both_models_response_logits_and_its_intermediates(tmp_path):
    """`rl.distill_loss jsd`: per micro-batch the actor's update holds the student's and the teacher's
    [response tokens, vocab] logits (bf16 here: 2 bytes each) and 14 fp32 tensors of that shape (8 at beta 0 or 1);
    the response tokens are micro_batch_size x max_new_tokens, or the whole token budget."""
    path = _jsd_shape(tmp_path)
    base = ("--model.path", path, "--rl.teacher", path, "--model.dtype", "bf16", "--optim.micro_batch_size", "2",
            "--data.max_prompt_len", "100", "--rollout.max_new_tokens", "64", "--rollout.backend", "hf")
    kl = _plan(*base, "--rl.kl_coef", "1", device="cuda", capacity=80 * GiB)  # the same teacher, sampled-token KL
    for extra, expected in (((), 2 * 64 * 1000 * (2 * 2 + 4 * 14)),
                            (("--rl.jsd_beta", "1"), 2 * 64 * 1000 * (2 * 2 + 4 * 8)),
                            (("--rl.jsd_beta", "0"), 2 * 64 * 1000 * (2 * 2 + 4 * 8)),
                            (("--data.micro_batch_tokens", "512"), 512 * 1000 * (2 * 2 + 4 * 14))):
        jsd = _plan(*base, "--rl.distill_loss", "jsd", *extra, device="cuda", capacity=80 * GiB)
        plain = kl if not extra or extra[0] != "--data.micro_batch_tokens" else _plan(
            *base, "--rl.kl_coef", "1", *extra, device="cuda", capacity=80 * GiB)
        assert _roles(jsd)["actor"].activations - _roles(plain)["actor"].activations == expected, extra
        assert jsd.phases["train"] - plain.phases["train"] == expected and jsd.peak - plain.peak == expected, extra
        assert jsd.phases["rollout"] == plain.phases["rollout"]
        assert _roles(jsd)["reference"] == _roles(plain)["reference"]
        assert "JSD logits" in _roles(jsd)["actor"].detail


def _measured_jsd_peak(n: int, vocab: int, dtype, beta: float) -> int:
    """Peak bytes (torch.profiler, CPU) of the actor step's JSD path on [n, vocab] logits: the student's logits
    (with a graph) and the teacher's, the generalized JSD, the student's log-probs and entropy from the same
    logits, and the backward."""
    weight = torch.randn(n, vocab, dtype=dtype, requires_grad=True)
    teacher_rows = torch.randn(n, vocab, dtype=dtype)
    targets = torch.randint(0, vocab, (n,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        student = weight * 1  # the head's output: a tensor of the graph
        teacher = teacher_rows.clone()
        jsd = generalized_jsd(student, teacher, beta=beta, temperature=0.7)
        del teacher
        logp, entropy = _logprobs_from_logits(student, targets, 0.7)
        del student
        (jsd + logp.sum() + entropy.sum()).backward()
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(("dtype", "beta"), [("float32", 0.5), ("bfloat16", 0.3), ("bfloat16", 1.0)])
def test_the_planned_jsd_bytes_match_the_measured_peak(dtype, beta):
    """The plan's per-token JSD bytes (`jsd_logits_bytes`) against the allocator peak of the real loss path on CPU
    (within 1%: the rest are scalars)."""
    n, vocab = 96, 3000
    act = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    planned = n * vocab * (2 * act + 4 * JSD_FP32_TENSORS["mixture" if 0 < beta < 1 else "one_kl"])
    measured = _measured_jsd_peak(n, vocab, getattr(torch, dtype), beta)
    assert abs(measured - planned) <= 0.01 * planned, (measured, planned)


def test_a_capped_split_gives_the_jsd_loss_a_smaller_micro_batch(tmp_path):
    """`run.max_gpu_memory_gb`: the split's micro-batch search plans the JSD logits, so a 150k-vocabulary JSD run
    gets a smaller micro-batch than the same run with the sampled-token KL, and its pick fits the cap."""
    path = _jsd_shape(tmp_path, vocab_size=151936)
    base = ["--model.path", path, "--rl.teacher", path, "--model.dtype", "bf16", "--rollout.backend", "hf",
            "--data.max_prompt_len", "512", "--rollout.max_new_tokens", "1536", "--rl.prompts_per_step", "64",
            "--run.max_gpu_memory_gb", "40"]
    kl = choose_split(parse_config([*base, "--rl.kl_coef", "1"]), 80 * GiB)
    jsd = choose_split(parse_config([*base, "--rl.distill_loss", "jsd"]), 80 * GiB)
    print("capped split, micro-batch tokens: kl", kl.micro_batch_tokens, "jsd", jsd.micro_batch_tokens)
    assert jsd.micro_batch_tokens < kl.micro_batch_tokens, (jsd.micro_batch_tokens, kl.micro_batch_tokens)
    picked = _plan(*base, "--rl.distill_loss", "jsd", "--data.micro_batch_tokens", str(jsd.micro_batch_tokens),
                   device="cuda", capacity=40 * GiB)
    vocab_logits = jsd.micro_batch_tokens * 151936 * (2 * 2 + 4 * 14)
    assert _roles(picked)["actor"].activations > vocab_logits and picked.peak == jsd.peak
    cfg = parse_config([*base, "--rl.distill_loss", "jsd", "--data.micro_batch_tokens", str(jsd.micro_batch_tokens)])
    assert device_peak(cfg, picked).total <= 40 * GiB * (1 - MARGIN) and jsd.device == device_peak(cfg, picked)
