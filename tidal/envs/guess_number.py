"""``guess_number``: a multi-turn environment without tools, where the feedback is the signal.

The secret is the prompt's answer (an integer string; any task whose answers are integers will do).
Each model turn is one guess, the turn's stripped text read as an integer. A wrong guess is answered
`` higher`` (the secret is larger) or `` lower``; a right one ends the episode with reward 1, less
``reward_decay`` for each turn before it (floored at 0; the default 0 rewards any number of turns
alike). A turn that is not an integer is malformed and answered `` invalid``. The default words use
only the tiny character tokenizer's characters, so the tiny model can read its feedback.

``stop`` is empty: a guess has no closing tag, so a turn ends at EOS (or its length budget).
"""

from __future__ import annotations

from tidal.api import EnvStep
from tidal.envs import ENVS
from tidal.types import Prompt


@ENVS.register("guess_number")
class GuessNumber:
    """See the module docstring. ``higher``/``lower``/``invalid``: the observations' texts."""

    stop: list[str] = []

    def __init__(self, higher: str = " higher", lower: str = " lower", invalid: str = " invalid",
                 reward_decay: float = 0.0):
        if reward_decay < 0:
            raise ValueError(f"guess_number: reward_decay must be >= 0, got {reward_decay}")
        self.higher, self.lower, self.invalid = higher, lower, invalid
        self.reward_decay = reward_decay
        self.secret = 0
        self.turns = 0

    def reset(self, prompt: Prompt) -> str | None:
        try:
            self.secret = int(prompt.answer.strip())
        except ValueError:
            raise ValueError(f"guess_number needs an integer prompt.answer, got {prompt.answer!r}") from None
        self.turns = 0
        return None

    def step(self, turn_text: str) -> EnvStep:
        self.turns += 1
        try:
            guess = int(turn_text.strip())
        except ValueError:
            return EnvStep(self.invalid, info={"malformed": True})
        if guess == self.secret:
            reward = max(0.0, 1.0 - self.reward_decay * (self.turns - 1))
            return EnvStep(None, reward, done=True, info={"correct": True})
        return EnvStep(self.higher if guess < self.secret else self.lower)
