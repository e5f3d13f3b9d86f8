"""The config schema's `rl` section (`RLConfig`): the algorithm, its losses and KL, the rewards, the critic, the
held-out evaluation, DAPO's switches and multi-turn episodes; every field with its default, its rule (`opt(...)`) and a
`# comment` that `--help` shows. `ds_rlhf/config.py` puts it together with the other sections
(`config_sections.py`); import it from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_rlhf.algos.registry import POLICY_LOSSES
from ds_rlhf.config_sections import opt
from ds_rlhf.errors import ConfigError


@dataclass
class RLConfig:
    algo: str = opt("grpo", choices="advantage")  # advantage estimator (dr_grpo: pair with loss_agg const-norm)
    # rl.algo grpo: the std dividing (score - group mean): `batch` (all the step's scores on this rank: a group that
    # differs only by a small partial credit keeps small advantages; docs/PERFORMANCE.md, learning benchmark),
    # `group` (each prompt's own, DeepSeekMath's), `none` (Dr.GRPO's numerator)
    scale_rewards: str = opt("batch", choices=("group", "batch", "none"))
    prompts_per_step: int = opt(8, ge=1)  # prompts per step per rank
    ppo_epochs: int = opt(1, ge=1)
    mini_batch_size: int = opt(0, ge=0)  # rollouts per optimizer step; 0 = all of a step's rollouts
    policy_loss: str = opt("ppo", choices="policy_loss")  # policy-gradient loss (docs/POLICY_LOSSES.md: which to pick)
    clip_low: float = opt(0.2, ge=0, lt=1)  # ratio >= 1 - clip_low; gspo: sequence ratio (paper 3e-4); gmpo: log (0.4)
    clip_high: float = opt(0.2, ge=0)  # > clip_low: DAPO clip-higher; gspo paper 4e-4; gmpo 0.4; cispo cap 1 + it
    dual_clip: float = opt(0.0, ge=0)  # 0 = off; else the dual-clip constant c > 1 (policy_loss ppo only)
    sapo_tau_pos: float = opt(1.0, ge=1e-6)  # policy_loss sapo: soft-gate temperature where the advantage is > 0
    sapo_tau_neg: float = opt(1.05, ge=1e-6)  # policy_loss sapo: soft-gate temperature elsewhere (faster decay)
    value_clip: float = opt(0.2, ge=0)  # 0 = off
    gamma: float = opt(1.0, ge=0, le=1)
    lam: float = opt(0.95, ge=0, le=1)
    kl_coef: float = opt(0.0, ge=0)  # > 0 builds a frozen reference model
    # on-policy distillation: a teacher (dir or Hub id, the actor's tokenizer) is the KL reference, so the student's
    # per-token reverse KL to it is a reward (rl.kl_in reward, rl.kl_estimator k1) or a loss term (rl.kl_in loss);
    # needs rl.kl_coef > 0; rl.reward_fn / rl.reward_model become optional (docs/DISTILLATION.md)
    teacher: str = ""
    # rl.teacher: a full-distribution loss in the policy update, `jsd` = DeepSpeed's generalized Jensen-Shannon
    # divergence between the student's and the teacher's next-token distributions at every response token
    distill_loss: str = opt("none", choices=("none", "jsd"))
    jsd_beta: float = opt(0.5, ge=0, le=1)  # rl.distill_loss jsd: 0 = forward KL teacher->student, 1 = reverse KL
    distill_coef: float = opt(1.0, gt=0)  # rl.distill_loss jsd: its weight in the policy loss (a token mean)
    kl_estimator: str = opt("k3", choices="kl")  # k1 | k2 | k3
    kl_in: str = opt("loss", choices=("loss", "reward"))  # loss | reward
    kl_target: float = opt(0.0, ge=0)  # > 0 turns on the adaptive controller
    kl_horizon: int = opt(10000, ge=1)  # adaptive KL: samples over which beta moves by the clipped error
    entropy_coef: float = opt(0.0, ge=0)
    loss_agg: str = opt("token-mean", choices="aggregation")  # how token losses are reduced
    mismatch: str = opt("tis", choices="mismatch")  # rollout/trainer mismatch correction
    tis_cap: float = opt(2.0, gt=0)
    reward_fn: str = ""  # gsm8k | format | math_shaped | math_verify | code_tests | file.py:func[@trl|...], comma list
    reward_weights: str = ""  # comma-separated weights, one per reward_fn entry (default 1 each)
    reward_workers: int = opt(-1, ge=-1)  # reward processes per rank; -1 = 2 for file.py rewards, else 0 (in-process)
    reward_timeout: float = opt(30.0, gt=0)  # seconds per reward call in a worker / per HTTP request in all
    reward_http_batch: int = opt(64, ge=1)  # reward_fn http(s)://...: items per request (each within reward_timeout)
    reward_max_reply_mb: float = opt(64.0, gt=0)  # reward_fn http(s)://...: a larger reply is refused unread
    # seconds a reward worker may take to import the reward file(s) (a progress line after 5 s); longer = an error
    reward_import_timeout: float = opt(300.0, gt=0)
    reward_mp_context: str = opt("spawn", choices=("spawn", "forkserver"))  # how reward workers start
    reward_model: str = ""  # HF dir or Hub id of a sequence-classification reward model
    # its weight when rl.reward_fn is set too: reward = reward_model_weight * RM score + the functions' weighted sum
    reward_model_weight: float = 1.0
    on_bad_reward: str = opt("fail", choices=("fail", "zero", "drop"))  # fail | zero | drop
    # a reward, loss or grad norm that is not finite: fail = stop, naming the step and source; skip = skip, warning
    on_nonfinite: str = opt("fail", choices=("fail", "skip"))  # fail | skip
    critic_path: str = ""  # default: reward_model if set, else the actor
    critic_init: str = opt("auto", choices=("auto", "reward", "actor"))  # auto | reward | actor
    eval_max_prompts: int = opt(0, ge=0)  # held-out eval (data.eval): its first N prompts; 0 = all
    eval_samples: int = opt(1, ge=1)  # eval responses per prompt (sampled eval; greedy decodes one)
    eval_greedy: bool = True  # eval decodes greedily (temperature 0, one response per prompt)
    eval_temperature: float = opt(1.0, gt=0)  # sampled eval (eval_greedy false): temperature
    eval_top_p: float = opt(1.0, gt=0, le=1)  # sampled eval: nucleus top_p
    eval_max_new_tokens: int = opt(0, ge=0)  # eval response budget; 0 = rollout.max_new_tokens
    eval_k: str = "1"  # comma list of k for eval/pass@k and eval/mean@k (each <= the eval responses per prompt)
    eval_threshold: float = 1.0  # an eval response is correct when its reward >= this (for pass@k)
    eval_reward_fn: str = ""  # eval reward, as rl.reward_fn; "" = rl.reward_fn (needed with rl.reward_model)
    best_metric: str = ""  # keep checkpoints/best at the best value of this eval metric (e.g. eval/pass@1); "" = off
    best_mode: str = opt("max", choices=("max", "min"))  # best_metric: higher (max) or lower (min) is better
    dynamic_sampling: bool = False  # DAPO: drop prompts whose samples' raw rewards are all equal, refill from new ones
    dynamic_sampling_max_rounds: int = opt(3, ge=1)  # dynamic sampling: generation rounds per step at most (>= 1)
    overlong_mask: bool = False  # DAPO overlong filtering: truncated responses get zero loss weight
    overlong_buffer: int = opt(0, ge=0)  # DAPO soft overlong penalty over the last N of rollout.max_new_tokens; 0 = off
    overlong_penalty: float = opt(1.0, ge=0)  # soft overlong penalty factor: the reward drops by this at the budget
    # each prompt plays rollout.n_samples episodes scored by the environment's reward (docs/AGENTIC.md)
    environment: str = ""  # multi-turn episodes: file.py:Name, an environment class or a list of tool functions
    max_turns: int = opt(4, ge=1)  # rl.environment: generated turns per episode at most (then it is truncated)
    # 0 = the rollout context (rollout.max_model_len, else data.max_prompt_len + rollout.max_new_tokens)
    episode_max_tokens: int = opt(0, ge=0)  # rl.environment: tokens per episode, prompt and observations included
    # rl.environment: seconds per environment reset / step call (plain tool functions run inside the step); past it
    # the episode ends "timeout" and its thread is abandoned (a Python thread cannot be killed: a Sandbox tool can)
    env_step_timeout: float = opt(60.0, ge=0)  # rl.environment: seconds per reset / step call; 0 = no deadline
    # rl.environment: protections each tool Sandbox call must have, else an error at start (docs/AGENTIC.md): a comma
    # list of pid_ns, net_ns, mount_ns, nproc_limit, fs_write, unix_sockets; strict = all; "" = a warning if missing
    sandbox_require: str = ""
    # rl.environment: an episode whose environment step raised, timed out or returned an oversized observation:
    # fail = stop the run with its report, zero = train on it with reward 0, drop = leave it out of the step
    on_bad_tool: str = opt("zero", choices=("fail", "zero", "drop"))  # failed environment step: fail | zero | drop
    # rl.environment: lockstep = a round of generation starts when every environment step in flight has ended (a
    # step's episodes follow from the seed, weights and rows: exact resume); continuous = as soon as any has ended,
    # with every episode then waiting (a slow tool holds back only its own episode; which episodes share a generate
    # call then depends on the tools' timing, so a resumed run regenerates its batch, not bit for bit)
    episode_rounds: str = opt("lockstep", choices=("lockstep", "continuous"))

    def check(self) -> None:
        """The section's own rules; those that read other sections are in `config_rules.py`."""
        # No rule for temperature / top_p / top_k with the mismatch correction (rl.mismatch tis/mis): both rollout
        # backends return the log-probs of the distribution they sampled from (temperature, then top-k / top-p),
        # the trainer scores at the same temperature, so the ratio is the behaviour-policy correction; with top-p /
        # top-k it also corrects for the truncation (rho_t = the kept mass <= 1). See rollout/base.py.
        if 0 < self.dual_clip <= 1:
            raise ConfigError(f"rl.dual_clip={self.dual_clip}: the dual-clip constant must be > 1 (0 = off)")
        if self.dual_clip and not POLICY_LOSSES.get(self.policy_loss).meta.get("dual_clip"):
            raise ConfigError(f"rl.dual_clip={self.dual_clip} is a PPO-loss setting, but rl.policy_loss="
                              f"{self.policy_loss} does not take it: set --rl.dual_clip 0 or --rl.policy_loss ppo")
        if self.teacher and not (self.kl_coef > 0 or self.kl_target > 0 or self.distill_loss != "none"):
            raise ConfigError(f"rl.teacher={self.teacher!r} distils through the KL term: set --rl.kl_coef > 0 (e.g. 1 "
                              "with --rl.kl_in reward --rl.kl_estimator k1 for the per-token reverse KL as a reward), "
                              "or --rl.distill_loss jsd")
        self._check_distill()
        if self.reward_model_weight != 1.0 and not (self.reward_fn and self.reward_model):
            raise ConfigError(f"rl.reward_model_weight={self.reward_model_weight} weighs the reward model against "
                              "reward functions: it needs both rl.reward_model and rl.reward_fn (or leave it at 1)")
        self._check_environment()
        self._check_eval()

    def uses_reference(self) -> bool:
        """A frozen reference (the teacher, with `rl.teacher`) is built: for the KL term or the distillation loss."""
        return self.kl_coef > 0 or self.kl_target > 0 or self.distill_loss != "none"

    def _check_distill(self) -> None:
        if self.distill_loss != "none" and not self.teacher:
            raise ConfigError(f"rl.distill_loss={self.distill_loss} distils into a teacher's distributions: set "
                              "--rl.teacher (a model with the actor's tokenizer) or --rl.distill_loss none")
        for key, value, default in (("jsd_beta", self.jsd_beta, 0.5), ("distill_coef", self.distill_coef, 1.0)):
            if value != default and self.distill_loss != "jsd":
                raise ConfigError(f"rl.{key}={value:g} is a setting of the JSD distillation loss: add "
                                  f"--rl.distill_loss jsd (with --rl.teacher) or leave it at {default:g}")

    def _check_environment(self) -> None:
        """What multi-turn episodes (`rl.environment`) run with; the rest is refused here, one line each."""
        if not self.environment:
            return
        key = f"rl.environment={self.environment!r}"
        if ":" not in self.environment:
            raise ConfigError(f"{key}: give path/to/file.py:Name (an environment class or a list of tool "
                              "functions in that file)")
        # Critic estimators (PPO) run too: the critic's GAE and value loss read the action mask, so observation
        # tokens get no advantage, no value target and no value loss, and the GAE chain links the generated tokens
        # across each observation (algos/advantages.py).
        if self.dynamic_sampling:
            raise ConfigError(f"{key}: rl.dynamic_sampling is not supported with episodes; set "
                              "--rl.dynamic_sampling false")
        if self.overlong_buffer:
            raise ConfigError(f"{key}: rl.overlong_buffer measures a single response against rollout.max_new_tokens, "
                              "not an episode; set --rl.overlong_buffer 0 (rl.overlong_mask drops truncated episodes)")

    def eval_ks(self) -> list[int]:
        """`eval_k` as ints (ConfigError naming the key when it is not a comma list of ints >= 1)."""
        try:
            ks = [int(k) for k in self.eval_k.split(",") if k.strip()]
        except ValueError:
            ks = []
        if not ks or min(ks) < 1:
            raise ConfigError(f"rl.eval_k={self.eval_k!r}: give a comma list of integers >= 1, e.g. 1,4")
        return ks

    def _check_eval(self) -> None:
        per_prompt = 1 if self.eval_greedy else self.eval_samples
        if self.eval_greedy and self.eval_samples > 1:
            raise ConfigError(f"rl.eval_samples={self.eval_samples} with rl.eval_greedy true: greedy decoding gives "
                              "one response per prompt; set --rl.eval_greedy false to sample several")
        if max(self.eval_ks()) > per_prompt:
            raise ConfigError(f"rl.eval_k={self.eval_k!r}: k cannot exceed the {per_prompt} eval response(s) per "
                              "prompt (rl.eval_samples, with rl.eval_greedy false)")
        if self.best_metric and not self.best_metric.startswith("eval/"):
            raise ConfigError(f"rl.best_metric={self.best_metric!r}: must be an eval metric (eval/pass@1, "
                              "eval/reward_mean, eval/<data source>/pass@1, ...)")
