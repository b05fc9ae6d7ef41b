"""Training: batch building, the RL step, the supervised warm start, checkpointing."""
