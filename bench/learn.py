"""Learning benchmark: does GRPO make a real pretrained model better, and how fast in seconds and tokens?

GRPO from a model's own weights (no SFT) on a task whose data and reward are plain files (`bench/learn_tasks/`):
- `arithmetic`: generated word problems (2-3 operands; +, -, x; seeded), an unlimited training stream and a fixed
  held-out set of 500, the answer after `####`;
- `gsm8k`: the GSM8K test split (`../shared/data/gsm8k/test.jsonl`) re-split 1000 train / 319 held out: a learning
  demonstration on real problems, not a GSM8K score.
Each mode (`sync`: exact on-policy; `async`: the next batch generated while this one trains) runs the trainer
(`ds-rlhf train-ppo`) with real EOS (generation stops at the model's end-of-turn token; no `ignore_eos`) and a
greedy held-out evaluation at step 0 and every `--eval-every` steps: exact-match (`eval/pass@1` of
`rewards.py:eval_reward`) and format compliance (`eval/reward/.../format`), against training seconds (the steps'
wall time, evaluation excluded) and generated tokens. Writes `learn_<task>.json` and `learn_<task>.png` (exact-match
against seconds and against steps, both modes) into `--out`.

    python3 bench/learn.py --model /models/smollm2 --task arithmetic --steps 150 --eval-every 15 --out $OUT
    python3 bench/learn.py --model SmolLM2-135M-Instruct.Q4_1.gguf ...     # a GGUF is converted once (cached)
    python3 bench/learn.py --tiny --out /tmp/learn                         # CPU: the tiny model, end to end
    ds-rlhf bench learn --model ... [same options]

Multi-turn episodes with a tool: `--environment path.py:Name` (a path from the current directory or from the
repository) runs the trainer with `env.name` instead of the reward files (synchronous by default; `--modes
sync,async` also plays the next step's episodes while a step trains):

    python3 bench/learn.py --model X --task arithmetic --modes sync \
        --environment ds_rlhf/agent/examples/calculator.py:CalculatorEnv

Each prompt then plays `--max-turns` turns at most (`env.max_turns`), every turn up to `--max-new-tokens`; the
stores are prepared as plain text (`--no-apply_chat_template`: the episode runner renders the chat prompt with the
tools). The training reward and the held-out score are the environment's: for the calculator, 1 when the last
number of the final answer (the turn without a tool call) equals the answer, so the exact match is the
environment's correctness (a `#### N` ending the answer satisfies it; so does any answer ending in the right
number). Each evaluation point also records `tool_call_rate` (turns that called a tool / generated turns) and
`turns_mean`, each step the training `tool_call_rate` and `turns_mean`; the PNG draws the tool-call rate beside the
exact match.

A model that never calls the tool gives GRPO nothing to raise. `--warm-start-steps N` (arithmetic, an environment
with a `calculator` tool) first fine-tunes it on demonstrations: the training stream's first N x 32 problems as
two-turn episodes (a `calculator` call on the problem's expression in the tool-call format the prompt asks for, the
tool's result, `#### N`), played through the environment and written to `<out>/warm_start_<task>.jsonl` as chat
`messages` (`agent/demonstrations.py`); `ds-rlhf prep-sft` (loss on the assistant turns only) and `ds-rlhf
train-sft` run N steps on them (lr `--warm-start-lr`), and GRPO starts from the SFT export. The JSON's
`warm_start` holds the steps, seconds, demonstrations, first and last SFT loss, and per mode (`step0`) the exact
match, tool-call rate and turns of GRPO's step-0 evaluation, the SFT'd model's:

    python3 bench/learn.py --model X --task arithmetic --modes sync,async --warm-start-steps 40 \
        --environment ds_rlhf/agent/examples/calculator.py:CalculatorEnv

Training reward: `rewards.py:train_reward` (1 for the right number, 0.1 for a wrong number in the format: one
`#### N` ending the response); `--reward lenient` trains on `lenient_train_reward` (the last number after any
`####`), which a policy can game. The held-out evaluation reports both exact-match rules.
Defaults: 32 prompts x 8 samples per step, up to 512 new tokens, temperature 1, lr 5e-6, no KL, GRPO advantages
(score - group mean) / the batch's std (the trainer's `rl.scale_rewards batch`; TRL's `scale_rewards="batch"`); the
placement is two sidecar vLLM engines and micro-batches of up to 49152 tokens with gradient checkpointing on a GPU
(the engines' KV cache sized by the step's sequences, `ds_rlhf/memory/engine_budget.py`: a planned device peak of
about 26 GiB for SmolLM2-135M, `ds-rlhf memory`), the in-process engine on a CPU. Per step the JSON also records
the rollout seconds and `rollout/tail_decode_frac`, the share of the rollout's decode iterations spent after half of
the samples had finished (waiting for the longest ones), and per mode the GPU's mean utilisation and peak used
memory over the training steps (`gpu`: NVML, sampled every 0.5 s; empty on a CPU).
`--cfg key=value` passes any trainer setting (`--cfg rollout.max_staleness=2`: async mode's staleness bound).

Seeds: `--seeds N` runs each mode N times with `run.seed` 0 .. N-1 (`--seed-list 3,7` names them), each in
`work_<task>/run_<mode>_seed<S>`, and writes every run's curve (`modes`: "<mode>, seed <S>"), per mode the
per-step median and min/max band of the held-out exact match, the same against training seconds, and per seed and
as the median the time to 15, 25 and 50 % exact match (`seeds`, `learn_seeds.py`); the PNG draws the seeds, the
median and the band. `--concurrent K` runs up to K seeds at once on one machine (separate trainer processes, the
starts `--stagger` seconds apart), each with the same settings:

    python3 bench/learn.py --model X --modes sync,async --seeds 5 --concurrent 3 --stagger 35 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import learn_seeds
from gpu_timeline import Sampler
from learn_inputs import HELDOUT, ds_rlhf, prep_stores, task_files
from learn_results import curve, gpu_use, merge, plot
from learn_tasks.tasks import INSTRUCTION, heldout_rows, training_rows
from transformers import AutoTokenizer

from ds_rlhf.agent.adapters import load_environment
from ds_rlhf.agent.demonstrations import tool_call_demonstration
from ds_rlhf.agent.rendering import ChatRenderer
from ds_rlhf.agent.tool_calls import ToolCall
from ds_rlhf.engines.model_source import resolve_model_source
from ds_rlhf.telemetry.logger import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "bench" / "learn_tasks"
SHARED_GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
TRAIN_REWARDS = {"strict": "train_reward", "lenient": "lenient_train_reward", "none": ""}
EPISODE_OBSERVATION_TOKENS = 64  # --environment: room per turn for a tool's result turn beside the generated tokens
WARM_START_BATCH = 32  # --warm-start-steps: demonstrations per SFT step, each used once (--tiny: 4)
WARM_START_TOOL = "calculator"  # the tool the demonstrations call, with the problem's expression


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="", help="HF model directory, Hub id or .gguf file (required unless --tiny)")
    ap.add_argument("--task", choices=("arithmetic", "gsm8k"), default="arithmetic")
    ap.add_argument("--modes", default="", help="comma list of sync, async (default: both; sync with "
                    "--environment)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--minutes", type=float, default=0, help="stop each mode's run after this long (0 = no limit)")
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--eval-size", type=int, default=0, help="held-out prompts evaluated (0 = the task's whole set)")
    ap.add_argument("--prompts-per-step", type=int, default=32)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-prompt-len", type=int, default=512, help="prompt tokens (the stores drop longer ones)")
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--reward", choices=tuple(TRAIN_REWARDS), default="strict", help="the training reward: strict "
                    "(one `#### N` ending the response), lenient (the last number after any `####`; gameable) or none "
                    "(every score 0: with --cfg rl.teacher=DIR --cfg rl.distill_loss=jsd the teacher alone teaches; "
                    "held-out scores as usual)")
    ap.add_argument("--micro-batch-tokens", type=int, default=-1, help="data.micro_batch_tokens, the training "
                    "phase's token budget per micro-batch (-1: 49152 with gradient checkpointing on a GPU, chosen by "
                    "the memory split under --cfg run.max_gpu_memory_gb=N; the trainer's default on a CPU)")
    ap.add_argument("--gsm8k", type=Path, default=SHARED_GSM8K, help="GSM8K test.jsonl (task gsm8k)")
    ap.add_argument("--environment", default="", help="path.py:Name: train and evaluate on multi-turn episodes "
                    "with this environment (env.name), e.g. ds_rlhf/agent/examples/calculator.py:CalculatorEnv")
    ap.add_argument("--max-turns", type=int, default=4, help="--environment: generated turns per episode")
    ap.add_argument("--warm-start-steps", type=int, default=0, help="--environment, arithmetic: SFT steps on "
                    "calculator demonstrations of the training stream before GRPO (0 = none)")
    ap.add_argument("--warm-start-lr", type=float, default=5e-5, help="the warm start's SFT learning rate")
    ap.add_argument("--cfg", action="append", default=[], help="extra trainer setting key=value (repeatable)")
    ap.add_argument("--tiny", action="store_true", help="CPU end-to-end check: the tiny model, 2 steps, 16 prompts")
    ap.add_argument("--seeds", type=int, default=1, help="runs per mode, with run.seed 0 .. N-1: every seed's "
                    "curve, the median, the min/max band and the time to 15/25/50%% (1: one run, the trainer's seed)")
    ap.add_argument("--seed-list", default="", help="comma list of run.seed values instead of 0 .. N-1")
    ap.add_argument("--concurrent", type=int, default=1, help="seeds run at once (separate trainer processes)")
    ap.add_argument("--stagger", type=float, default=35.0, help="--concurrent: seconds between two runs' starts")
    ap.add_argument("--out", type=Path, default=Path("bench_learn"))
    ap.add_argument("--merge", type=Path, nargs="+", help="join the modes of these learn_<task>.json files (runs of "
                    "one mode each, e.g. on a machine that allows one run per call; --seeds runs with their seeds, a "
                    "mode's seeds from several bench runs pooled into one median and band) into --out's JSON and PNG; "
                    "no run")
    ap.add_argument("--labels", nargs="+", default=[], help="with --merge: one label per file, added to its modes' "
                    "names (two runs of one mode with different settings: --labels whole partial -> 'sync, whole', "
                    "'sync, partial')")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.labels and len(args.labels) != len(args.merge or []):
        ap.error(f"--labels: give one label per --merge file ({len(args.merge or [])}), got {len(args.labels)}")
    if args.merge:
        return args
    if args.tiny:
        args.model = "tiny"
        args.steps, args.eval_every, args.eval_size = min(args.steps, 2), 1, args.eval_size or 16
        args.prompts_per_step, args.n_samples, args.max_new_tokens = 4, 4, min(args.max_new_tokens, 16)
        args.max_prompt_len, args.max_turns = min(args.max_prompt_len, 256), min(args.max_turns, 2)
    elif not args.model:
        ap.error("--model is required (or --tiny)")
    if args.warm_start_steps < 0:
        ap.error(f"--warm-start-steps: give 0 (none) or a number of SFT steps, got {args.warm_start_steps}")
    if args.warm_start_steps and not args.environment:
        ap.error("--warm-start-steps demonstrates tool calls: add --environment (e.g. "
                 "ds_rlhf/agent/examples/calculator.py:CalculatorEnv)")
    if args.warm_start_steps and args.task != "arithmetic":
        ap.error(f"--warm-start-steps builds each calculator call from an arithmetic problem's expression; task "
                 f"{args.task} has none: use --task arithmetic")
    modes = args.modes or ("sync" if args.environment else "sync,async")
    args.modes = [m.strip() for m in modes.split(",") if m.strip()]
    if not set(args.modes) <= {"sync", "async"} or not args.modes:
        ap.error(f"--modes: comma list of sync, async; got {','.join(args.modes)!r}")
    if args.environment:
        args.environment = environment_spec(args.environment)
    if args.seeds < 1 or args.concurrent < 1 or args.stagger < 0:
        ap.error("--seeds and --concurrent: give 1 or more; --stagger: seconds >= 0")
    args.seed_values = learn_seeds.seed_list(args.seeds, args.seed_list) if args.seeds > 1 or args.seed_list else []
    if args.seed_values and any(c.removeprefix("--").startswith("run.seed=") for c in args.cfg):
        ap.error("--cfg run.seed: --seeds / --seed-list set each run's run.seed")
    return args


def environment_spec(spec: str) -> str:
    """`path.py:Name` with the path made absolute: from the current directory, else from the repository."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise SystemExit(f"learn: --environment {spec!r}: give path/to/file.py:Name")
    for base in (Path.cwd(), ROOT):
        if (base / path).is_file():
            return f"{(base / path).resolve()}:{name}"
    raise SystemExit(f"learn: --environment {spec!r}: no file {path} here or in {ROOT}")


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def trainer_args(args, model: str, stores: dict[str, Path], run_dir: Path, mode: str, gpu: bool,
                 seed: int | None = None) -> list[str]:
    placement = ["--rollout.placement", "sidecar", "--rollout.sidecar_engines", "2"] if gpu else []
    capped = any(item.partition("=")[0].removeprefix("--") == "run.max_gpu_memory_gb" for item in args.cfg)
    # under a memory cap the trainer's split picks the micro-batch budget that fits (memory/split.py)
    budget = args.micro_batch_tokens if args.micro_batch_tokens >= 0 else (49152 if gpu and not capped else 0)
    placement += ["--data.micro_batch_tokens", str(budget)] if budget else []
    # the default 49152-token budget on a GPU comes with gradient checkpointing, so the default run plans a device
    # peak under 30 GiB (the engines' KV cache sized by the work, memory/engine_budget.py); a --cfg of the user's wins
    given = {item.partition("=")[0].removeprefix("--") for item in args.cfg}
    if gpu and not capped and args.micro_batch_tokens < 0 and "model.gradient_checkpointing" not in given:
        placement += ["--model.gradient_checkpointing", "true"]
    cfg = ["--model.path", model, "--data.train", str(stores["train"]), "--data.eval", str(stores["heldout"]),
           "--run.output_dir", str(run_dir), "--run.overwrite", "true", "--run.steps", str(args.steps),
           "--run.eval_every", str(args.eval_every), "--run.eval_before_train", "true",
           "--run.save_every", "0", "--run.export_hf", "false", "--run.progress", "false",
           "--run.tensorboard", "false", "--run.sample_log_every", str(args.eval_every),
           "--rl.algo", "grpo", "--rl.kl_coef", "0", *reward_args(args), "--eval.max_prompts", str(args.eval_size),
           "--rl.prompts_per_step", str(args.prompts_per_step), "--rollout.n_samples", str(args.n_samples),
           "--rollout.max_new_tokens", str(args.max_new_tokens), "--rollout.temperature", "1.0",
           "--data.max_prompt_len", str(args.max_prompt_len), "--optim.lr", str(args.lr),
           "--rollout.async_generation", str(mode == "async").lower(), *placement,
           *(["--run.seed", str(seed)] if seed is not None else [])]
    for item in args.cfg:
        key, _, value = item.partition("=")
        cfg += [f"--{key.removeprefix('--')}", value]
    return cfg


def write_demonstrations(args, model: str, path: Path, n: int) -> int:
    """--warm-start-steps: the first `n` problems of the training stream as two-turn calculator episodes, one JSON
    line each (`messages`: the chat conversation, as any SFT trainer reads it; `answer`, `expression`), played
    through the environment and rendered as the episode runner renders them (`agent/demonstrations.py`): the first
    user message with the tools, a `calculator` call on the problem's expression in the tool-call format the
    prompt asks for, the tool's result turn, and `#### N`."""
    factory = load_environment(args.environment)
    probe = factory()
    params = getattr(probe, "params", {}).get(WARM_START_TOOL)
    if not params:
        raise SystemExit(f"learn: --warm-start-steps: the environment {args.environment} has no {WARM_START_TOOL} "
                         "tool to demonstrate (use ds_rlhf/agent/examples/calculator.py:CalculatorEnv)")
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model), tools=probe.specs)
    if renderer.tools_in_template:
        raise SystemExit(f"learn: --warm-start-steps: {args.model}'s chat template shows the tools itself (tools=), "
                         "which `ds-rlhf prep-sft` does not pass it, so the SFT prompts would differ from the "
                         "episodes'; use --warm-start-steps 0 with this model")
    with path.open("w") as out:
        for row in training_rows(n, heldout_rows(HELDOUT), expressions=True):
            env_row = {"prompt": row["prompt"], "answer": row["label"]}  # what reset gets from the prompt store
            call = ToolCall(WARM_START_TOOL, {params[0]: row["expression"]})
            messages, reward = tool_call_demonstration(factory(), renderer, env_row, call, f"#### {row['label']}")
            if reward != 1.0:
                raise SystemExit(f"learn: --warm-start-steps: the environment scored the demonstration of "
                                 f"{row['prompt']!r} {reward}, not 1")
            out.write(json.dumps({"messages": messages, "answer": row["label"], "expression": row["expression"]})
                      + "\n")
    return n


def warm_start(args, model: str, work: Path, gpu: bool) -> tuple[str, dict]:
    """--warm-start-steps: the project's SFT recipe (`ds-rlhf train-sft`) on the demonstrations (`prep-sft`: the
    loss on the assistant turns only), each used once. Returns the model GRPO starts from (the SFT run's HF export)
    and the JSON's `warm_start` record."""
    t0 = time.perf_counter()
    batch = 4 if args.tiny else WARM_START_BATCH
    demos = args.out / f"warm_start_{args.task}.jsonl"
    n = write_demonstrations(args, model, demos, args.warm_start_steps * batch)
    store, run_dir = work / "store_warm_start", work / "run_warm_start"
    context = args.max_prompt_len + args.max_turns * (args.max_new_tokens + EPISODE_OBSERVATION_TOKENS)
    ds_rlhf("prep-sft", "--tokenizer", model, "--input", str(demos), "--output", str(store), "--overwrite",
            "--quiet", "--max_len", str(context), log=work / "prep_warm_start.log")
    budget = args.micro_batch_tokens if args.micro_batch_tokens >= 0 else (49152 if gpu else 0)
    print(f"learn: warm start: {args.warm_start_steps} SFT steps on {n} demonstrations ...", flush=True)
    ds_rlhf("train-sft", "--model.path", model, "--data.train", str(store), "--run.output_dir", str(run_dir),
            "--run.overwrite", "true", "--run.steps", str(args.warm_start_steps), "--optim.batch_size", str(batch),
            "--optim.lr", str(args.warm_start_lr), "--run.save_every", "0", "--run.export_hf", "true",
            "--run.progress", "false", "--run.tensorboard", "false",
            *(["--data.micro_batch_tokens", str(budget)] if budget else []), log=work / "train_warm_start.log")
    losses = [m["train/loss"] for m in read_metrics(run_dir) if "train/loss" in m]
    record = {"steps": args.warm_start_steps, "seconds": round(time.perf_counter() - t0, 1), "demonstrations": n,
              "batch_size": batch, "lr": args.warm_start_lr, "file": str(demos),
              "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None}
    return str(run_dir / "export"), record


def reward_args(args) -> list[str]:
    """The reward files' functions, or with `--environment` the environment (its reward trains and scores)."""
    if args.environment:
        context = args.max_prompt_len + args.max_turns * (args.max_new_tokens + EPISODE_OBSERVATION_TOKENS)
        return ["--env.name", args.environment, "--env.max_turns", str(args.max_turns),
                "--rollout.max_model_len", str(context)]
    scoring = ["--eval.reward_fn", f"{TASKS / 'rewards.py'}:eval_reward"]
    if not TRAIN_REWARDS[args.reward]:
        return scoring
    return ["--reward.fn", f"{TASKS / 'rewards.py'}:{TRAIN_REWARDS[args.reward]}", *scoring]


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        print(f"learn: wrote {merge(args.merge, args.out, args.labels)}")
        return 0
    work = args.out / f"work_{args.task}"
    work.mkdir(exist_ok=True)
    gpu = has_gpu()
    model = resolve_model_source(args.model)  # tiny, a directory, a Hub id, or a .gguf converted once (cached)
    stores = prep_stores(task_files(args, work), model, work, args.max_prompt_len, text=bool(args.environment))
    policy, warm = warm_start(args, model, work, gpu) if args.warm_start_steps else (model, None)
    result = {"task": args.task, "model": args.model, "model_name": Path(args.model).name, "device":
              _device_name(gpu), "date": time.strftime("%Y-%m-%d"), "settings": {
                  k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("out",)}
              | {"instruction": INSTRUCTION},
              "modes": {}} | ({"warm_start": warm} if warm else {})
    if args.seed_values:  # every mode once per seed: learn_seeds.py's JSON and PNG
        return learn_seeds.run_seeds(args, result, lambda mode, seed: run_mode(args, result, policy, stores, work,
                                                                               gpu, mode, seed))
    for mode in args.modes:
        result["modes"][mode] = run_mode(args, result, policy, stores, work, gpu, mode)
    out_json = args.out / f"learn_{args.task}.json"
    out_json.write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"learn_{args.task}.png")
    print(f"learn: wrote {out_json} and {out_json.with_suffix('.png')}")
    return 0


def run_mode(args, result: dict, policy: str, stores: dict[str, Path], work: Path, gpu: bool, mode: str,
             seed: int | None = None) -> dict:
    """One trainer run of `mode` (with `seed`: its run.seed, in run_<mode>_seed<S>): its curve, GPU use, summary."""
    name, tag = (mode, "") if seed is None else (f"{mode}, seed {seed}", f"_seed{seed}")
    run_dir = work / f"run_{mode}{tag}"
    print(f"learn: {args.task}, {name}: {args.steps} steps, eval every {args.eval_every} ...", flush=True)
    t0 = time.perf_counter()
    with Sampler(0.5) as sampler:
        ds_rlhf("train-ppo", *trainer_args(args, policy, stores, run_dir, mode, gpu, seed),
                log=work / f"train_{mode}{tag}.log", minutes=args.minutes)
    metrics = read_metrics(run_dir)
    run = curve(metrics)
    run["gpu"] = gpu_use(sampler.samples, sampler.source, metrics)
    run["summary"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    run["summary"]["gpu_util_mean"] = run["gpu"]["gpu_util_mean"]
    warm = result.get("warm_start")
    if warm and run["points"]:  # GRPO's step 0: the SFT'd model, before any RL
        warm.setdefault("step0", {})[name] = {k: run["points"][0].get(k) for k in ("exact_match", "tool_call_rate",
                                                                                  "turns_mean")}
    print(f"learn: {name}: {json.dumps(run['summary'])}", flush=True)
    return run


def _device_name(gpu: bool) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name(0) if gpu else f"CPU ({platform.processor() or platform.machine()})"


if __name__ == "__main__":
    sys.exit(main())
