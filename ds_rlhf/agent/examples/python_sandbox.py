"""A Python tool: the model's code runs in a `Sandbox` process (CPU, memory, wall-time and output limits, a minimal
environment, the network cut; see `ds_rlhf/agent/sandbox.py` for exactly what is enforced) and its printed output
is the observation. `PythonEnv` is a `ToolEnvironment` over it (no reward function: a turn without a call ends the
episode with reward 0; subclass it with a `reward_fn` for a task)."""

from __future__ import annotations

from ds_rlhf.agent.environment import ToolEnvironment
from ds_rlhf.agent.sandbox import Sandbox

SANDBOX = Sandbox(timeout_s=10.0, cpu_seconds=5, memory_mb=1024, max_output_bytes=4096)


def python(code: str) -> str:
    """Run Python code and return what it prints (stdout and stderr).

    Args:
        code: the Python source to run; print what you want to see
    """
    return SANDBOX.run_code(code).observation("python")


TOOLS = [python]


class PythonEnv(ToolEnvironment):
    def __init__(self) -> None:
        super().__init__(TOOLS)
