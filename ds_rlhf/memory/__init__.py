"""The memory plan of a config before any weight loads, the GPU memory cap (`run.max_gpu_memory_gb`) and the
profiler of measured peaks per phase."""
