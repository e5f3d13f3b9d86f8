# Environment shared by tests, the demo and the benchmarks: offline, caches inside the checkout, CPU DeepSpeed
# when no GPU. Sourced, not executed.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export DS_RLHF_CACHE=${DS_RLHF_CACHE:-$root/.cache/ds_rlhf}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-offline}
export PYTHONUNBUFFERED=1
if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
fi
