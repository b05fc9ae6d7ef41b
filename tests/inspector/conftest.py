"""Real runs of the tiny model, shared by the inspector's tests: two single-turn runs that differ in one
config key (a comparison), and one agent run whose episodes have observation tokens."""

import pytest

from tidal.system.run import train

from ..system.test_agentic_run import AGENT  # registers the test_countdown environment
from ..system.test_controller import tiny_cfg

RECORD_ALL = ("log.samples.every=1", "log.samples.groups=2", "log.samples.eval_prompts=4", "log.report=true",
              "system.mode=sync", "max_steps=3")


@pytest.fixture(scope="session")
def inspector_runs(tmp_path_factory):
    """{"a", "b", "agent"}: run directories, each written by ``train`` (samples.jsonl, inspect.html, report.html)."""
    root = tmp_path_factory.mktemp("inspector-runs")
    runs = {"a": root / "a", "b": root / "b", "agent": root / "agent"}
    train(tiny_cfg(root, *RECORD_ALL), runs["a"])
    train(tiny_cfg(root, *RECORD_ALL, "seed=1"), runs["b"])
    train(tiny_cfg(root, *RECORD_ALL, *AGENT), runs["agent"])
    return runs
