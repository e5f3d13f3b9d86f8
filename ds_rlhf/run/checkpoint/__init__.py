"""Run checkpoints, one owner: `manager.CheckpointManager` saves, verifies, loads and prunes them; the engines'
DeepSpeed states (`deepspeed_io`), the checkpoint's files (listing, hashing, structural checks: `files`), the RNG
states (`rng`) and the best checkpoint by one eval metric (`best`) are its parts. Import from the modules."""
