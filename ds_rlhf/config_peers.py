"""The setting names of peer trainers (TRL, OpenRLHF, verl) that users type, and what each is here.

A peer name whose meaning is ours exactly is an alias: it sets our setting, and the command line says so in one
`note:` line. Any other peer name is refused with a hint naming our setting of the same meaning. An entry may hold
for some recipes only (`recipes`; empty: every recipe): TRL's `--beta` is the KL coefficient in GRPO and DPO's beta in
DPO. `config_keys.resolve` consults this table after our own names.
"""

from __future__ import annotations

from dataclasses import dataclass

PPO = ("train-ppo",)
SUPERVISED = ("train-sft", "train-rm", "train-dpo")


@dataclass(frozen=True)
class Peer:
    source: str  # TRL | OpenRLHF | verl
    alias: str = ""  # our dotted key when the meaning is the same
    hint: str = ""  # else: our setting(s) with that meaning, as a phrase
    recipes: tuple[str, ...] = ()  # the recipes this entry holds for; () = all


def _alias(source: str, key: str, recipes: tuple[str, ...] = ()) -> Peer:
    return Peer(source, alias=key, recipes=recipes)


def _hint(source: str, text: str, recipes: tuple[str, ...] = ()) -> Peer:
    return Peer(source, hint=text, recipes=recipes)


_ACCUMULATION = ("{batch} per optimizer step (a batch, not a count of micro-batches), cut into "
                 "--optim.micro_batch_size micro-batches (or --data.micro_batch_tokens token budgets)")
_LOGGING = ("--run.wandb true for Weights & Biases (--run.wandb_project NAME); TensorBoard: --run.tensorboard "
            "(on by default)")
_DATA = "--data.train, a store written by `ds-rlhf prep-{kind}` (which reads {source}'s files)"

PEERS: dict[str, tuple[Peer, ...]] = {
    # TRL (GRPOTrainer, SFTTrainer, DPOTrainer, RewardTrainer and their TrainingArguments)
    "beta": (_alias("TRL", "rl.kl_coef", PPO),
             _hint("TRL", "--rl.kl_coef (the KL coefficient) of train-ppo, or --dpo.beta of train-dpo",
                   ("train-sft", "train-rm"))),  # train-dpo: our own dpo.beta, the same meaning
    "num_generations": (_alias("TRL", "rollout.n_samples"),),
    "max_completion_length": (_alias("TRL", "rollout.max_new_tokens"),),
    "max_prompt_length": (_hint("TRL", "--data.max_prompt_len (a longer prompt is refused or dropped, see "
                                       "--data.overlong_prompts; not truncated)"),),
    "max_length": (_hint("TRL", "--data.max_len (a longer row is dropped, not truncated)"),),
    "learning_rate": (_alias("TRL", "optim.lr"),),
    "gradient_accumulation_steps": (
        _hint("TRL", _ACCUMULATION.format(batch="--rl.mini_batch_size, the rollouts per rank"), PPO),
        _hint("TRL", _ACCUMULATION.format(batch="--optim.batch_size, the sequences (pairs) per rank"))),
    "per_device_train_batch_size": (
        _hint("TRL", "--rl.prompts_per_step (prompts per step per rank) with --rollout.n_samples; "
                     "--optim.micro_batch_size is the micro-batch", PPO),
        _hint("TRL", "--optim.micro_batch_size (sequences per micro-batch per rank); --optim.batch_size is the "
                     "batch of an optimizer step")),
    "bf16": (_hint("TRL", "--model.dtype bf16 (auto: bf16 on a GPU that has it)"),),
    "fp16": (_hint("TRL", "--model.dtype fp16"),),
    "use_peft": (_hint("TRL", "--model.lora_rank N for LoRA (e.g. 16; 0 = full fine-tuning), with "
                              "--model.lora_alpha and --model.lora_targets"),),
    "lora_r": (_alias("TRL", "model.lora_rank"),),
    "report_to": (_hint("TRL", _LOGGING),),
    "model_name_or_path": (_alias("TRL", "model.path"),),
    "max_steps": (_alias("TRL", "run.steps", SUPERVISED),
                  _hint("TRL", "--run.steps (RL steps: one generation and its optimizer steps)")),
    "num_train_epochs": (_alias("TRL", "run.epochs", SUPERVISED),
                         _hint("TRL", "--run.epochs with --run.steps 0 (passes over the prompts)")),
    "epsilon": (_hint("TRL", "--rl.clip_low (and --rl.clip_high, the upper clip)"),),
    "loss_type": (_hint("TRL", "--rl.loss_agg (token-mean, seq-mean-token-mean, ...) and --rl.policy_loss", PPO),
                  _hint("TRL", "--dpo.loss in train-dpo; --rl.loss_agg in train-ppo")),
    # OpenRLHF (train_ppo_ray, train_sft, train_rm, train_dpo)
    "pretrain": (_alias("OpenRLHF", "model.path"),),
    "reward_pretrain": (_alias("OpenRLHF", "reward.model"),),
    "critic_pretrain": (_alias("OpenRLHF", "critic.path"),),
    "rollout_batch_size": (_hint("OpenRLHF", "--rl.prompts_per_step, prompts per step per rank (OpenRLHF's "
                                             "rollout_batch_size divided by the number of training ranks)"),),
    "train_batch_size": (
        _hint("OpenRLHF", "--rl.mini_batch_size, rollouts per optimizer step per rank (OpenRLHF's "
                          "train_batch_size divided by the number of training ranks)", PPO),
        _hint("OpenRLHF", "--optim.batch_size, sequences (pairs) per optimizer step per rank")),
    "micro_train_batch_size": (_alias("OpenRLHF", "optim.micro_batch_size"),),
    "init_kl_coef": (_alias("OpenRLHF", "rl.kl_coef"),),
    "n_samples_per_prompt": (_alias("OpenRLHF", "rollout.n_samples"),),
    "generate_max_len": (_alias("OpenRLHF", "rollout.max_new_tokens"),),
    "prompt_max_len": (_hint("OpenRLHF", "--data.max_prompt_len (a longer prompt is refused or dropped)"),),
    "actor_learning_rate": (_alias("OpenRLHF", "optim.lr"),),
    "critic_learning_rate": (_alias("OpenRLHF", "optim.critic_lr", PPO),),
    "max_epochs": (_alias("OpenRLHF", "rl.ppo_epochs", PPO), _alias("OpenRLHF", "run.epochs")),
    "advantage_estimator": (_hint("OpenRLHF", "--rl.algo (gae: ppo, group_norm: grpo, rloo: rloo, reinforce: "
                                              "reinforce_pp)"),),
    "prompt_data": (_hint("OpenRLHF", _DATA.format(kind="prompts", source="OpenRLHF")),),
    "dataset": (_hint("OpenRLHF", _DATA.format(kind="sft` or `ds-rlhf prep-preferences", source="OpenRLHF")),),
    "use_wandb": (_hint("OpenRLHF", _LOGGING),),
    # verl (Hydra keys)
    "actor_rollout_ref.model.path": (_alias("verl", "model.path"),),
    "actor_rollout_ref.model.lora_rank": (_alias("verl", "model.lora_rank"),),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (_alias("verl", "model.gradient_checkpointing"),),
    "actor_rollout_ref.rollout.n": (_alias("verl", "rollout.n_samples"),),
    "actor_rollout_ref.rollout.temperature": (_alias("verl", "rollout.temperature"),),
    "actor_rollout_ref.rollout.top_p": (_alias("verl", "rollout.top_p"),),
    "actor_rollout_ref.rollout.top_k": (_alias("verl", "rollout.top_k"),),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (_alias("verl", "rollout.gpu_memory_utilization"),),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (_alias("verl", "rollout.tensor_parallel_size"),),
    "actor_rollout_ref.rollout.dtype": (_hint("verl", "--rollout.dtype bf16 | fp16 | fp32 (auto: the trainer's "
                                                      "precision)"),),
    "actor_rollout_ref.actor.optim.lr": (_alias("verl", "optim.lr"),),
    "actor_rollout_ref.actor.ppo_epochs": (_alias("verl", "rl.ppo_epochs"),),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (_alias("verl", "optim.micro_batch_size"),),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (_hint("verl", "--rl.mini_batch_size, rollouts (not prompts) "
                                                                  "per optimizer step per rank"),),
    "actor_rollout_ref.actor.kl_loss_coef": (_alias("verl", "rl.kl_coef"),),
    "actor_rollout_ref.actor.use_kl_loss": (_hint("verl", "--rl.kl_in loss (the default) with --rl.kl_coef > 0"),),
    "actor_rollout_ref.actor.kl_loss_type": (_hint("verl", "--rl.kl_estimator (low_var_kl: k3)"),),
    "actor_rollout_ref.actor.entropy_coeff": (_alias("verl", "rl.entropy_coef"),),
    "actor_rollout_ref.actor.clip_ratio": (_hint("verl", "--rl.clip_low and --rl.clip_high"),),
    "actor_rollout_ref.actor.loss_agg_mode": (_alias("verl", "rl.loss_agg"),),
    "critic.optim.lr": (_alias("verl", "optim.critic_lr", PPO),),
    "critic.model.path": (_alias("verl", "critic.path"),),
    "reward_model.model.path": (_alias("verl", "reward.model"),),
    "algorithm.adv_estimator": (_hint("verl", "--rl.algo (gae: ppo, grpo, rloo, reinforce_plus_plus: "
                                              "reinforce_pp)"),),
    "algorithm.gamma": (_alias("verl", "rl.gamma"),),
    "algorithm.lam": (_alias("verl", "rl.lam"),),
    "algorithm.kl_ctrl.kl_coef": (_hint("verl", "--rl.kl_coef with --rl.kl_in reward (the KL in the reward)"),),
    "data.train_batch_size": (_hint("verl", "--rl.prompts_per_step, prompts per step per rank (verl's "
                                            "data.train_batch_size divided by the number of training ranks)"),),
    "data.max_prompt_length": (_hint("verl", "--data.max_prompt_len (a longer prompt is refused or dropped)"),),
    "data.max_response_length": (_alias("verl", "rollout.max_new_tokens"),),
    "data.train_files": (_hint("verl", _DATA.format(kind="prompts", source="verl")),),
    "data.val_files": (_hint("verl", "--data.eval, a store written by `ds-rlhf prep-prompts`"),),
    "trainer.total_training_steps": (_alias("verl", "run.steps"),),
    "trainer.total_epochs": (_hint("verl", "--run.epochs with --run.steps 0"),),
    "trainer.save_freq": (_alias("verl", "run.save_every"),),
    "trainer.test_freq": (_alias("verl", "run.eval_every"),),
    "trainer.default_local_dir": (_alias("verl", "run.output_dir"),),
    "trainer.logger": (_hint("verl", _LOGGING),),
    "trainer.n_gpus_per_node": (_hint("verl", "the launcher's GPU count: deepspeed --num_gpus N launch/..."),),
}


def lookup(key: str, recipe: str | None) -> Peer | None:
    """The entry for peer name `key` (dashes read as underscores) in `recipe` (None: any recipe), else None."""
    for peer in PEERS.get(key.replace("-", "_"), ()):
        if not peer.recipes or recipe is None or recipe in peer.recipes:
            return peer
    return None


def hint_line(key: str, peer: Peer) -> str:
    """The one-line refusal of a peer name that is not an alias."""
    return f"--{key} is {peer.source}'s setting, not one here; ours with that meaning: {peer.hint}"


def aliases(recipe: str | None) -> list[tuple[str, Peer]]:
    """The peer names read as one of our settings in `recipe`, for --help."""
    return [(key, peer) for key in PEERS if (peer := lookup(key, recipe)) is not None and peer.alias]
