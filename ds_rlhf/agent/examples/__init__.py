"""Built-in agent examples: a calculator tool (`calculator.py`) and a Python tool run in the sandbox
(`python_sandbox.py`). Load them like user files: `ds_rlhf/agent/examples/calculator.py:CalculatorEnv`."""
