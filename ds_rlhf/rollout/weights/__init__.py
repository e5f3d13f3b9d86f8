"""How weights move from the trainer into a rollout engine: the ZeRO gather into buckets (`gather.py`), the bucket
wire format and the standalone weight group (`group.py`), the adapter-only sync of a LoRA actor (`adapter_sync.py`),
`WeightSync` (`sync.py`), the post-sync log-prob check (`canary.py`) and the cleanup of vLLM-CPU's shared memory
(`cpu_shm.py`). How the bytes reach an engine is the engine's transport (`rollout/base.py:WeightTransport`; a
server's in `rollout/server/transports.py`)."""
