"""The RL run's Hugging Face exports: the end-of-run one (`run.export_hf`: `run_dir/export/actor`, and `critic` with a
critic) and the periodic one (`run.export_every`: the actor at `run_dir/export/step_XXXXXXXX`, asked after every
step). Both are collective: every rank calls them.
"""

from __future__ import annotations

from pathlib import Path

from ds_rlhf.engines.hf_export import export_hf
from ds_rlhf.recipes.rl_build import RLParts
from ds_rlhf.run.context import RunContext


def export(ctx: RunContext, parts: RLParts) -> None:
    export_hf(parts.actor, ctx.tokenizer, Path(ctx.run_dir) / "export" / "actor")
    if parts.critic is not None:
        export_hf(parts.critic, ctx.tokenizer, Path(ctx.run_dir) / "export" / "critic")
    ctx.print(f"[rl] exported Hugging Face model(s) to {Path(ctx.run_dir) / 'export'}")


def export_if_due(ctx: RunContext, parts: RLParts, step: int) -> Path | None:
    """`run.export_every`: every N steps, the actor as a Hugging Face directory (weights, tokenizer and chat
    template, resolved ds_config) at run_dir/export/step_XXXXXXXX, written beside and swapped in atomically
    (`hf_export.export_hf`). Collective: call on every rank, after the step (and its checkpoint, if any). Returns
    the directory, or None when no export is due."""
    every = ctx.cfg.run.export_every
    if every <= 0 or step <= 0 or step % every:
        return None
    out = Path(ctx.run_dir) / "export" / f"step_{step:08d}"
    export_hf(parts.actor, ctx.tokenizer, out)
    ctx.print(f"[rl] exported the actor at step {step} to {out}")
    return out
