"""A tiny episode RL run in a process of its own, as a user's run is: `python -m tests.agent.episode_run ARGS`
(from the repository root) trains `RLTrainer(parse_config(ARGS))` on the tiny HF engine whose episodes' first turn
is a teacher-forced calculator call (`test_rl_episodes.FirstTurnCalls`), so the episodes have tool turns."""

from __future__ import annotations

import sys

from transformers import AutoTokenizer

from ds_rlhf.config import parse_config
from ds_rlhf.recipes.rl import RLTrainer
from tests.agent.test_rl_episodes import make_engine


def main(argv: list[str]) -> None:
    cfg = parse_config(argv)
    RLTrainer(cfg, rollout=make_engine(cfg.model.path, AutoTokenizer.from_pretrained(cfg.model.path))).train()


if __name__ == "__main__":
    main(sys.argv[1:])
