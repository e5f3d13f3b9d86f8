"""Tools and environments for the agent tests. The tools are module-level functions of this file,
so the sandbox's process can load them by path (it imports this file in every call: standard library only here)."""

from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def hang(seconds: float = 600.0) -> str:
    """Sleep for a long time.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke up"


def boom(message: str = "tool exploded") -> str:
    """Raise an error.

    Args:
        message: the error's message
    """
    raise RuntimeError(message)


def spam(megabytes: int = 4) -> str:
    """Print megabytes of text.

    Args:
        megabytes: how many
    """
    print("x" * (megabytes << 20))
    return "printed"


def burn() -> str:
    """Spin the CPU forever."""
    while True:
        pass


def eat() -> str:
    """Allocate 4 GiB."""
    return str(len(bytearray(4 << 30)))


def dial() -> str:
    """Open a TCP connection."""
    import socket

    socket.create_connection(("127.0.0.1", 9), timeout=1)
    return "connected"


def half(prompt, response, ground_truth, metadata=None) -> float:
    """A reward function scoring every response 0.5."""
    return 0.5


TOOLS = [add, hang]
NOT_TOOLS = 3


class EchoEnv:
    """Two turns: the observation repeats the action; reward 1 at the second step, then done."""

    def reset(self, row):
        self.steps = 0
        return f"Say something about {row}."

    def step(self, action_text):
        self.steps += 1
        return f"You said: {action_text[:20]}", float(self.steps == 2), self.steps == 2


class AsyncEchoEnv(EchoEnv):
    async def reset(self, row):
        return super().reset(row)

    async def step(self, action_text):
        return super().step(action_text)


class NoStep:
    def reset(self, row):
        return ""
