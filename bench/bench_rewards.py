"""Cheap deterministic rewards for benchmarks: they vary between samples (so advantages are not all zero) and cost
next to nothing (so the benchmark measures the trainer, not the reward)."""


def distinct_ratio(prompt: str, response: str, ground_truth, metadata) -> float:
    """Share of distinct characters in the response (0 for an empty one)."""
    return len(set(response)) / len(response) if response else 0.0
