"""`ds-rlhf export CKPT_DIR OUT_DIR`: one of our DeepSpeed checkpoints -> a Hugging Face `save_pretrained` directory.

CKPT_DIR is a run's checkpoint (`<run>/checkpoints/step_XXXXXXXX`), one engine's directory inside it
(`.../step_XXXXXXXX/actor`) or its tag directory (`.../actor/state`), or a run directory (its newest complete
checkpoint). Any ZeRO stage (0-3) and any world size: the weights are the fp32 master weights of the optimizer
partitions (`deepspeed.utils.zero_to_fp32`; stage 0 without them: the module's own), cast to the checkpoint's compute
dtype (its saved resolved ds_config) unless `--dtype` says otherwise. The model is rebuilt as the run built it
(the run's `config.json` two levels above the checkpoint names the model path, the tokenizer and LoRA), the
weights loaded into it, and the result written like the trainer's own export: safetensors, config, generation
config, tokenizer with its chat template, the resolved ds_config; into a temp directory swapped in at OUT_DIR, so a
failed export leaves an older OUT_DIR whole. Transformers (`AutoModelForCausalLM.from_pretrained`) and vLLM load it.

A checkpoint with a COMPLETE manifest is verified (every file's size and sha256) before DeepSpeed's files are
read, and every file loads weights-only (`weights_only.weights_only_loads`, zero_to_fp32 included): one that pickles
a global other than the DeepSpeed types checkpoints hold is refused, naming the file and the global, before it
runs. OUT_DIR must be absent or an empty directory; `--overwrite` replaces an existing one (or a file or link).
LoRA runs: `--lora merge` (default) folds the adapters into the base weights; `--lora adapter` writes a peft
adapter directory (`PeftModel.from_pretrained(base, OUT_DIR)`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from ds_rlhf.atomic_files import publish_dir
from ds_rlhf.config_rl_names import in_sections
from ds_rlhf.engines.ds_config import RESOLVED_NAME, config_precision
from ds_rlhf.engines.hf_export import write_export
from ds_rlhf.engines.model_source import resolve_model_path
from ds_rlhf.engines.models import CriticModel, RewardModel, apply_seqcls_lora, as_dtype, load_causal_lm, lora_settings
from ds_rlhf.engines.weights_only import CheckpointRefused, load_torch_file, weights_only_loads
from ds_rlhf.run.checkpoint.deepspeed_io import excluded_frozen
from ds_rlhf.run.checkpoint.files import MARKER
from ds_rlhf.run.checkpoint.manager import CheckpointManager
from ds_rlhf.run.run_dir import STEP_DIR, complete_checkpoints, step_of

ROLES = ("actor", "sft", "rm", "critic")  # engine directories our trainers write (RL actor/critic, SFT, RM)
_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class ExportError(RuntimeError):
    """The checkpoint cannot be exported as asked; the message says why and what to pass."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds-rlhf export", description="Turn " + __doc__.split(": ", 1)[1].replace("-> a", "into a", 1),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: ds-rlhf export runs/ppo/checkpoints/step_00000100 runs/ppo/hf_step100 --lora merge")
    p.add_argument("ckpt_dir", help="checkpoints/step_XXXXXXXX of a run (or an engine dir in it, or a run dir)")
    p.add_argument("out_dir", help="where the Hugging Face directory goes (absent or empty, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT_DIR (swapped in atomically once the export is written)")
    p.add_argument("--lora", choices=("merge", "adapter"), default="merge",
                   help="LoRA runs: merge the adapters into the weights (default) or write a peft adapter dir")
    p.add_argument("--tokenizer", default="", help="tokenizer directory (default: the run's model.tokenizer or "
                                                   "model.path)")
    p.add_argument("--model", default="", help="base model directory the run trained (default: the run's "
                                               "model.path from run_dir/config.json)")
    p.add_argument("--role", default="", choices=ROLES,
                   help="which engine of the checkpoint (default: actor, sft or rm, whichever it holds)")
    p.add_argument("--dtype", choices=("auto", *_DTYPES), default="auto",
                   help="weights dtype (auto: the checkpoint's compute dtype, from its resolved ds_config)")
    return p


# ---- finding things -------------------------------------------------------------------------------------------
def locate(ckpt_dir: Path, role: str = "") -> tuple[Path, str, Path | None]:
    """(tag directory with DeepSpeed's files, role, the step directory or None) for any of the accepted paths."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise ExportError(f"{ckpt_dir} is not a directory")
    if any((ckpt_dir / name).is_file() for name in _MODEL_STATES):  # .../actor/state
        return ckpt_dir, role or ckpt_dir.parent.name, ckpt_dir.parent.parent
    if _tag_dir(ckpt_dir) is not None:  # .../step_X/actor
        return _tag_dir(ckpt_dir), role or ckpt_dir.name, ckpt_dir.parent
    if (ckpt_dir / "checkpoints").is_dir():  # a run directory: its newest complete checkpoint

        done = complete_checkpoints(ckpt_dir / "checkpoints")
        if not done:
            raise ExportError(f"{ckpt_dir / 'checkpoints'} holds no complete checkpoint")
        ckpt_dir = done[-1]
    engines = [p.name for p in sorted(ckpt_dir.iterdir()) if p.is_dir() and _tag_dir(p) is not None]
    if not engines:
        raise ExportError(f"{ckpt_dir} holds no DeepSpeed checkpoint (expected e.g. {ckpt_dir}/actor/state/"
                          f"{_MODEL_STATES[0]})")
    if not role:
        role = next((r for r in ROLES[:3] if r in engines), engines[0] if len(engines) == 1 else "")
        if not role:
            raise ExportError(f"{ckpt_dir} holds several engines ({', '.join(engines)}): pick one with --role")
    if role not in engines:
        raise ExportError(f"{ckpt_dir} has no {role!r} engine (it holds {', '.join(engines)})")
    return _tag_dir(ckpt_dir / role), role, ckpt_dir


def _tag_dir(engine_dir: Path) -> Path | None:
    latest = engine_dir / "latest"
    tag = latest.read_text().strip() if latest.is_file() else "state"
    candidate = engine_dir / tag
    return candidate if any((candidate / name).is_file() for name in _MODEL_STATES) else None


def run_config(step_dir: Path | None) -> dict:
    """The run's saved config (run_dir/config.json, two levels above checkpoints/step_X), or {} when absent; keys
    saved in their `rl.<name>` spelling read in their own sections (`config_rl_names.in_sections`)."""
    path = step_dir.parent.parent / "config.json" if step_dir is not None else None
    if path is None or not path.is_file():
        return {}
    return in_sections(json.loads(path.read_text()))


def verify(step_dir: Path | None) -> str:
    """Check the checkpoint's COMPLETE manifest (sizes, sha256) before anything unpickles its files."""
    if step_dir is None or not (step_dir / MARKER).is_file():
        return "not verified (no COMPLETE manifest beside it)"
    problem = CheckpointManager(step_dir.parent.parent, log=lambda text: print(text, file=sys.stderr)).verify(step_dir)
    if problem is not None:
        raise ExportError(f"checkpoint {step_dir} does not verify: {problem}")
    return "verified (sha256 of every file)"


# ---- weights ----------------------------------------------------------------------------------------------
def checkpoint_state_dict(tag_dir: Path) -> tuple[dict, str]:
    """The state dict of the engine's module (CPU tensors; without the frozen base a LoRA checkpoint leaves out)
    and where it came from: the fp32 master weights from the ZeRO / bf16 optimizer partitions when there are any
    (any stage, any world size), else the module weights DeepSpeed saved (ZeRO stage 0 without a partitioned
    optimizer)."""
    if any(tag_dir.glob("*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        noise = io.StringIO()
        try:
            with contextlib.redirect_stdout(noise), weights_only_loads():
                state = get_fp32_state_dict_from_zero_checkpoint(
                    str(tag_dir.parent), tag=tag_dir.name, exclude_frozen_parameters=bool(excluded_frozen(tag_dir)))
            return dict(state), "fp32 master weights (optimizer partitions)"
        except (ValueError, KeyError) as exc:  # an optimizer layout zero_to_fp32 does not know: the module's own
            print(f"[export] zero_to_fp32 cannot read {tag_dir} ({exc}); using the module weights", file=sys.stderr)
    states = tag_dir / _MODEL_STATES[0]
    if not states.is_file():
        raise ExportError(f"{tag_dir}: ZeRO-3 model states without optimizer partitions cannot be rebuilt")
    module = load_torch_file(states)["module"]
    return dict(module), "module weights (model states)"


def _model_section(cfg: dict, model: str) -> SimpleNamespace:
    section = {"path": "", "tokenizer": "", "attn_impl": "auto", "lora_rank": 0, "lora_alpha": 16,
               "lora_targets": "all-linear", **cfg.get("model", {})}
    if model:
        section["path"] = model
    return SimpleNamespace(**section)


def build_module(role: str, cfg: dict, model_path: str):
    """The role's module as the trainer built it (same class, same LoRA wrapping: same state-dict names), in fp32."""
    lora = lora_settings(_model_section(cfg, ""))
    if role == "rm":
        model = RewardModel.from_pretrained(model_path, dtype="fp32", attn_impl="eager", new_head=True)
        if lora:  # a LoRA RM run: adapters on the backbone, the score head trained in full
            apply_seqcls_lora(model.model, lora)
        return model
    if role == "critic":
        critic, reward = cfg.get("critic", {}), cfg.get("reward", {})  # as rl_build._critic_source
        source = critic.get("path") or reward.get("model") or model_path
        init = critic.get("init", "auto")
        if init == "auto":
            init = "reward" if (critic.get("path") or reward.get("model")) and source != model_path else "actor"
        return CriticModel.from_pretrained(resolve_model_path(source), init, dtype="fp32", attn_impl="eager",
                                           lora=lora)
    return load_causal_lm(model_path, dtype="fp32", attn_impl="eager", lora=lora)


def load_weights(module, state: dict, frozen: set[str] = frozenset()) -> None:
    """Every tensor of `module` from `state`; a name may be absent only when its tensor is tied to a loaded one
    (e.g. lm_head.weight tied to the input embeddings) or it is a frozen base weight the checkpoint left out
    (`frozen`: kept as `module` loaded it from the base model)."""
    if any(".lora_A." in name for name in state) and not any(hasattr(m, "peft_config") for m in module.modules()):
        raise ExportError("the checkpoint holds LoRA adapters but the model was built without them: the run's "
                          "config.json (model.lora_rank, lora_alpha, lora_targets) must sit two levels above the "
                          "checkpoint (run_dir/checkpoints/step_X)")
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes differ: another model than the run trained
        first = str(exc).strip().splitlines()
        raise ExportError(f"the checkpoint's weights do not fit the model {type(module).__name__} "
                          f"({first[1].strip() if len(first) > 1 else first[0]} ...): wrong --model?") from None
    tensors = module.state_dict(keep_vars=True)
    loaded = {id(tensors[name]) for name in tensors if name in state}
    kept = loaded | {id(tensors[name]) for name in frozen if name in tensors}  # loaded, or the base's (and ties)
    untied = sorted(name for name in missing if id(tensors[name]) not in kept)
    if untied or unexpected:
        raise ExportError(f"the checkpoint's weights do not fit the model {type(module).__name__}: missing "
                          f"{untied[:5]}, unexpected {sorted(unexpected)[:5]} (wrong --model or --role?)")


# ---- the command ------------------------------------------------------------------------------------------
def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """OUT_DIR may be written: absent, an empty directory, or anything else with `overwrite`."""
    if overwrite or not (out_dir.exists() or out_dir.is_symlink()):
        return
    if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
        return
    what = ("a symbolic link" if out_dir.is_symlink() else "a non-empty directory" if out_dir.is_dir()
            else "an existing file")
    raise ExportError(f"{out_dir} is {what}: pass another OUT_DIR, or --overwrite to replace it")


def export_checkpoint(ckpt_dir, out_dir, *, lora: str = "merge", tokenizer: str = "", model: str = "",
                      role: str = "", dtype: str = "auto", overwrite: bool = False) -> Path:
    """Export one checkpoint (see the module docstring); returns OUT_DIR."""
    from transformers import AutoTokenizer

    check_out_dir(Path(out_dir), overwrite)
    tag_dir, role, step_dir = locate(Path(ckpt_dir), role)
    cfg = run_config(step_dir)
    section = _model_section(cfg, model)
    if not section.path:
        raise ExportError(f"no run config.json two levels above {step_dir or tag_dir}: pass --model (the base "
                          "model directory the run trained)")
    try:
        model_path = resolve_model_path(section.path)
    except FileNotFoundError as exc:
        raise ExportError(f"{exc}; pass --model") from None
    if lora == "adapter" and (section.lora_rank <= 0 or role not in ("actor", "sft")):
        raise ExportError(f"--lora adapter needs a LoRA run's actor/sft checkpoint ({role}, model.lora_rank="
                          f"{section.lora_rank}); use --lora merge")
    resolved = tag_dir / RESOLVED_NAME
    ds_config = json.loads(resolved.read_text()) if resolved.is_file() else None
    precision = dtype if dtype != "auto" else (config_precision(ds_config) if ds_config else "fp32")
    checked = verify(step_dir)
    try:
        state, source = checkpoint_state_dict(tag_dir)
    except CheckpointRefused as exc:
        raise ExportError(str(exc)) from None
    module = build_module(role, cfg, model_path)
    load_weights(module, state, excluded_frozen(tag_dir))
    module.to(as_dtype(precision))
    tok = AutoTokenizer.from_pretrained(tokenizer or section.tokenizer or model_path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if not getattr(tok, "chat_template", None):
        print(f"[export] warning: the tokenizer {tokenizer or section.tokenizer or model_path} has no chat "
              "template", file=sys.stderr)
    info = {"source": str(tag_dir), "role": role, "step": _step(step_dir), "weights": source, "dtype": precision,
            "lora": lora if section.lora_rank > 0 else "none", "base_model": model_path, "checkpoint": checked}

    def write(tmp: Path) -> None:
        write_export(module, module.state_dict(), tok, tmp, ds_config=ds_config, lora=lora)
        (tmp / "ds_rlhf_export.json").write_text(json.dumps(info, indent=1) + "\n")

    check_out_dir(Path(out_dir), overwrite)  # again: the export took a while
    if Path(out_dir).is_symlink() or (Path(out_dir).exists() and not Path(out_dir).is_dir()):
        Path(out_dir).unlink()  # --overwrite of a file or link (not its target): the swap replaces directories
    out = publish_dir(Path(out_dir), write)
    print(f"[export] {role} of {step_dir or tag_dir} ({source}, {precision}, checkpoint {checked}) -> {out}")
    return out


def _step(step_dir: Path | None) -> int | None:
    return step_of(step_dir) if step_dir is not None and STEP_DIR.match(step_dir.name) else None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        export_checkpoint(args.ckpt_dir, args.out_dir, lora=args.lora, tokenizer=args.tokenizer, model=args.model,
                          role=args.role, dtype=args.dtype, overwrite=args.overwrite)
    except ExportError as exc:
        print(f"ds-rlhf export: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
