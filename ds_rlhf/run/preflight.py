"""Checks of a run's inputs that need the filesystem, made before any process group, model or vLLM engine starts.

The schema (`ds_rlhf.config`) already refused bad keys, bad choices, out-of-range numbers and conflicting options.
What is left needs to look at files: the model, tokenizer, reward model and critic sources (a local directory, or a
Hugging Face Hub id resolved to its cached snapshot, downloaded only when online: `engines/model_source.py`), the
prompt store (opened, which verifies its checksums and statistics; the held-out eval store too when RL evaluation
is on), the RL sequence budget against the models' context (config.json), the reward function file,
the resume directory, the DeepSpeed config, and the
low-memory mode: `model.share_base` needs LoRA, and the memory checks (`preflight_memory.py`: with
`run.max_gpu_memory_gb` the split of the cap and the plan against it, without one a JSD micro-batch against what
the vLLM engines leave of the GPU). What the model directories say is `model_files.py`'s. Each
problem is one `ConfigError` naming the key, the value and what to do, so a run that would fail hours in (a prompt
longer than the rollout budget, say) fails at once.
"""

from __future__ import annotations

import json
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
from ds_rlhf.redaction import redact_urls
from ds_rlhf.rewards.builtin import BUILTIN_REWARDS
from ds_rlhf.rewards.judge import endpoint
from ds_rlhf.rewards.judge_template import read_template
from ds_rlhf.rewards.loading import check_spec, split_style
from ds_rlhf.rewards.remote import check_remote, is_remote
from ds_rlhf.rewards.reward_set import parse_weights
from ds_rlhf.run.context import find_ds_config
from ds_rlhf.run.model_files import is_tiny, model_config, model_context, model_dir
from ds_rlhf.run.preflight_memory import check_jsd_memory, check_memory_cap


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
    if cfg.rl.teacher and not is_tiny(cfg.rl.teacher):
        teacher = resolve_model_source(cfg.rl.teacher, "rl.teacher")
        check_causal_lm_dir(teacher, "rl.teacher", "teacher (the reference of the KL term)")
        check_teacher(cfg, teacher)
    for key, spec in (("reward.model", cfg.reward.model), ("critic.path", cfg.critic.path)):
        if spec and not is_tiny(spec):
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
                                            ("critic.path", cfg.critic.path)) if spec and not is_tiny(spec)]
    for key, spec in roles:
        local = resolve_model_source(spec, key)  # `tiny` is built here, as set-up would build it
        limit = model_context(local)
        if limit is not None and need > limit[1]:
            raise ConfigError(f"{what} tokens exceed the context of {key}={spec!r} ({limit[0]}={limit[1]} in "
                              f"{Path(local) / 'config.json'}): lower --data.max_prompt_len or "
                              "--rollout.max_new_tokens (and --rollout.max_model_len, --eval.max_new_tokens when "
                              f"set) so the sum is at most {limit[1]}")


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
