# Environment shared by tests, the demo and the benchmarks: offline, caches inside the checkout, CPU DeepSpeed
# when no GPU. Sourced, not executed. Users need none of it: every command sets what it needs itself
# (entrypoints/main.py runtime_env_defaults: tokenizers parallelism off, unbuffered output, bytecode caching, the CPU
# accelerator without a GPU) and downloads from the Hub unless HF_HUB_OFFLINE=1.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export DS_RLHF_CACHE=${DS_RLHF_CACHE:-$root/.cache/ds_rlhf}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-offline}
export PYTHONUNBUFFERED=1
# Let Python cache bytecode (.pyc, in the checkout's .venv and ds_rlhf/): uv installs packages without it, and with
# PYTHONDONTWRITEBYTECODE=1 (set on some machines, ours among them) every process compiled each module it imported
# from source again. Measured on the 2-core CPU machine, 2026-12-01: `import vllm` 18.4 s -> 7.5 s, a 2-step tiny
# GRPO run 54.3 s -> 35.8 s; the test suite starts dozens of such processes.
unset PYTHONDONTWRITEBYTECODE
if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
fi
