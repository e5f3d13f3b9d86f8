#!/usr/bin/env bash
# The async RL step over the engines' share of the SMs (rollout.sm_split, docs/PERFORMANCE.md, "SM split"): the
# time-slicing baseline, then CUDA MPS with the engines on 30..70% of the SMs (the trainer on the rest), then the
# share the run plans itself, back to back on one GPU.
#
#   OUT=/results bash bench/sm_split_sweep.sh                 # every run below, in order
#   OUT=/results bash bench/sm_split_sweep.sh off mps50 mps60 # just these (the whole sweep is longer than one
#                                                             # 10-minute device command: split it, off first)
#   STEPS=12 EXTRA="--max-gpu-memory-gb 48" ...   the common rl_step_gpu.py arguments (EXTRA is appended as is)
#   DRY=1 ...     print the commands only
#
# Each run: python3 rl_step_gpu.py --async --steps $STEPS --out $OUT --tag sm_<name> --cfg ... ->
# $OUT/rl_step_sm_<name>.json (+ .png); compare completions_per_s, the phases' medians and mfu. A failed run is
# listed in $OUT/failed.txt and the sweep goes on. Needs nvidia-cuda-mps-control on PATH and the GPU in the Default
# compute mode (each run starts and stops a daemon of its own; `mps` refuses to run otherwise).
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:?set OUT to the results folder}
STEPS=${STEPS:-12}
EXTRA=${EXTRA:-}
NAMES=(off mps30 mps40 mps50 mps60 mps70 mpsplan)

cfg_of() {  # config overrides of one run (rl_step_gpu.py --cfg KEY=VALUE)
  case $1 in
    off) ;;
    mps30|mps40|mps50|mps60|mps70) echo rollout.sm_split=mps rollout.engine_sm_percent=${1#mps} ;;
    mpsplan) echo rollout.sm_split=mps ;;  # the share from the planned work (memory/sm_share.py)
    *) return 1 ;;
  esac
}

# shellcheck source=bench/sweep_lib.sh
. ./sweep_lib.sh
select_runs "$@"
for name in "${selected[@]}"; do
  cfg_args=()
  for kv in $(cfg_of "$name"); do cfg_args+=(--cfg "$kv"); done
  # shellcheck disable=SC2086  # EXTRA is a list of arguments
  run python3 rl_step_gpu.py --async --steps "$STEPS" --out "$OUT" --tag "sm_$name" $EXTRA "${cfg_args[@]}" \
      || failed "rl_step sm_$name failed"
done
