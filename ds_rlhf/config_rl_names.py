"""The `rl.<name>` spelling of each reward, critic, evaluation and environment setting (`rl.reward_fn`, `rl.eval_k`,
`rl.environment`, ...): read as the key of its own section (`config_rl_sections.py`) with one `note:` line naming
that key, on the command line, in a `--config` file and in a mapping given in Python, dotted (`rl.reward_fn`),
nested (`rl: {reward_fn: ...}`) or bare (`reward_fn`). `config_keys.resolve` consults this table after the schema's
own names; `in_sections` reads a saved `config.json` written with these spellings.
"""

from __future__ import annotations

# `rl.<name>` -> the dotted key it reads as
RL_NAMES: dict[str, str] = {
    "rl.reward_fn": "reward.fn",
    "rl.reward_weights": "reward.weights",
    "rl.reward_workers": "reward.workers",
    "rl.reward_timeout": "reward.timeout",
    "rl.reward_http_batch": "reward.http_batch",
    "rl.reward_max_reply_mb": "reward.max_reply_mb",
    "rl.reward_import_timeout": "reward.import_timeout",
    "rl.reward_mp_context": "reward.mp_context",
    "rl.reward_model": "reward.model",
    "rl.reward_model_weight": "reward.model_weight",
    "rl.on_bad_reward": "reward.on_bad",
    "rl.reward_judge": "reward.judge",
    "rl.judge_prompt": "reward.judge_prompt",
    "rl.judge_weight": "reward.judge_weight",
    "rl.judge_max_tokens": "reward.judge_max_tokens",
    "rl.judge_batch": "reward.judge_batch",
    "rl.critic_path": "critic.path",
    "rl.critic_init": "critic.init",
    "rl.value_clip": "critic.value_clip",
    "rl.eval_max_prompts": "eval.max_prompts",
    "rl.eval_samples": "eval.samples",
    "rl.eval_greedy": "eval.greedy",
    "rl.eval_temperature": "eval.temperature",
    "rl.eval_top_p": "eval.top_p",
    "rl.eval_max_new_tokens": "eval.max_new_tokens",
    "rl.eval_k": "eval.k",
    "rl.eval_threshold": "eval.threshold",
    "rl.eval_reward_fn": "eval.reward_fn",
    "rl.best_metric": "eval.best_metric",
    "rl.best_mode": "eval.best_mode",
    "rl.environment": "env.name",
    "rl.max_turns": "env.max_turns",
    "rl.episode_max_tokens": "env.max_tokens",
    "rl.env_step_timeout": "env.step_timeout",
    "rl.sandbox_require": "env.sandbox_require",
    "rl.on_bad_tool": "env.on_bad_tool",
    "rl.episode_rounds": "env.rounds",
}

_BARE = {key.split(".", 1)[1]: key for key in RL_NAMES}


def lookup(key: str) -> tuple[str, str] | None:
    """(the `rl.<name>` spelling, the dotted key it reads as) for `key` given dotted or bare, else None."""
    dotted = key if key in RL_NAMES else _BARE.get(key)
    return (dotted, RL_NAMES[dotted]) if dotted else None


def note_line(typed: str, dotted: str) -> str:
    """The one `note:` line of a key given in its `rl.<name>` spelling."""
    return f"note: {typed} reads as {dotted} (its section: [{dotted.split('.')[0]}]); write {dotted}"


def in_sections(saved: dict) -> dict:
    """A config mapping (a run's `config.json`) with each `rl.<name>` key of its `rl` section in its own section;
    a key the section already holds is kept."""
    rl = saved.get("rl")
    if not isinstance(rl, dict):
        return saved
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in saved.items()}
    for name, value in rl.items():
        found = lookup(f"rl.{name}")
        if found is None:
            continue
        section, field = found[1].split(".")
        out["rl"].pop(name, None)
        out.setdefault(section, {}).setdefault(field, value)
    return out
