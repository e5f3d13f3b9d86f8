"""The config sections an RL run reads beside `rl` (the algorithm, `config_rl.py`), one per role: `reward` (what
scores a response: functions, a reward model, their workers and servers), `critic` (PPO's value model), `eval` (the
held-out evaluation and the best checkpoint) and `env` (multi-turn episodes: the environment, its budgets, its tool
sandbox). Every field with its default, its rule (`opt(...)`) and a `# comment` that `--help` shows; each section's
`check` reads only its own fields (the rules across sections: `config_rules.py`). A setting of the RL run goes in
the section of its role; `rl` keeps the algorithm. `config_rl_names.py` reads each key's `rl.<name>` spelling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ds_rlhf.config_sections import opt
from ds_rlhf.errors import ConfigError


@dataclass
class RewardConfig:
    fn: str = ""  # gsm8k | format | math_shaped | math_verify | code_tests | file.py:func[@trl|...], comma list
    weights: str = ""  # comma-separated weights, one per reward.fn entry (default 1 each)
    workers: int = opt(-1, ge=-1)  # reward processes per rank; -1 = 2 for file.py rewards, else 0 (in-process)
    timeout: float = opt(30.0, gt=0)  # seconds per reward call in a worker / per HTTP request in all
    http_batch: int = opt(64, ge=1)  # reward.fn http(s)://...: items per request (each within reward.timeout)
    max_reply_mb: float = opt(64.0, gt=0)  # reward.fn http(s)://...: a larger reply is refused unread
    # seconds a reward worker may take to import the reward file(s) (a progress line after 5 s); longer = an error
    import_timeout: float = opt(300.0, gt=0)
    mp_context: str = opt("spawn", choices=("spawn", "forkserver"))  # how reward workers start
    model: str = ""  # HF dir or Hub id of a sequence-classification reward model
    # its weight when reward.fn is set too: reward = reward.model_weight * RM score + the functions' weighted sum
    model_weight: float = 1.0
    on_bad: str = opt("fail", choices=("fail", "zero", "drop"))  # a reward that fails: fail | zero | drop
    # an LLM judge (docs/JUDGE_REWARDS.md): an OpenAI-compatible server's URL (http://host:port/v1[#model name])
    # or a causal LM (HF dir or Hub id) run in this process; it scores with the rubric template reward.judge_prompt
    judge: str = ""
    judge_prompt: str = ""  # reward.judge: the rubric template file ({prompt}, {response}, {reference})
    judge_weight: float = 1.0  # reward.judge: its weight beside reward.fn's functions
    judge_max_tokens: int = opt(256, ge=1)  # reward.judge: tokens the judge may write per item
    judge_batch: int = opt(8, ge=1)  # reward.judge: requests in flight at once (a URL) / items per generate call

    def check(self) -> None:
        if self.judge and not self.judge_prompt:
            raise ConfigError(f"reward.judge={self.judge!r} needs its rubric template: set --reward.judge_prompt "
                              "FILE (a text file with {prompt} and {response}; docs/JUDGE_REWARDS.md)")
        if self.judge_prompt and not self.judge:
            raise ConfigError(f"reward.judge_prompt={self.judge_prompt!r} is the LLM judge's template: set "
                              "--reward.judge MODEL (a server URL or a model) too, or leave it empty")
        if self.judge_prompt and not Path(self.judge_prompt).is_file():
            raise ConfigError(f"reward.judge_prompt={self.judge_prompt!r}: no such file")
        if self.model_weight != 1.0 and not (self.fn and self.model):
            raise ConfigError(f"reward.model_weight={self.model_weight} weighs the reward model against reward "
                              "functions: it needs both reward.model and reward.fn (or leave it at 1)")


@dataclass
class CriticConfig:
    path: str = ""  # the critic's initial weights; default: reward.model if set, else the actor
    init: str = opt("auto", choices=("auto", "reward", "actor"))  # auto | reward | actor
    value_clip: float = opt(0.2, ge=0)  # the value loss's clip around the rollout's values; 0 = off


@dataclass
class EvalConfig:
    max_prompts: int = opt(0, ge=0)  # held-out eval (data.eval): its first N prompts; 0 = all
    samples: int = opt(1, ge=1)  # eval responses per prompt (sampled eval; greedy decodes one)
    greedy: bool = True  # eval decodes greedily (temperature 0, one response per prompt)
    temperature: float = opt(1.0, gt=0)  # sampled eval (eval.greedy false): temperature
    top_p: float = opt(1.0, gt=0, le=1)  # sampled eval: nucleus top_p
    max_new_tokens: int = opt(0, ge=0)  # eval response budget; 0 = rollout.max_new_tokens
    k: str = "1"  # comma list of k for eval/pass@k and eval/mean@k (each <= the eval responses per prompt)
    threshold: float = 1.0  # an eval response is correct when its reward >= this (for pass@k)
    reward_fn: str = ""  # eval reward, as reward.fn; "" = reward.fn (needed with reward.model)
    best_metric: str = ""  # keep checkpoints/best at the best value of this eval metric (e.g. eval/pass@1); "" = off
    best_mode: str = opt("max", choices=("max", "min"))  # best_metric: higher (max) or lower (min) is better

    def ks(self) -> list[int]:
        """`k` as ints (ConfigError naming the key when it is not a comma list of ints >= 1)."""
        try:
            ks = [int(k) for k in self.k.split(",") if k.strip()]
        except ValueError:
            ks = []
        if not ks or min(ks) < 1:
            raise ConfigError(f"eval.k={self.k!r}: give a comma list of integers >= 1, e.g. 1,4")
        return ks

    def check(self) -> None:
        per_prompt = 1 if self.greedy else self.samples
        if self.greedy and self.samples > 1:
            raise ConfigError(f"eval.samples={self.samples} with eval.greedy true: greedy decoding gives one "
                              "response per prompt; set --eval.greedy false to sample several")
        if max(self.ks()) > per_prompt:
            raise ConfigError(f"eval.k={self.k!r}: k cannot exceed the {per_prompt} eval response(s) per prompt "
                              "(eval.samples, with eval.greedy false)")
        if self.best_metric and not self.best_metric.startswith("eval/"):
            raise ConfigError(f"eval.best_metric={self.best_metric!r}: must be an eval metric (eval/pass@1, "
                              "eval/reward_mean, eval/<data source>/pass@1, ...)")


@dataclass
class EnvConfig:
    # each prompt plays rollout.n_samples episodes scored by the environment's reward (docs/AGENTIC.md)
    name: str = ""  # multi-turn episodes: file.py:Name, an environment class or a list of tool functions
    max_turns: int = opt(4, ge=1)  # env.name: generated turns per episode at most (then it is truncated)
    # 0 = the rollout context (rollout.max_model_len, else data.max_prompt_len + rollout.max_new_tokens)
    max_tokens: int = opt(0, ge=0)  # env.name: tokens per episode, prompt and observations included
    # env.name: seconds per environment reset / step call (plain tool functions run inside the step); past it
    # the episode ends "timeout" and its thread is abandoned (a Python thread cannot be killed: a Sandbox tool can)
    step_timeout: float = opt(60.0, ge=0)  # env.name: seconds per reset / step call; 0 = no deadline
    # env.name: protections each tool Sandbox call must have, else an error at start (docs/AGENTIC.md): a comma
    # list of pid_ns, net_ns, mount_ns, nproc_limit, fs_write, unix_sockets; strict = all; "" = a warning if missing
    sandbox_require: str = ""
    # env.name: an episode whose environment step raised, timed out or returned an oversized observation:
    # fail = stop the run with its report, zero = train on it with reward 0, drop = leave it out of the step
    on_bad_tool: str = opt("zero", choices=("fail", "zero", "drop"))  # failed environment step: fail | zero | drop
    # env.name: lockstep = a round of generation starts when every environment step in flight has ended (a
    # step's episodes follow from the seed, weights and rows: exact resume); continuous = as soon as any has ended,
    # with every episode then waiting (a slow tool holds back only its own episode; which episodes share a generate
    # call then depends on the tools' timing, so a resumed run regenerates its batch, not bit for bit)
    rounds: str = opt("lockstep", choices=("lockstep", "continuous"))

    def check(self) -> None:
        if self.name and ":" not in self.name:
            raise ConfigError(f"env.name={self.name!r}: give path/to/file.py:Name (an environment class or a list "
                              "of tool functions in that file)")
