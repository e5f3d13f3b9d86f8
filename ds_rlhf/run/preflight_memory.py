"""The memory checks of a run's preflight (`preflight.py` calls them), made from the models' config.json files before
any process group, model or vLLM engine starts: with `run.max_gpu_memory_gb` the split of the cap an RL run takes
for what the user left unset (`memory/split.py`) and the plan against the cap (`memory/cap.py`); without a cap, one
`rl.distill_loss jsd` micro-batch against what the vLLM engines leave of the GPU, the engines' share being the one
the run will give them (`memory/engine_budget.engine_share`). Each problem is one `ConfigError` naming the key,
the value and what to do."""

from __future__ import annotations

import os

from ds_rlhf.config import Config
from ds_rlhf.errors import ConfigError
from ds_rlhf.memory import cap as memory_cap
from ds_rlhf.memory.engine_budget import engine_share
from ds_rlhf.memory.plan import jsd_bytes_per_token, jsd_response_tokens
from ds_rlhf.memory.settings import sequence_tokens
from ds_rlhf.memory.split import apply_split, choose_split
from ds_rlhf.run.model_files import model_config, model_dir


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
    `JSD_SHARE` of what the vLLM engines on this GPU leave of it (their share as the run gives it, also where the
    work sizes them: `engine_budget.engine_share`), else one line naming the micro-batch setting, instead of CUDA
    running out of memory at the first update. Checked on a CUDA device (or `total_bytes`)."""
    if cfg.rl.distill_loss != "jsd" or cfg.run.max_gpu_memory_gb > 0:
        return
    total = total_bytes or memory_cap.local_gpu_total()
    local = model_dir(cfg)
    vocab = ((local and model_config(local)) or {}).get("vocab_size")
    if not total or not vocab:
        return
    precision = cfg.model.planned_precision("cuda")
    per_token = jsd_bytes_per_token(vocab, precision, cfg.rl.jsd_beta)
    tokens = jsd_response_tokens(cfg, sequence_tokens(cfg, "rl")[0])  # as the memory plan counts them
    if cfg.data.micro_batch_tokens > 0:
        key = f"data.micro_batch_tokens={cfg.data.micro_batch_tokens}"
    else:
        key = (f"optim.micro_batch_size x rollout.max_new_tokens = {cfg.optim.micro_batch_size} x "
               f"{cfg.rollout.max_new_tokens}")
    vllm = _engines_share(cfg, total)
    room = JSD_SHARE * total * (1 - vllm)
    if tokens * per_token > room:
        fits = int(room // per_token)
        fits = fits // 1024 * 1024 or fits
        raise ConfigError(
            f"rl.distill_loss=jsd: {key} response tokens x a {vocab}-token vocabulary hold "
            f"{tokens * per_token / 2**30:.1f} GiB of logits and JSD tensors per micro-batch, more than "
            f"{JSD_SHARE:.0%} of the {total * (1 - vllm) / 2**30:.1f} GiB vLLM leaves of this GPU: set "
            f"--data.micro_batch_tokens {fits} or less (or --run.max_gpu_memory_gb, which picks it)")


def _engines_share(cfg: Config, total: int) -> float:
    """The share of the GPU the run's vLLM engines take (`engine_budget.engine_share`; the budget is not applied
    here: the RL build applies the same one)."""
    try:
        return engine_share(cfg, total, world_size=int(os.environ.get("WORLD_SIZE", 1)))[0]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"rl.distill_loss=jsd: the vLLM engines' share of the GPU needs the model's config.json "
                          f"and cannot be planned: {type(exc).__name__}: {exc}") from None
