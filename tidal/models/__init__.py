"""Models: the tiny local model builder, Hugging Face loading, and log-prob computation."""
