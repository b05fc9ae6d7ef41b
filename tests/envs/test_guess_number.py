"""The guess_number environment: feedback on hand-checked guess sequences, malformed guesses and the
per-turn reward decay."""

import pytest

from tidal.api import EnvStep
from tidal.envs import ENVS
from tidal.envs.guess_number import GuessNumber
from tidal.models.tiny import CHARS
from tidal.types import Prompt


def _env(secret: str = "37", **params) -> GuessNumber:
    env = ENVS.get("guess_number")(**params)
    assert env.reset(Prompt("p0", "guess:", secret)) is None
    return env


def _play(env: GuessNumber, guesses: list[str]) -> list[EnvStep]:
    return [env.step(g) for g in guesses]


def test_binary_search_to_the_secret():
    env = _env("37")
    assert env.stop == []  # a guess ends at EOS
    steps = _play(env, ["50", " 25", "37 \n"])
    assert [s.observation for s in steps] == [" lower", " higher", None]
    assert [s.done for s in steps] == [False, False, True]
    assert [s.reward for s in steps] == [0.0, 0.0, 1.0]
    assert steps[-1].info == {"correct": True}


def test_malformed_guesses():
    env = _env("-3")
    steps = _play(env, ["three", "", "3.0", "-5", "-3"])
    assert [s.observation for s in steps] == [" invalid", " invalid", " invalid", " higher", None]
    assert [s.info for s in steps] == [{"malformed": True}] * 3 + [{}, {"correct": True}]
    assert steps[-1].reward == 1.0  # no decay by default, however many turns


@pytest.mark.parametrize("decay, turns, reward", [(0.25, 1, 1.0), (0.25, 2, 0.75), (0.25, 4, 0.25), (0.5, 4, 0.0)])
def test_reward_decay_per_extra_turn(decay, turns, reward):
    env = _env("7", reward_decay=decay)
    steps = _play(env, ["x"] * (turns - 1) + ["7"])  # malformed turns count as turns
    assert steps[-1].reward == reward and steps[-1].done


def test_reset_starts_a_new_episode():
    env = _env("7", reward_decay=0.5)
    _play(env, ["1", "2"])
    env.reset(Prompt("p1", "guess:", " 10 "))
    assert env.step("9").observation == " higher"
    assert env.step("10").reward == 0.5


def test_custom_words_and_tiny_tokenizer_defaults():
    env = _env("5", higher=" up", lower=" down", invalid=" ?")
    assert [s.observation for s in _play(env, ["9", "1", "?"])] == [" down", " up", " ?"]
    default = GuessNumber()
    assert set(default.higher + default.lower + default.invalid) <= set(CHARS)


def test_bad_secret_and_parameters():
    with pytest.raises(ValueError, match="integer prompt.answer"):
        GuessNumber().reset(Prompt("p0", "guess:", "seven"))
    with pytest.raises(ValueError, match="reward_decay"):
        GuessNumber(reward_decay=-1)
