"""A short GRPO run on the real model, in its own process (it builds its own vLLM engine), recording what the tests
check: `python grpo_worker.py ARGS_JSON PROMPTS_JSON GREEDY_TOKENS OUT_JSON`.

Writes OUT_JSON with
  vllm_greedy     the rollout engine's greedy response ids for PROMPTS (the weights as loaded, before training)
  stop_token_ids  the stop ids of each step's sampling spec
  samples         per step: each rollout's response ids and finish reason
  trajectories    per step: each row's response length and the number of response tokens its action mask trains
  trainer_greedy  the trained actor's greedy response ids for PROMPTS (transformers generate, float32)
"""

from __future__ import annotations

import json
import os
import sys

from real_model_kit import hf_greedy

from ds_rlhf.config import parse_config
from ds_rlhf.distributed import ensure_distributed
from ds_rlhf.engines.models import unwrap
from ds_rlhf.recipes import rl as rl_step
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.rollout import SamplingSpec


def main() -> None:
    args, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    new_tokens, out_path = int(sys.argv[3]), sys.argv[4]
    ensure_distributed()
    trainer = RLTrainer(parse_config(args))
    eos = trainer.ctx.tokenizer.eos_token_id
    engine = trainer.parts.rollout
    record = {"stop_token_ids": [], "samples": [], "trajectories": []}
    record["vllm_greedy"] = [s.response_ids for s in engine.generate(
        prompts, SamplingSpec(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=(eos,)))]

    submit, collect = engine.submit, engine.collect

    def record_samples(samples):
        record["samples"].append([{"response_ids": list(s.response_ids), "finish_reason": s.finish_reason}
                                  for s in samples])

    def submit_recorded(batch, spec):
        record["stop_token_ids"].append(list(spec.stop_token_ids))
        ticket = submit(batch, spec)
        if ticket.samples is not None:  # the in-process engine generated them now: no collect() follows
            record_samples(ticket.samples)
        return ticket

    def collect_recorded(ticket):
        samples = collect(ticket)
        record_samples(samples)
        return samples

    pad_trajectory = rl_step.pad_trajectory

    def pad_recorded(*a, **kw):
        traj = pad_trajectory(*a, **kw)
        record["trajectories"].append({"response_lens": traj.response_lens.tolist(),
                                       "trained_tokens": traj.action_mask.sum(-1).long().tolist()})
        return traj

    engine.submit, engine.collect, rl_step.pad_trajectory = submit_recorded, collect_recorded, pad_recorded
    trainer.train()
    record["trainer_greedy"] = hf_greedy(unwrap(trainer.parts.actor), prompts, eos, new_tokens)
    with open(out_path, "w") as f:
        json.dump(record, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (gloo / vLLM helper threads can abort it after the work is done)


if __name__ == "__main__":
    main()
