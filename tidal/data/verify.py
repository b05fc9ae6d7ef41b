"""Verifiability of RL problems: keep a problem only if its reference passes tidal's own verifier.

A math problem (``prompt`` + ``answer``) is kept when its reference answer, written as ``\\boxed{}``,
scores 1.0 under the ``math`` reward (math-verify parses it and finds it equal to itself: answers
it cannot parse would give every rollout reward 0). A code problem (``prompt`` + ``solution`` +
``tests``, tests in the ``code`` reward's format) is kept when the reference solution passes every
test in the sandbox. Anything the verifier could not score would only add zero-advantage groups.
"""

from __future__ import annotations

from tidal.data.io import Row
from tidal.data.pipeline import Block


class Verifiable(Block):
    name = "verifiable"

    def __init__(self, prompt_key: str = "prompt"):
        self.prompt_key = prompt_key
        self._math = self._code = None

    def __getstate__(self):
        return {**self.__dict__, "_math": None, "_code": None}

    def prepare(self, row: Row) -> str | None:
        from tidal.types import Prompt

        prompt = row.get(self.prompt_key)
        if not isinstance(prompt, str):
            return f"no_{self.prompt_key}"
        if "tests" in row:
            solution = row.get("solution")
            if not isinstance(solution, str):
                return "no_solution"
            if self._code is None:
                from tidal.rewards.code import CodeReward

                self._code = CodeReward()
            try:
                problem = Prompt("curate", prompt, "", {"tests": row["tests"]})
                reward, _ = self._code(f"```python\n{solution}\n```", problem)
            except Exception:  # malformed tests: the problem cannot be verified
                return "bad_tests"
            return None if reward >= 1.0 else "reference_fails_tests"
        answer = row.get("answer")
        if answer is None or not str(answer).strip():
            return "no_answer"
        if self._math is None:
            from tidal.rewards.math import MathReward

            self._math = MathReward()
        reward, _ = self._math(f"\\boxed{{{answer}}}", Prompt("curate", prompt, str(answer)))
        return None if reward >= 1.0 else "answer_does_not_verify"
