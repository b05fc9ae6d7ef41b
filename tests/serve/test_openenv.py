"""OpenEnv environments on a loopback server (``envs/openenv_server.py``), and what verifiers 0.4's OpenEnv
taskset does with them: no mocks, a real OpenEnv ``Environment`` (``vf_envs/openenv_reverse.py``) behind
OpenEnv's own app, reached by OpenEnv's own client and by tidal's verifiers bridge."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("openenv.core")
pytest.importorskip("verifiers.v1")
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]

from tidal.api import GenRequest  # noqa: E402
from tidal.envs.openenv_server import serve_openenv  # noqa: E402
from tidal.envs.verifiers_config import VerifiersConfig  # noqa: E402
from tidal.serve.config import HarnessConfig  # noqa: E402
from tidal.serve.engine import HarnessEngine  # noqa: E402
from tidal.serve.verifiers_bridge import VerifiersEpisodes  # noqa: E402
from tidal.tasks.config import TaskConfig  # noqa: E402
from tidal.tasks.verifiers_task import VerifiersTask  # noqa: E402

from ..rollout.chat_fixture import PRINTABLE_CHARS, chat_tokenizer  # noqa: E402
from .scripted_engine import ScriptedEngine  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "vf_envs"))
from openenv_reverse import ReverseAction, ReverseEnv, ReverseObservation  # noqa: E402

TOK = chat_tokenizer(chars=PRINTABLE_CHARS)


def test_loopback_server_plays_the_environment_for_openenv_client():
    from openenv import GenericEnvClient

    async def play(url, word, text):
        async with GenericEnvClient(base_url=url) as client:
            first = await client.reset(word=word)
            result = await client.step({"text": text})
            return first.observation["word"], result.reward, result.done

    with serve_openenv(ReverseEnv, ReverseAction, ReverseObservation) as url:
        assert url.startswith("http://127.0.0.1:")
        assert asyncio.run(play(url, "abc", "cba")) == ("abc", 1.0, True)
        assert asyncio.run(play(url, "abcd", "abcd")) == ("abcd", 0.0, True)


def test_verifiers_openenv_taskset_needs_a_newer_openenv_and_fails_as_infrastructure():
    """verifiers 0.4.0's ``openenv`` taskset reads ``GenericEnvClient._base_url``, which openenv-core 0.3.0's
    client does not have (verifiers asks for ``openenv>=0.4.1``, whose mcp pin conflicts with its own): every
    episode raises inside the environment, and tidal counts each as an infrastructure failure with the reason.
    When the two packages agree again this test fails, and OpenEnv training through verifiers works."""

    def reply(context):
        word = re.findall(r'\\"word\\": \\"(\w+)\\"|"word": "(\w+)"', context)
        return json.dumps({"text": "x"}) if not word else json.dumps({"text": "".join(word[-1])[::-1]})

    with serve_openenv(ReverseEnv, ReverseAction, ReverseObservation) as url:
        vcfg = VerifiersConfig(id="openenv", kwargs={"base_url": url, "resets": [{"word": "abc"}, {"word": "xyz"}]},
                               num_eval=1)
        task = VerifiersTask(TaskConfig(), vcfg)
        engine = HarnessEngine(ScriptedEngine(TOK, reply), TOK, VerifiersEpisodes(task.tasks).run_episode,
                               HarnessConfig(episode_timeout_s=60), 4096, 64)
        try:
            prompts = [task.train_prompt(0), *task.eval_prompts()]
            trajs = engine.generate([GenRequest(p, (1,), 0) for p in prompts])
        finally:
            engine.close()
    assert engine.counts["crashed"] == 2 and engine.counts["finished"] == 0
    assert all("'GenericEnvClient' object has no attribute '_base_url'" in t.episode["infra_failure"] for t in trajs)
