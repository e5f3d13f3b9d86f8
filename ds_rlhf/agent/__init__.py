"""Multi-turn agentic episodes: environments and tools (`environment.py`), tool-call parsing (`tool_calls.py`), the
tool sandbox (`sandbox.py`), the chat rendering of observation turns (`rendering.py`) and the episode runner
(`episode.py`); built-in examples in `examples/`. docs/AGENTIC.md says what exists and what is not wired yet."""
