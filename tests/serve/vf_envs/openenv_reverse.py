"""An OpenEnv environment for tidal's tests (OpenEnv's API only): reset with a ``word``; one step, whose
action's ``text`` earns reward 1.0 if it is the word reversed, else 0.0; then done."""

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class ReverseAction(Action):
    text: str


class ReverseObservation(Observation):
    word: str = ""


class ReverseEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.word = ""

    def reset(self, seed=None, episode_id=None, word: str = "abc", **kwargs) -> ReverseObservation:
        self.word, self._state = word, State(episode_id=episode_id, step_count=0)
        return ReverseObservation(word=word)

    def step(self, action: ReverseAction, timeout_s=None, **kwargs) -> ReverseObservation:
        self._state.step_count += 1
        return ReverseObservation(word=self.word, done=True, reward=float(action.text == self.word[::-1]))

    @property
    def state(self) -> State:
        return self._state
