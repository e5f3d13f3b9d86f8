# Sourced by the bench sweeps (rollout_options_gpu.sh, sm_split_sweep.sh), which define NAMES, OUT and cfg_of:
# `run CMD...` echoes the command and runs it unless DRY=1; `failed MSG` reports a failed run on stderr and in
# $OUT/failed.txt; `select_runs NAME...` sets `selected` to the names given (or all of NAMES), refuses an unknown
# one and makes $OUT.

run() {
  echo "+ $*"
  if [ "${DRY:-0}" = 1 ]; then return 0; fi
  "$@"
}

failed() {
  echo "$*" >&2
  [ "${DRY:-0}" = 1 ] || echo "$*" >> "$OUT/failed.txt"
}

select_runs() {
  selected=("$@")
  [ ${#selected[@]} -gt 0 ] || selected=("${NAMES[@]}")
  for name in "${selected[@]}"; do
    cfg_of "$name" > /dev/null || { echo "unknown run '$name' (known: ${NAMES[*]})" >&2; exit 2; }
  done
  [ "${DRY:-0}" = 1 ] || mkdir -p "$OUT"
}
