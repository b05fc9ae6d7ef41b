"""Rewards by import path (``my_pkg.mod:fn``, ``file.py:fn``): built in the parent, imported in the pool's workers."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tidal.config import ConfigError
from tidal.rewards import build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.types import Prompt

P = Prompt("u", "What is 2+3?", "5")

REWARDS_PY = textwrap.dedent('''
    import os

    def exact(response, prompt):
        return float(response.strip() == prompt.answer), {"pid": os.getpid(), "reason": "compared"}

    def bare(response, prompt):
        return 0.5

    def bad_type(response, prompt):
        return "yes"

    class MinLength:
        def __init__(self, min_len=3):
            self.min_len = min_len

        def __call__(self, response, prompt):
            return float(len(response) >= self.min_len)

    def make(bonus=0.0):
        return lambda response, prompt: (1.0 + bonus, {})

    NOT_CALLABLE = 3
''')


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return path


def _pool_score(fn, items, workers=1):
    pool = RewardPool(fn, RewardConfig(num_workers=workers, timeout_s=30))
    try:
        return pool.score(items), pool.num_errors
    finally:
        pool.close()


def test_a_file_reward_runs_in_the_worker_processes(rewards_file):
    fn = build_reward(f"{rewards_file}:exact")
    assert fn("5", P) == (1.0, {"pid": os.getpid(), "reason": "compared"})  # inline, in this process
    out, errors = _pool_score(fn, [("5", P), ("6", P)])
    assert [r for r, _ in out] == [1.0, 0.0] and errors == 0
    assert out[0][1]["pid"] != os.getpid()  # scored in a worker, which imported the file itself


def test_a_module_reward_relative_to_the_current_directory(tmp_path, monkeypatch):
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(REWARDS_PY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    fn = build_reward("my_pkg.scoring:MinLength", {"min_len": 2})  # a class: a factory taking the params
    out, errors = _pool_score(fn, [("55", P), ("5", P)])
    assert [r for r, _ in out] == [1.0, 0.0] and errors == 0
    sys.modules.pop("my_pkg.scoring", None)
    sys.modules.pop("my_pkg", None)


def test_relative_file_paths_and_factories(rewards_file, monkeypatch):
    monkeypatch.chdir(rewards_file.parent)
    assert build_reward("my_rewards.py:bare")("x", P) == (0.5, {})  # a bare float becomes (float, {})
    assert build_reward("./my_rewards.py:make", {"bonus": 1.0})("x", P) == (2.0, {})
    assert build_reward("my_rewards.py:MinLength")("abc", P) == (1.0, {})  # a factory's defaults


def test_a_bad_return_value_is_an_error_the_pool_counts(rewards_file):
    out, errors = _pool_score(build_reward(f"{rewards_file}:bad_type"), [("5", P)], workers=0)
    assert out[0][0] == 0.0 and "expected a float or (float, dict)" in out[0][1]["error"] and errors == 1


@pytest.mark.parametrize("spec, params, message", [
    ("no_such_pkg_xyz.mod:fn", {}, "no module named 'no_such_pkg_xyz'"),
    ("missing_file.py:fn", {}, "no such file"),
    ("{file}:nope", {}, "has no attribute 'nope'"),
    ("{file}:NOT_CALLABLE", {}, "is a int, not a function or class"),
    ("{file}:exact", {"k": 1}, "takes no parameters, got ['k']"),
    ("{file}:MinLength", {"max_len": 1}, "building it with {'max_len': 1} failed"),
    ("{file}:", {}, "expected MODULE:ATTRIBUTE or FILE.py:ATTRIBUTE"),
])
def test_one_line_errors_name_what_is_missing(rewards_file, spec, params, message):
    spec = spec.replace("{file}", str(rewards_file))
    with pytest.raises(ConfigError) as e:
        build_reward(spec, params)
    assert message in str(e.value) and spec in str(e.value) and "\n" not in str(e.value)


def test_a_file_that_fails_to_import_is_one_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import no_such_dependency_abc\n")
    with pytest.raises(ConfigError, match=r"importing .*broken.py raised ModuleNotFoundError"):
        build_reward(f"{bad}:fn")


def test_composes_like_a_registered_reward(rewards_file):
    fn = build_reward("compose", {"terms": [{"reward": f"{rewards_file}:exact", "name": "mine"},
                                            {"reward": "exact_match", "weight": 2.0}]})
    out, _ = _pool_score(fn, [("5", P)])
    assert out[0][0] == 3.0 and out[0][1]["components"] == {"mine": 1.0, "exact_match": 1.0}


def test_tidal_score_takes_an_import_path(rewards_file):
    rows = '{"response": "5", "answer": "5"}\n{"response": "4", "answer": "5"}\n'
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "score", "--reward", f"{rewards_file}:exact",
                           "--workers", "1"], input=rows, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(x)["reward"] for x in proc.stdout.splitlines()] == [1.0, 0.0]
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "score", "--reward", f"{rewards_file}:nope"],
                          input=rows, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "no attribute 'nope'" in proc.stderr
