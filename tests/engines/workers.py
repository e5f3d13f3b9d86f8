"""Functions run on every rank by ``ds_rlhf.testing.multiproc.run_workers`` (world size 2, gloo, CPU).

Each returns JSON-serialisable results; comparisons that need full weights are done in-process on rank 0 so that
only numbers travel back to the test.
"""

from __future__ import annotations

import copy
import os

import torch

LR = 1e-2


def setup() -> int:
    import torch.distributed as dist

    from ds_rlhf.distributed import ensure_distributed

    ensure_distributed()
    return dist.get_rank()


def resolved(name: str, *, stage=None, precision="fp32", lr=LR, grad_clip=1.0, world_size=None, **overrides):
    """A ds_configs/ file resolved for the tests; ``stage`` forces the ZeRO stage (the file's value is replaced)."""
    from ds_rlhf.ds_config_file import load_ds_config
    from ds_rlhf.engines.ds_config import resolve_ds_config

    cfg = load_ds_config(name)
    if stage is not None:
        cfg["zero_optimization"] = {"stage": stage} if stage < 2 else {**cfg["zero_optimization"], "stage": stage}
    if "freeze_step" in overrides:
        cfg["optimizer"]["params"]["freeze_step"] = overrides.pop("freeze_step")
    ws = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    return resolve_ds_config(cfg, micro_batch_size=2, grad_accum=1, world_size=ws, precision=precision,
                             grad_clip=grad_clip, lr=lr, weight_decay=0.01, total_steps=100, **overrides)


def lm_batch(rank: int, step: int = 0, vocab: int = 300, length: int = 16) -> torch.Tensor:
    """Fixed per-rank token batch (the same for every step unless ``step`` is used): memorisable, so loss falls."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(5, vocab, (2, length), generator=gen)


def train_lm(engine, rank: int, steps: int, start: int = 0, vary: bool = False) -> list[float]:
    losses = []
    for i in range(start, start + steps):
        batch = lm_batch(rank, i if vary else 0)
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_critic(engine, rank: int, steps: int) -> list[float]:
    batch = lm_batch(rank)
    target = torch.linspace(-1, 1, batch.shape[1]).expand(batch.shape[0], -1)
    losses = []
    for _ in range(steps):
        loss = ((engine(batch) - target) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def train_across_stages(model_path: str, reward_path: str, steps: int = 6) -> dict:
    """Actor at ZeRO 0/2/3/3+offload and critic at ZeRO 0/3 from identical starts; weights compared with ZeRO-0."""
    from ds_rlhf.engines.builder import build_actor, build_critic
    from ds_rlhf.engines.hf_export import gather_state_dict

    rank = setup()
    out, reference = {}, None
    for name, file, stage in (("z0", "zero2", 0), ("z2", "zero2", None), ("z3", "zero3", None),
                              ("z3_offload", "zero3_offload", None)):
        engine = build_actor(model_path, resolved(file, stage=stage), attn_impl="sdpa")
        losses = train_lm(engine, rank, steps)
        weights = gather_state_dict(engine.module)
        entry = {"losses": losses, "optimizer": type(engine.optimizer).__name__}
        if rank == 0:
            reference = weights if reference is None else reference
            entry["max_diff_vs_z0"] = max_diff(weights, reference)
        out[name] = entry
    for name, file, stage in (("critic_z0", "zero2", 0), ("critic_z3", "zero3", None)):
        engine = build_critic(reward_path, resolved(file, stage=stage, lr=1e-3), attn_impl="sdpa")
        out[name] = {"losses": train_critic(engine, rank, steps)}
    return out


def resume_matches(model_path: str, ckpt_root: str, before: int = 4, after: int = 3, drop_errors: bool = False,
                   only: list | None = None) -> dict:
    """For each config: train ``before`` steps, save, train ``after`` more (A); fresh engine, load, train ``after``
    (B). Returns the max weight difference A vs B and both loss tails."""
    from ds_rlhf.engines.builder import build_actor
    from ds_rlhf.engines.hf_export import gather_state_dict
    from ds_rlhf.engines.onebit_adam import find_onebit
    from ds_rlhf.run.checkpoint.deepspeed_io import load_checkpoint, save_checkpoint

    rank = setup()
    out = {}
    cases = {"zero2": resolved("zero2", warmup_steps=10), "zero3": resolved("zero3", warmup_steps=10),
             "onebit": resolved("onebit_adam", freeze_step=2, lr=3e-3)}
    for name, cfg in cases.items():
        if only and name not in only:
            continue
        ckpt = os.path.join(ckpt_root, name)
        a = build_actor(model_path, cfg, attn_impl="sdpa")
        train_lm(a, rank, before, vary=True)
        save_checkpoint(a, ckpt, "step4", {"step": before, "rank_seen": rank})
        tail_a = train_lm(a, rank, after, start=before, vary=True)
        weights_a = gather_state_dict(a.module)
        b = build_actor(model_path, cfg, attn_impl="sdpa")
        client = load_checkpoint(b, ckpt, "step4")
        if drop_errors and find_onebit(b) is not None:
            find_onebit(b).load_error_state_dict(None)  # ablation: resume without the per-rank error buffers
        tail_b = train_lm(b, rank, after, start=before, vary=True)
        weights_b = gather_state_dict(b.module)
        entry = {"tail_a": tail_a, "tail_b": tail_b, "client_state": client,
                 "lr_a": a.get_lr()[0], "lr_b": b.get_lr()[0],
                 "saved_config": os.path.exists(os.path.join(ckpt, "step4", "ds_config.resolved.json"))}
        onebit = find_onebit(b)
        if onebit is not None:
            entry["onebit_compressing"] = onebit.compressing
            entry["onebit_files"] = sorted(f for f in os.listdir(os.path.join(ckpt, "step4")) if "onebit" in f)
        if rank == 0:
            entry["max_diff"] = max_diff(weights_a, weights_b)
        out[name] = entry
    return out


class Regression(torch.nn.Module):
    """Two-layer MLP on a fixed teacher: a small smooth task where Adam-family optimizers converge reliably."""

    def __init__(self, d: int = 32, hidden: int = 64):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)


def regression_data(rank: int, n: int = 256, d: int = 32):
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(d, generator=teacher)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, d, generator=gen)
    return x, torch.sin(x @ w / d ** 0.5) + 0.05 * torch.randn(n, generator=gen)


def _engine_with(model, cfg, torch_adamw: bool):
    """DeepSpeed engine with our builder (OneBitAdam / DeepSpeed AdamW) or with a client torch AdamW."""
    import deepspeed

    from ds_rlhf.engines.builder import build_engine, param_groups

    if not torch_adamw:
        return build_engine(model, cfg, role="actor")
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(param_groups(model, p["weight_decay"]), lr=p["lr"], betas=tuple(p["betas"]),
                            eps=p["eps"], foreach=False)
    init_cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
    return deepspeed.initialize(model=model, optimizer=opt, config=init_cfg)[0]


def onebit_checks(model_path: str, steps: int = 40, freeze_step: int = 8, reg_steps: int = 300) -> dict:
    """1-bit Adam vs AdamW at world size 2: exact equality in warm-up, byte counts after, final losses."""
    from ds_rlhf.engines.models import load_causal_lm
    from ds_rlhf.engines.onebit_adam import find_onebit

    rank = setup()
    out = {}
    cfg = resolved("onebit_adam", freeze_step=freeze_step, lr=3e-3, grad_clip=0.0)
    # 1) warm-up: identical to torch AdamW (same engine path, same gradient all-reduce), bit for bit.
    torch.manual_seed(0)
    base = load_causal_lm(model_path, dtype="fp32", attn_impl="sdpa")
    engines = {"onebit": _engine_with(copy.deepcopy(base), cfg, False),
               "adamw": _engine_with(copy.deepcopy(base), cfg, True)}
    losses = {k: train_lm(e, rank, freeze_step, vary=True) for k, e in engines.items()}
    params = {k: dict(e.module.named_parameters()) for k, e in engines.items()}
    out["warmup_max_diff"] = max((params["onebit"][n] - params["adamw"][n]).abs().max().item() for n in params["adamw"])
    out["warmup_losses_equal"] = losses["onebit"] == losses["adamw"]
    onebit = find_onebit(engines["onebit"])
    out["num_params"] = sum(p.numel() for p in engines["onebit"].module.parameters())
    out["allreduce_on_after_warmup"] = engines["onebit"].enable_backward_allreduce
    # 2) compressed phase on the LM: bytes per step, and the loss reached vs AdamW.
    more = {k: train_lm(e, rank, steps - freeze_step, start=freeze_step, vary=False) for k, e in engines.items()}
    out["lm_final"] = {k: sum(v[-3:]) / 3 for k, v in more.items()}
    out["lm_first"] = losses["adamw"][0]
    out["last_comm"] = onebit.last_comm
    out["comm_totals"] = onebit.comm_totals
    # 3) regression task, from the same init, 1-bit vs AdamW.
    x, y = regression_data(rank)
    reg_losses = {}
    for kind in ("onebit", "adamw"):
        torch.manual_seed(0)
        reg_cfg = resolved("onebit_adam", freeze_step=reg_steps // 5, lr=1e-2, grad_clip=0.0)
        engine = _engine_with(Regression(), reg_cfg, kind == "adamw")
        hist = []
        for i in range(reg_steps):
            sl = slice((i * 16) % 256, (i * 16) % 256 + 16)
            loss = engine(x[sl], y[sl])
            engine.backward(loss)
            engine.step()
            with torch.no_grad():
                hist.append(engine(x, y).item())
        reg_losses[kind] = hist
    out["reg_final"] = {k: sum(v[-10:]) / 10 for k, v in reg_losses.items()}
    out["reg_start"] = reg_losses["adamw"][0]
    return out


def onebit_bf16(model_path: str, steps: int = 10) -> dict:
    """1-bit Adam under a bf16 ds_config (DeepSpeed's fp32-master wrapper): trains and compresses."""
    from ds_rlhf.engines.builder import build_actor
    from ds_rlhf.engines.onebit_adam import find_onebit

    rank = setup()
    engine = build_actor(model_path, resolved("onebit_adam", freeze_step=3, precision="bf16", lr=3e-3),
                         attn_impl="sdpa")
    losses = train_lm(engine, rank, steps)
    onebit = find_onebit(engine)
    return {"losses": losses, "wrapper": type(engine.optimizer).__name__, "last_comm": onebit.last_comm,
            "param_dtype": str(next(engine.module.parameters()).dtype)}
