"""Training: the loop run on every worker, the DeepSpeed engine, checkpoints and tracking."""
