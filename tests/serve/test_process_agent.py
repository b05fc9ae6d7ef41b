"""``harness.command``: the agent as a separate program, one process per episode, through the real server.

No mocks: a real uvicorn server around a tiny model, real subprocesses using the real ``openai`` client
configured only by the standard environment variables. Checked: the episode's environment, rewards
from stdout, the failures (non-zero exit, a reward line that is not a number, a process that runs past
the timeout is killed), and a training run with the example agent as a program.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from tidal.config import ConfigError
from tidal.rollout.local import LocalEngine, SamplingConfig
from tidal.rollout.requests import group_requests
from tidal.serve.config import HarnessConfig
from tidal.serve.engine import HarnessEngine
from tidal.serve.process import process_agent
from tidal.types import Prompt

from .test_harness_engine import chat_model  # noqa: F401  (fixture)
from .test_harness_run import cfg_for, run

AGENT = r'''
import json, os, sys, time
import openai

task = json.loads(os.environ["TIDAL_TASK"])
kind = task["meta"]["kind"]
client = openai.OpenAI(max_retries=0)            # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["text"]}])
with open(os.environ["OUT"] + "/" + os.environ["TIDAL_EPISODE_ID"], "w") as f:
    json.dump({"base_url": os.environ["OPENAI_BASE_URL"], "task": task, "reply": reply.choices[0].message.content}, f)
if kind == "exit":
    sys.exit("the agent's own error")
if kind == "sleep":
    time.sleep(60)
print("some log line")
print("not a number" if kind == "word" else "0.5")
'''


def test_a_process_per_episode_with_its_environment_reward_and_failures(chat_model, tmp_path, monkeypatch):  # noqa: F811
    model, tok = chat_model
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    kinds = ["ok", "exit", "word", "sleep"]
    prompts = [Prompt(f"p{i}", f"{i}*2=", str(2 * i), meta={"kind": k}) for i, k in enumerate(kinds)]
    engine = HarnessEngine(LocalEngine(model, tok, SamplingConfig(max_new_tokens=8), seed=0), tok,
                           process_agent(f"{sys.executable} {script}", timeout_s=10.0),
                           HarnessConfig(episode_timeout_s=10.0), context_len=128, max_tokens=8)  # the sleeper's wait
    start = time.monotonic()
    try:
        trajs = engine.generate(group_requests(tok, prompts, 1))
    finally:
        engine.close()
    assert time.monotonic() - start < 40, "the sleeping process must be given up on at the timeout"
    ok, exited, word, slept = trajs
    assert not ok.infra_failed and ok.reward == 0.5 and ok.episode["turns"] == 1
    assert "exited with 1: the agent's own error" in exited.episode["infra_failure"]
    assert "last stdout line must be its reward" in word.episode["infra_failure"]
    assert slept.infra_failed
    seen = json.loads((out / ok.episode["episode_id"]).read_text())
    assert seen["base_url"].endswith(f"/episodes/{ok.episode['episode_id']}/v1")
    assert seen["task"] == {"uid": "p0", "text": "0*2=", "answer": "0", "meta": {"kind": "ok"}}
    assert seen["reply"] == ok.episode["last_answer"]


def test_bad_commands_are_config_errors():
    with pytest.raises(ConfigError, match="cannot be split"):
        process_agent("python 'unclosed", 5.0)
    with pytest.raises(ConfigError, match="no program 'no-such-agent-binary'"):
        process_agent("no-such-agent-binary --x", 5.0)


def test_the_example_agent_trains_as_a_program(tmp_path):
    """``harness.command`` with examples/calculator_agent.py run as a script (its ``__main__``). One process per
    episode (~1 s each on 2 shared cores): one prompt of 4 episodes and 2 held-out prompts keep it to ~8 processes."""
    result = run(cfg_for(tmp_path, "harness.function=null",
                         f"harness.command={sys.executable} examples/calculator_agent.py", "max_steps=1",
                         "system.mode=sync", "rollout.prompts_per_step=1", "num_eval=2"), tmp_path / "run")
    row = result.history[-1]
    assert row["harness/finished"] >= 1 * 4 and row["harness/crashed"] == 0 and row["agent/infra_failures"] == 0
