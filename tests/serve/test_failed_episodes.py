"""An agent run whose every training episode crashes stops after ``max_failed_steps`` steps with one line and exit
1 (issue 50 item 7: a verifiers environment whose reward always raised trained nothing to "reached max_steps" and
exited 0). A crashed episode is an infrastructure failure on the harness path, as a verifiers rubric's is."""

from __future__ import annotations

import json

import pytest

from tidal.cli import main

from .test_harness_engine import two_turn_agent
from .test_harness_run import TINY

pytest.importorskip("fastapi", reason="needs the harness extra")


def crashes_in_training(client, task):
    """``two_turn_agent`` on held-out tasks; raises on every training task (``train-N``)."""
    if task.uid.startswith("train-"):
        raise ZeroDivisionError("reward bug")
    return two_turn_agent(client, task)


def test_an_async_agent_run_whose_every_training_episode_crashes_stops_with_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    sets = [*TINY, f"sft.cache_dir={tmp_path / 'cache'}", "system.mode=async", "max_steps=20",
            "harness.function=tests.serve.test_failed_episodes:crashes_in_training"]
    code = main(["train", "harness_quickstart", "--out", str(out), *(a for s in sets for a in ("--set", s))])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1, last
    assert last.startswith("error: every group of the last 3 steps failed (steps 1-3, 9 groups"), last
    assert "ZeroDivisionError: reward bug" in last and "--resume" in last, last
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval/accuracy"] >= 0 and all(r["algo/failed_groups"] == 3 for r in rows[1:])
