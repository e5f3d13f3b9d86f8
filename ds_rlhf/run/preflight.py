"""Checks of a run's inputs that need the filesystem, made before any process group, model or vLLM engine starts.

The schema (`ds_rlhf.config`) already refused bad keys, bad choices, out-of-range numbers and conflicting options.
What is left needs to look at files: the model, tokenizer, reward model and critic sources (a local directory, or a
Hugging Face Hub id resolved to its cached snapshot, downloaded only when online: `engines/model_source.py`), the
prompt store (opened, which verifies its checksums and statistics; the held-out eval store too when RL evaluation
is on), the RL sequence budget against the models' context (config.json), the reward function file,
the resume directory, the DeepSpeed config, and the
low-memory mode: `model.share_base` needs LoRA, and with `run.max_gpu_memory_gb` an RL run takes the split of the
cap its memory plan picks for what the user left unset (`memory/split.py`), then the run's memory plan (from the
models' config.json files only) must fit the cap (`memory/cap.py`). Each
problem is one `ConfigError` naming the key, the value and what to do, so a run that would fail hours in (a prompt
longer than the rollout budget, say) fails at once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ds_rlhf.config import Config
from ds_rlhf.data.store import StoreMismatchError, open_store
from ds_rlhf.data.store_checks import StoreFormatError
from ds_rlhf.ds_config_file import load_ds_config
from ds_rlhf.engines import kernels
from ds_rlhf.engines.ds_config import check_top_level_keys
from ds_rlhf.engines.model_source import resolve_model_source
from ds_rlhf.engines.rm_head import check_causal_lm_dir, check_reward_model_dir
from ds_rlhf.errors import ConfigError
from ds_rlhf.memory import cap as memory_cap
from ds_rlhf.memory.plan import jsd_bytes_per_token, jsd_response_tokens
from ds_rlhf.memory.settings import sequence_tokens
from ds_rlhf.memory.split import apply_split, choose_split
from ds_rlhf.redaction import redact_urls
from ds_rlhf.rewards.builtin import BUILTIN_REWARDS
from ds_rlhf.rewards.judge import endpoint
from ds_rlhf.rewards.judge_template import read_template
from ds_rlhf.rewards.loading import check_spec, split_style
from ds_rlhf.rewards.remote import check_remote, is_remote
from ds_rlhf.rewards.reward_set import parse_weights
from ds_rlhf.run.context import find_ds_config


def _manifest(store_dir: str, key: str) -> dict:
    path = Path(store_dir) / "manifest.json"
    if not Path(store_dir).is_dir():
        raise ConfigError(f"{key}={store_dir!r}: no such directory (prepare one with data_prep/prep_*.py)")
    if not path.is_file():
        raise ConfigError(f"{key}={store_dir!r} is not a data store: {path} is missing (prepare it with "
                          "data_prep/prep_*.py)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}={store_dir!r}: unreadable manifest {path}: {exc}") from None


PREP_SCRIPTS = {"prompts": "prep_prompts.py or prep_gsm8k.py", "sft": "prep_sft.py, or prep_gsm8k.py --kind sft",
                "preference": "prep_preferences.py"}


def check_store(store_dir: str, key: str, kind: str) -> dict:
    """The store at `store_dir` (the value of config key `key`) exists, is of `kind` and has rows; its manifest.
    The store is opened, which verifies its checksums and that the manifest's row counts and token statistics are
    the data's (`data/store.py`), so a modified store is refused here, in seconds."""
    if not store_dir:
        raise ConfigError(f"{key} is empty: pass --{key} <{kind} store dir> (data_prep/{PREP_SCRIPTS[kind]})")
    manifest = _manifest(store_dir, key)
    if manifest.get("kind") != kind:
        raise ConfigError(f"{key}={store_dir!r} holds a {manifest.get('kind')!r} store; this run needs a {kind!r} "
                          f"store (data_prep/{PREP_SCRIPTS[kind]})")
    if not manifest.get("rows"):
        raise ConfigError(f"{key}={store_dir!r} holds no rows")
    with _opened(store_dir, key):
        pass
    return manifest


def _opened(store_dir: str, key: str):
    """The store opened with the mmap reader (verified on open); a store that does not verify is one ConfigError."""
    try:
        return open_store(store_dir, reader="mmap")
    except (StoreFormatError, StoreMismatchError, OSError) as exc:
        raise ConfigError(f"{key}={store_dir!r}: {exc}") from None


def check_prompt_store(cfg: Config, key: str = "data.train") -> None:
    """The prompt store of config key `key` (data.train, or data.eval for RL evaluation) exists, holds prompts,
    and none is longer than data.max_prompt_len (unless data.overlong_prompts drops them). The lengths are the
    store's lengths file, verified against its checksum on open, not the manifest's statistics."""
    store_dir = getattr(cfg.data, key.split(".", 1)[1])
    check_store(store_dir, key, "prompts")
    with _opened(store_dir, key) as store:
        longest = int(store.column_lengths("input_ids").max())
    if longest > cfg.data.max_prompt_len and cfg.data.overlong_prompts == "error":
        raise ConfigError(
            f"{key}={store_dir!r} has prompts of up to {longest} tokens but data.max_prompt_len is "
            f"{cfg.data.max_prompt_len}: raise --data.max_prompt_len to {longest} (the rollout context grows with "
            "it), re-run data prep with a lower --max-prompt-len, or pass --data.overlong_prompts drop")


def rl_eval_on(cfg: Config) -> bool:
    """Whether an RL run evaluates on held-out prompts (run.eval_every > 0 or run.eval_before_train)."""
    return cfg.run.eval_every > 0 or cfg.run.eval_before_train


def check_rl_eval(cfg: Config) -> None:
    """With evaluation on: data.eval is a prompts store whose prompts fit, and there is a reward function for it."""
    if not rl_eval_on(cfg):
        if cfg.data.eval and not Path(cfg.data.eval).is_dir():  # not read, but likely a mistake: say so
            print(f"[preflight] warning: data.eval={cfg.data.eval!r}: no such directory; evaluation is off "
                  "(run.eval_every=0, run.eval_before_train=false), so it is not used", flush=True)
        return
    why = (f"run.eval_every={cfg.run.eval_every}" if cfg.run.eval_every > 0 else "run.eval_before_train=true")
    if not cfg.data.eval:
        raise ConfigError(f"{why} evaluates on held-out prompts: pass --data.eval <prompts store dir> "
                          f"(data_prep/{PREP_SCRIPTS['prompts']}), or turn evaluation off")
    check_prompt_store(cfg, "data.eval")
    if cfg.reward.model and not (cfg.eval.reward_fn or cfg.reward.fn or cfg.env.name):
        raise ConfigError(f"{why} with reward.model: evaluation scores with a reward function (pass@k needs a "
                          "verifiable reward): set --eval.reward_fn (gsm8k | math_shaped | file.py:func)")


def check_reward(cfg: Config) -> None:
    rl = cfg.rl
    if not cfg.reward.fn and not cfg.reward.model and not cfg.reward.judge and not rl.teacher and not cfg.env.name:
        raise ConfigError("no reward: set --reward.fn (gsm8k | format | math_shaped | file.py:func) or "
                          "--reward.model <reward model dir or Hub id> (or --env.name file.py:Name)")
    if cfg.reward.fn:
        _check_reward_spec("reward.fn", cfg.reward.fn, cfg.reward.weights)
    if cfg.reward.judge:
        _check_judge(cfg.reward.judge, cfg.reward.judge_prompt)
    if cfg.eval.reward_fn and rl_eval_on(cfg):
        _check_reward_spec("eval.reward_fn", cfg.eval.reward_fn, "")


def _check_reward_spec(key: str, spec: str, weights: str) -> None:
    parts = [split_style(p.strip())[0] for p in spec.split(",") if p.strip()]
    try:  # file exists, weights parse; the file itself is imported where it runs (worker pool or trainer)
        for part in parts:
            if part not in BUILTIN_REWARDS:
                check_spec(part)
        parse_weights(weights or None, len(parts))
    except (ValueError, OSError) as exc:
        raise ConfigError(redact_urls(f"{key}={spec!r}: {exc}")) from None


def _check_judge(judge: str, prompt_file: str) -> None:
    """The judge's template reads (known placeholders only) and a judge URL answers (`remote.check_remote`)."""
    try:
        read_template(prompt_file)
    except ValueError as exc:
        raise ConfigError(f"reward.judge_prompt={prompt_file!r}: {exc}") from None
    if is_remote(judge):
        try:
            check_remote(endpoint(judge)[0])
        except ValueError as exc:
            raise ConfigError(redact_urls(f"reward.judge={judge!r}: {exc}")) from None


def check_resume(cfg: Config) -> None:
    resume = cfg.run.resume
    if resume and resume != "latest" and not Path(resume).is_dir():
        raise ConfigError(f"run.resume={resume!r}: no such checkpoint directory (use 'latest' or a path to "
                          f"{cfg.run.output_dir}/checkpoints/step_XXXXXXXX)")


def check_ds_config(cfg: Config) -> None:
    try:
        path = find_ds_config(cfg.ds_config)
    except FileNotFoundError as exc:
        raise ConfigError(f"ds_config={cfg.ds_config!r}: {exc}") from None
    try:
        raw = load_ds_config(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"ds_config={cfg.ds_config!r}: {path} is not valid JSON: {exc}") from None
    try:
        unknown = check_top_level_keys(raw, str(path))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if unknown:
        print(f"[ds_config] {path}: keys DeepSpeed does not read (ignored): {', '.join(unknown)}", flush=True)


def _is_tiny(spec: str) -> bool:
    return spec == "tiny" or spec.startswith("tiny:")


def model_dir(cfg: Config) -> str | None:
    """The local directory of `model.path` (a Hub id resolved to its snapshot); None for `tiny` models, which
    set-up builds."""
    return None if _is_tiny(cfg.model.path) else resolve_model_source(cfg.model.path, "model.path")


POLICY_ROLES = {"rl": "RL policy (and its reference)", "sft": "SFT model", "dpo": "DPO policy (and its reference)"}


def check_model_sources(cfg: Config, kind: str = "rl") -> None:
    """`model.path`, `model.tokenizer` and, in RL runs, `reward.model` and `critic.path` resolve to local
    directories now (a Hub id not in the cache while offline, a path that is not a model directory: one line), so
    set-up and every role later get the same directories without surprises. A reward model must hold its trained
    score head (`engines/rm_head.py` reads the weight files' headers only); a policy, teacher or reference a causal
    LM, never a reward model export (`kind`: the trainer, rl | sft | dpo | rm, or the store kind)."""
    local = model_dir(cfg)
    if local is not None and kind in POLICY_ROLES:
        check_causal_lm_dir(local, "model.path", POLICY_ROLES[kind])
    if cfg.model.tokenizer:
        resolve_model_source(cfg.model.tokenizer, "model.tokenizer", "tokenizer")
    if kind != "rl":
        return
    if cfg.rl.teacher and not _is_tiny(cfg.rl.teacher):
        teacher = resolve_model_source(cfg.rl.teacher, "rl.teacher")
        check_causal_lm_dir(teacher, "rl.teacher", "teacher (the reference of the KL term)")
        check_teacher(cfg, teacher)
    for key, spec in (("reward.model", cfg.reward.model), ("critic.path", cfg.critic.path)):
        if spec and not _is_tiny(spec):
            local = resolve_model_source(spec, key)
            if key == "reward.model":  # a causal LM would score with a random head: refused now, in one line
                check_reward_model_dir(local)


def check_teacher(cfg: Config, teacher_dir: str) -> None:
    """A teacher scores the student's tokens by id: its vocabulary must be the actor's (same size in config.json)."""
    student = model_dir(cfg)
    if student is None:  # a tiny model, built at set-up
        return
    sizes = []
    for key, path in (("model.path", student), ("rl.teacher", teacher_dir)):
        config = model_config(path)
        if config is None:
            raise ConfigError(f"{key}={path!r}: no config.json (not a model directory)")
        sizes.append(config.get("vocab_size"))
    ours, theirs = sizes
    if ours and theirs and ours != theirs:
        raise ConfigError(f"rl.teacher={cfg.rl.teacher!r} has a vocabulary of {theirs} tokens, the actor "
                          f"{cfg.model.path!r} of {ours}: a teacher must share the actor's tokenizer")


def model_config(local_dir: str) -> dict | None:
    """The text model's settings from `local_dir`'s config.json (a multimodal config's `text_config`); None when
    there is no config.json (a peft adapter directory)."""
    path = Path(local_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable model config ({exc})") from None
    return config.get("text_config") or config


# config.json keys that give a model's context, as vLLM reads them (the smallest one present is the limit)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len")


def model_context(local_dir: str) -> tuple[str, int] | None:
    """(config key, tokens): the longest sequence the model in `local_dir` takes, from its config.json (a
    multimodal config's `text_config`). None when config.json is absent (a peft adapter directory), names no
    context, or sets `rope_scaling` (a stretched context: vLLM derives it from the scaling)."""
    config = model_config(local_dir)
    if config is None or config.get("rope_scaling"):
        return None
    found = [(key, config[key]) for key in CONTEXT_KEYS if isinstance(config.get(key), int) and config[key] > 0]
    return min(found, key=lambda kv: kv[1]) if found else None


def rollout_context(cfg: Config) -> tuple[str, int]:
    """(what sets it, tokens): the longest sequence an RL run generates, prompt included."""
    r, data, context = cfg.rollout, cfg.data, cfg.context_len()
    if r.max_model_len:
        need = (f"rollout.max_model_len={context}", context)
    else:
        need = (f"data.max_prompt_len + rollout.max_new_tokens = {data.max_prompt_len} + {r.max_new_tokens} = "
                f"{context}", context)
    if rl_eval_on(cfg) and data.max_prompt_len + cfg.eval.max_new_tokens > need[1]:
        total = data.max_prompt_len + cfg.eval.max_new_tokens
        need = (f"data.max_prompt_len + eval.max_new_tokens = {data.max_prompt_len} + "
                f"{cfg.eval.max_new_tokens} = {total}", total)
    return need


def check_context(cfg: Config) -> None:
    """The RL run's sequences (prompt + response, `rollout_context`) fit the context of the policy and of the
    reward model and critic when given as directories or Hub ids: one line naming the keys, the sum and the
    model's limit, instead of vLLM's refusal after the models have loaded."""
    what, need = rollout_context(cfg)
    roles = [("model.path", cfg.model.path)]
    roles += [(key, spec) for key, spec in (("reward.model", cfg.reward.model),
                                            ("critic.path", cfg.critic.path)) if spec and not _is_tiny(spec)]
    for key, spec in roles:
        local = resolve_model_source(spec, key)  # `tiny` is built here, as set-up would build it
        limit = model_context(local)
        if limit is not None and need > limit[1]:
            raise ConfigError(f"{what} tokens exceed the context of {key}={spec!r} ({limit[0]}={limit[1]} in "
                              f"{Path(local) / 'config.json'}): lower --data.max_prompt_len or "
                              "--rollout.max_new_tokens (and --rollout.max_model_len, --eval.max_new_tokens when "
                              f"set) so the sum is at most {limit[1]}")


def check_memory_cap(cfg: Config, kind: str = "rl", total_bytes: int | None = None) -> None:
    """With `run.max_gpu_memory_gb`: an RL run first takes the split of the cap the plan picks for the settings
    the user left unset (`memory/split.py`: vLLM's share, the micro-batch tokens, fewer sidecar engines when
    needed; one line says what), then the run's plan fits the cap, else one line naming what to change."""
    if cfg.run.max_gpu_memory_gb <= 0:
        return

    try:
        if kind == "rl":
            total = total_bytes or memory_cap.local_gpu_total() or memory_cap.cap_bytes(cfg)
            split = choose_split(cfg, total, world_size=int(os.environ.get("WORLD_SIZE", 1)))
            if split is not None:
                apply_split(cfg, split)
                if int(os.environ.get("RANK", 0)) == 0:
                    print(split.line(cfg.run.max_gpu_memory_gb), flush=True)
        memory_cap.check_memory_cap(cfg, kind=kind, total_bytes=total_bytes)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise ConfigError(f"run.max_gpu_memory_gb={cfg.run.max_gpu_memory_gb:g}: the memory plan needs each "
                          f"model's config.json and cannot be made: {type(exc).__name__}: {exc}") from None


JSD_SHARE = 0.8  # of what vLLM leaves of the GPU: the most one micro-batch's JSD tensors may take without a cap


def check_jsd_memory(cfg: Config, total_bytes: int | None = None) -> None:
    """`rl.distill_loss jsd` without `run.max_gpu_memory_gb` (a cap sizes the micro-batch itself): one micro-batch's
    `[response tokens, vocab]` logits of both models and the loss's fp32 tensors (`memory/plan.py`) must fit in
    `JSD_SHARE` of what the vLLM engines on this GPU leave of it, else one line naming the micro-batch setting,
    instead of CUDA running out of memory at the first update. Checked on a CUDA device (or `total_bytes`)."""
    if cfg.rl.distill_loss != "jsd" or cfg.run.max_gpu_memory_gb > 0:
        return
    total = total_bytes or memory_cap.local_gpu_total()
    local = model_dir(cfg)
    vocab = ((local and model_config(local)) or {}).get("vocab_size")
    if not total or not vocab:
        return
    precision = cfg.model.dtype if cfg.model.dtype != "auto" else "bf16"
    per_token = jsd_bytes_per_token(vocab, precision, cfg.rl.jsd_beta)
    tokens = jsd_response_tokens(cfg, sequence_tokens(cfg, "rl")[0])  # as the memory plan counts them
    if cfg.data.micro_batch_tokens > 0:
        key = f"data.micro_batch_tokens={cfg.data.micro_batch_tokens}"
    else:
        key = (f"optim.micro_batch_size x rollout.max_new_tokens = {cfg.optim.micro_batch_size} x "
               f"{cfg.rollout.max_new_tokens}")
    vllm = cfg.rollout.gpu_memory_utilization
    if cfg.rollout.backend == "hf" or cfg.rollout.placement == "disaggregated":
        vllm = 0.0
    room = JSD_SHARE * total * (1 - vllm)
    if tokens * per_token > room:
        fits = int(room // per_token)
        fits = fits // 1024 * 1024 or fits
        raise ConfigError(
            f"rl.distill_loss=jsd: {key} response tokens x a {vocab}-token vocabulary hold "
            f"{tokens * per_token / 2**30:.1f} GiB of logits and JSD tensors per micro-batch, more than "
            f"{JSD_SHARE:.0%} of the {total * (1 - vllm) / 2**30:.1f} GiB vLLM leaves of this GPU: set "
            f"--data.micro_batch_tokens {fits} or less (or --run.max_gpu_memory_gb, which picks it)")


def check_kernels(cfg: Config) -> None:
    """`model.kernels=liger` where liger's kernels cannot run (no CUDA device, liger-kernel missing, a model type it
    does not know): one line now instead of an error after the model has loaded."""
    if cfg.model.kernels != "liger":
        return

    local = model_dir(cfg)
    config = Path(local or cfg.model.path) / "config.json"
    model_type = None  # a model not built yet ("tiny"): the device and the install are still checked
    if local and config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.path={cfg.model.path!r}: unreadable {config}: {exc}") from None
    try:
        kernels.resolve("liger", model_type, kernels.run_device_type())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_rl_run(cfg: Config) -> None:
    """Everything an RL run needs, checked before set-up."""
    if cfg.run.steps < 1:
        raise ConfigError(f"run.steps={cfg.run.steps}: an RL run needs at least one step")
    check_model_sources(cfg, "rl")
    check_context(cfg)
    check_prompt_store(cfg)
    check_rl_eval(cfg)
    check_reward(cfg)
    check_resume(cfg)
    check_ds_config(cfg)
    check_kernels(cfg)
    check_memory_cap(cfg, "rl")
    check_jsd_memory(cfg)


def check_supervised_run(cfg: Config, kind: str, trainer: str = "") -> None:
    """Everything an SFT (`kind` "sft"), reward-model or DPO ("preference") run needs, checked before set-up;
    `trainer`: sft | rm | dpo (what `model.path` must be)."""
    check_model_sources(cfg, trainer or kind)
    check_store(cfg.data.train, "data.train", kind)
    if cfg.data.eval:
        check_store(cfg.data.eval, "data.eval", kind)
    check_resume(cfg)
    check_ds_config(cfg)
    check_kernels(cfg)
    check_memory_cap(cfg, {"preference": "rm"}.get(kind, "sft"))
