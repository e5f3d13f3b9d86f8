#!/usr/bin/env bash
# The README's quick start: your model, your prompts, a reward, one training command on one GPU (or the CPU), and the
# report. Needs `ds-rlhf` on PATH (pip install, or a checkout's .venv/bin) and nothing from scripts/env.sh.
#   MODEL    a Hub id (org/name), a Hugging Face directory or a .gguf file     (default: tiny, the built-in test model)
#   PROMPTS  JSONL rows {"prompt": ..., "answer": ...}                           (default: examples/prompts.jsonl)
#   REWARD   a built-in rule (math_shaped, gsm8k, format, math_verify) or your function, file.py:name
#                                                                                (default: math_shaped)
#   OUT      the output directory (default: runs/quickstart)    STEPS  training steps (default: 20)
# Further arguments go to `ds-rlhf train-ppo`, e.g. --rollout.max_new_tokens 64 --rl.prompts_per_step 4.
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct PROMPTS=my_prompts.jsonl REWARD=my_reward.py:score bash examples/quickstart.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:-tiny}
PROMPTS=${PROMPTS:-$here/prompts.jsonl}
REWARD=${REWARD:-math_shaped}
OUT=${OUT:-runs/quickstart}
STEPS=${STEPS:-20}

# 1. the prompts, tokenized once with the model's chat template
ds-rlhf prep-prompts --tokenizer "$MODEL" --input "$PROMPTS" --output "$OUT/prompts" --overwrite --quiet
# 2. GRPO on one process: vLLM rollouts (vLLM-CPU without a GPU), the reward, DeepSpeed training, a progress line per
#    step; checkpoints, metrics.jsonl, samples.jsonl and the export in $OUT/run
ds-rlhf train-ppo --model.path "$MODEL" --data.train "$OUT/prompts" --rl.algo grpo --reward.fn "$REWARD" \
    --run.output_dir "$OUT/run" --run.steps "$STEPS" "$@"
# 3. the report: reward and length curves, KL, samples -> $OUT/run/report/index.html
ds-rlhf report "$OUT/run"
