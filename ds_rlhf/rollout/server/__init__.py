"""Rollout servers: the vLLM engine in a process of its own (sidecar on the trainer's GPU, or disaggregated on other
devices), its client, the process that hosts it, and the fan-out over several of them."""
