#!/usr/bin/env bash
# vLLM engine-option sweep of the RL step on one GPU (docs/PERFORMANCE.md, "Rollout options").
#
#   OUT=/results bash bench/rollout_options_gpu.sh              # every run below, in order
#   OUT=/results bash bench/rollout_options_gpu.sh seqs256 tok8192   # just these (the full sweep is longer than
#                                                                    # one 10-minute device command: split it)
#   PLAIN=1 ...   after each RL run, bench/vllm_plain_gpu.py with the same options (plain LLM.generate tokens/s)
#   STEPS=8 MBT=32768 EXTRA="--async" ...   the common rl_step_gpu.py arguments (EXTRA is appended as is)
#   DRY=1 ...     print the commands only
#
# Each run: python3 rl_step_gpu.py --steps $STEPS --micro-batch-tokens $MBT --out $OUT --tag opt_<name> --cfg ...
# -> $OUT/rl_step_opt_<name>.json (+ .png); with PLAIN=1 also $OUT/vllm_plain_plain_<name>.json. A failed run is
# listed in $OUT/failed.txt and the sweep goes on. Note: vLLM's own default (auto) already turns async scheduling
# on for our in-process engine on GPU, so "baseline" is compared with both async_true and async_false.
# The runs use rl_step_gpu.py's default placement (for 0.5B: two sidecar engines); EXTRA="--placement colocated"
# sweeps the in-process engine.
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:?set OUT to the results folder}
STEPS=${STEPS:-8}
MBT=${MBT:-32768}
EXTRA=${EXTRA:-}
NAMES=(baseline async_true async_false seqs256 seqs512 tok8192 tok16384 temp07)

cfg_of() {  # config overrides of one run (rl_step_gpu.py --cfg KEY=VALUE)
  case $1 in
    baseline) ;;
    async_true) echo rollout.async_scheduling=true ;;
    async_false) echo rollout.async_scheduling=false ;;
    seqs256) echo rollout.max_num_seqs=256 ;;
    seqs512) echo rollout.max_num_seqs=512 ;;
    tok8192) echo rollout.max_num_batched_tokens=8192 ;;
    tok16384) echo rollout.max_num_batched_tokens=16384 ;;
    temp07) echo rollout.temperature=0.7 ;;  # processed log-probs, TIS on (the default rl.mismatch)
    *) return 1 ;;
  esac
}

plain_of() {  # the same settings as vllm_plain_gpu.py flags
  case $1 in
    baseline) ;;
    async_true) echo --async-scheduling true ;;
    async_false) echo --async-scheduling false ;;
    seqs256) echo --max-num-seqs 256 ;;
    seqs512) echo --max-num-seqs 512 ;;
    tok8192) echo --max-num-batched-tokens 8192 ;;
    tok16384) echo --max-num-batched-tokens 16384 ;;
    temp07) echo --temperature 0.7 ;;
  esac
}

# shellcheck source=bench/sweep_lib.sh
. ./sweep_lib.sh
select_runs "$@"
for name in "${selected[@]}"; do
  overrides=$(cfg_of "$name")
  cfg_args=()
  for kv in $overrides; do cfg_args+=(--cfg "$kv"); done
  # shellcheck disable=SC2086  # EXTRA is a list of arguments
  run python3 rl_step_gpu.py --steps "$STEPS" --micro-batch-tokens "$MBT" --out "$OUT" --tag "opt_$name" \
      $EXTRA "${cfg_args[@]}" || failed "rl_step opt_$name failed"
  if [ "${PLAIN:-0}" = 1 ]; then
    # shellcheck disable=SC2046  # word-split the flags
    run python3 vllm_plain_gpu.py --out "$OUT" --tag "plain_$name" $(plain_of "$name") \
        || failed "vllm_plain plain_$name failed"
  fi
done

[ "${DRY:-0}" = 1 ] && exit 0
python3 - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path

nan = float("nan")
out = Path(sys.argv[1])
# rollout tok/s: generated tokens / time/rollout per steady step (synchronous runs: the generation itself)
print(f"{'run':<12} {'completions/s':>13} {'rollout s':>9} {'train s':>8} {'rollout tok/s':>13} {'plain tok/s':>11}")
for f in sorted(out.glob("rl_step_opt_*.json")):
    r = json.loads(f.read_text())
    name, c = r["tag"].removeprefix("opt_"), r["config"]
    steady = r["history"][c["warmup_steps"]:] or r["history"]
    rates = [c["prompts"] * c["samples"] * h["response/len_mean"] / h["time/rollout"] for h in steady
             if h.get("time/rollout") and "response/len_mean" in h]
    plain = out / f"vllm_plain_plain_{name}.json"
    tps = json.loads(plain.read_text())["tokens_per_s_best"] if plain.exists() else nan
    med = r["median"]
    print(f"{name:<12} {r['completions_per_s'] or nan:>13.1f} {med.get('time/rollout', nan):>9.2f} "
          f"{med.get('time/train', nan):>8.2f} {statistics.median(rates) if rates else nan:>13.0f} {tps:>11.0f}")
EOF
