"""tidal: asynchronous reinforcement-learning post-training for language models.

See ``DESIGN.md`` (shared) and ``README.md`` for the architecture; the data flow is
prompts -> RolloutEngine -> RewardPool -> algo (advantages, filters) -> Trainer -> new weights.
"""

__version__ = "0.1.0"
