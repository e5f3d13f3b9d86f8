#!/usr/bin/env bash
# Run the GPU benchmarks on a machine without registry access, from folders brought over in transfers of at most
# 64 MiB each. The folders are built on a machine with registry access, in the project root:
#   .vb1 .vb2  vLLM 0.26.0 for torch 2.11 / Python 3.12, trimmed (`OUT=$PWD bash ../shared/device/vllm/make_bundle.sh`)
#   .whl       DeepSpeed and the wheels it imports (`bash ../shared/device/prep_deepspeed.sh`)
#   .rm1 .rm2  SmolLM2-135M-Instruct as a Q4_1 GGUF, in two halves (`bash ../shared/device/real_model/prep_smollm2.sh`)
# A transfer's folders do not outlive the call that brought them; /tmp does, while the machine stays up. So:
#   bash bench/offline_gpu.sh park              # in each call: copy the brought folders to /tmp/park
#   bash bench/offline_gpu.sh run CMD [ARG...]  # install what is parked (idempotent), then run CMD with
#                                               # PYTHONPATH, vLLM's offline settings and TORCH_CUDA_ARCH_LIST=9.0 set
# `run` also parks the folders its own call brought and installs each part once all its folders are parked.
# Order of transfers: .vb1 | .rm1 | .vb2 .whl | .rm2 + run. pytest (for tests/gpu) may travel in .whl.
#   CACHES=path.tgz  (run) unpack DeepSpeed's JIT build and vLLM's compile cache into $HOME before CMD
#   SAVE_CACHES=1    (run) write them to $OUT/caches.tgz after CMD (the next fresh machine skips ~2.5 min of builds)
#   OUT=dir          (run) CMD's output is also written to dir/run.log while it runs
set -euo pipefail
P=/tmp/park
park() { mkdir -p "$P"; for d in .vb1 .vb2 .whl .rm1 .rm2; do [ -d "$d" ] && cp -r "$d" "$P/"; done; ls -a "$P" | tr '\n' ' '; echo; }

install_all() {
  if [ ! -f /tmp/vsite/vllm_env.sh ] && [ -d "$P/.vb1" ] && [ -d "$P/.vb2" ]; then
    VB_ROOT=$P bash "$P/.vb1/install.sh" /tmp/vsite --check >/tmp/vsite.log 2>&1 || { tail -5 /tmp/vsite.log; exit 1; }
  fi
  if [ ! -d /tmp/ds/deepspeed ] && [ -d "$P/.whl" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ds "$P"/.whl/*.whl
  fi
  if [ ! -f /tmp/rm/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -d "$P/.rm1" ] && [ -d "$P/.rm2" ]; then
    mkdir -p /tmp/rm && cp -r "$P/.rm1" /tmp/rm/ && bash "$P/.rm2/install_smollm2.sh"
  fi
}

case "${1:-}" in
  park) park ;;
  run)
    shift; park >/dev/null; install_all
    # shellcheck disable=SC1091
    [ -f /tmp/vsite/vllm_env.sh ] && . /tmp/vsite/vllm_env.sh
    export PYTHONPATH=$PWD:/tmp/ds:/tmp/rm/site${PYTHONPATH:+:$PYTHONPATH} TORCH_CUDA_ARCH_LIST=9.0
    [ -n "${CACHES:-}" ] && [ -f "$CACHES" ] && tar -xzf "$CACHES" -C "$HOME"
    rc=0
    if [ -n "${OUT:-}" ]; then  # CMD's output also lands in $OUT/run.log as it comes: a call cut short keeps it
      "$@" 2>&1 | tee "$OUT/run.log" || rc=$?
    else
      "$@" || rc=$?
    fi
    if [ -n "${SAVE_CACHES:-}" ] && [ -n "${OUT:-}" ]; then
      (cd "$HOME" && tar -czf "$OUT/caches.tgz" --ignore-failed-read .cache/torch_extensions .cache/vllm .triton 2>/dev/null) || true
    fi
    exit $rc ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
