"""The config schema's `rl` section (`RLConfig`): the RL algorithm, its advantage, losses, clipping and KL, on-policy
distillation, DAPO's switches and what a non-finite value does; every field with its default, its rule (`opt(...)`)
and a `# comment` that `--help` shows. The other sections an RL run reads by role (`reward`, `critic`, `eval`, `env`)
are in `config_rl_sections.py`; `ds_rlhf/config.py` puts them together with the rest (`config_sections.py`); import
them from there.
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
    gamma: float = opt(1.0, ge=0, le=1)
    lam: float = opt(0.95, ge=0, le=1)
    kl_coef: float = opt(0.0, ge=0)  # > 0 builds a frozen reference model
    # on-policy distillation: a teacher (dir or Hub id, the actor's tokenizer) is the KL reference, so the student's
    # per-token reverse KL to it is a reward (rl.kl_in reward, rl.kl_estimator k1) or a loss term (rl.kl_in loss);
    # needs rl.kl_coef > 0; reward.fn / reward.model become optional (docs/DISTILLATION.md)
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
    # a reward, loss or grad norm that is not finite: fail = stop, naming the step and source; skip = skip, warning
    on_nonfinite: str = opt("fail", choices=("fail", "skip"))  # fail | skip
    dynamic_sampling: bool = False  # DAPO: drop prompts whose samples' raw rewards are all equal, refill from new ones
    dynamic_sampling_max_rounds: int = opt(3, ge=1)  # dynamic sampling: generation rounds per step at most (>= 1)
    # curriculum by difficulty: pass_rate skips a prompt whose samples so far all passed (raw reward >= eval.threshold)
    # or all failed, once it has curriculum_min_attempts groups, for curriculum_skip_draws draws, then revisits it
    curriculum: str = opt("none", choices=("none", "pass_rate"))
    curriculum_min_attempts: int = opt(2, ge=1)  # rl.curriculum pass_rate: groups seen before a prompt can be skipped
    curriculum_skip_draws: int = opt(8, ge=0)  # rl.curriculum pass_rate: prompt draws a settled prompt sits out
    overlong_mask: bool = False  # DAPO overlong filtering: truncated responses get zero loss weight
    overlong_buffer: int = opt(0, ge=0)  # DAPO soft overlong penalty over the last N of rollout.max_new_tokens; 0 = off
    overlong_penalty: float = opt(1.0, ge=0)  # soft overlong penalty factor: the reward drops by this at the budget

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

    def single_update(self) -> bool:
        """One optimizer update per rollout batch (one epoch, one mini-batch): that update's own forward pass gives
        the pre-update policy's log-probs, so no separate old-policy pass is needed. Decided from settings only, never
        from a rank's sample count, so every rank takes the same (collective) path."""
        return self.ppo_epochs == 1 and self.mini_batch_size == 0

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
