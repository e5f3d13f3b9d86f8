"""The recipes: RL (`rl.py`: the loop and the step in numbered stages, `rl_build.py`, `rl_eval.py` and the stages'
modules), SFT (`sft.py`) and RM (`rm.py`) on one supervised loop (`supervised.py`)."""
