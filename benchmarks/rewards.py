"""Verifier throughput: verified samples per second for the ``math`` and ``code`` rewards through the
RewardPool, with 1 and 2 worker processes (the way training and ``tidal score`` run them).

Inputs are generated, seeded and realistic in shape, with known correctness (so the table also
shows that the verifier agreed with the expected verdict on every sample):

- math: a ``<think>`` paragraph, then ``\\boxed{...}``. Gold answers are integers, reduced fractions
  (the response gives an unreduced fraction or a decimal) and polynomials (the response gives the
  expanded form of ``(x+a)^2``, which needs sympy's symbolic comparison, ~10% of samples). About 70%
  are correct.
- code: a fenced Python program, either a stdin/stdout program (sum of two integers, 3 io cases) or
  a HumanEval-style function checked by ``assert`` s (Chen et al. 2021); half of each are wrong.

Pool start-up (worker spawn, importing the verifier) happens before the clock starts. A reward
that is not registered is skipped and listed under ``skipped``.

    tidal bench rewards [--set math_samples=400 --set code_samples=60 --set workers=[1,2]]
"""

# No ``from __future__ import annotations``: tidal.bench loads this file without registering it in
# sys.modules, where dataclasses and get_type_hints would look string annotations up.
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from tidal.config import apply_overrides
from tidal.rewards import REWARDS, build_reward
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.types import Prompt

DESCRIPTION = "verified samples/s for the math and code rewards through RewardPool (1 and 2 workers)"


@dataclass
class BenchConfig:
    math_samples: int = 400
    code_samples: int = 60
    workers: list[int] = field(default_factory=lambda: [1, 2])
    timeout_s: float = 10.0
    seed: int = 0


THINK = ("<think>\nLet me work through this carefully. First I restate the problem, then I simplify "
         "step by step, checking each intermediate result before moving on.\n</think>\n")


def math_items(n: int, seed: int) -> list[tuple[str, Prompt, bool]]:
    """(response, prompt, expected correct) for n generated math problems."""
    rng, items = random.Random(seed), []
    for i in range(n):
        correct = rng.random() < 0.7
        kind = rng.choices(["int", "frac", "poly"], weights=[5, 4, 1])[0]
        if kind == "int":
            gold = rng.randint(-500, 5000)
            given = str(gold if correct else gold + rng.choice([-1, 1, 10]))
            gold_text = str(gold)
        elif kind == "frac":
            b = rng.choice([2, 3, 4, 5, 7, 8, 9, 16])
            a = rng.choice([k for k in range(1, 4 * b) if _gcd(k, b) == 1])
            gold_text = f"\\frac{{{a}}}{{{b}}}"
            if not correct:
                a += 1
            k = rng.randint(2, 6)
            decimal = b in (2, 4, 5, 8, 16) and rng.random() < 0.5
            given = f"{a / b:g}" if decimal else f"\\frac{{{k * a}}}{{{k * b}}}"
        else:
            a = rng.randint(1, 9)
            gold_text = f"(x+{a})^2"
            given = f"x^2+{2 * a}x+{a * a + (0 if correct else 1)}"
        question = f"Problem {i}: compute the value and put it in \\boxed{{}}."
        items.append((f"{THINK}The answer is \\boxed{{{given}}}.", Prompt(f"m{i}", question, gold_text), correct))
    return items


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


IO_TESTS = {"kind": "io", "cases": [{"input": "1 2\n", "output": "3"}, {"input": "-5 7\n", "output": "2"},
                                    {"input": "100 250\n", "output": "350"}]}
IO_PROGRAM = "```python\na, b = map(int, input().split())\nprint(a {op} b)\n```"
HE_PROMPT = 'from typing import List\n\n\ndef running_max(xs: List[int]) -> List[int]:\n    """Prefix maxima."""\n'
HE_TESTS = {"kind": "assert", "prompt": HE_PROMPT, "entry_point": "running_max",
            "code": "def check(candidate):\n    assert candidate([]) == []\n"
                    "    assert candidate([1, 3, 2, 5, 4]) == [1, 3, 3, 5, 5]\n"
                    "    assert candidate([-2, -3]) == [-2, -2]\n"}
HE_BODY = ("```python\n    out, best = [], None\n    for x in xs:\n"
           "        best = x if best is None else {fn}(best, x)\n        out.append(best)\n    return out\n```")


def code_items(n: int, seed: int) -> list[tuple[str, Prompt, bool]]:
    """(response, prompt, expected correct): io programs and HumanEval-style functions, half wrong."""
    rng, items = random.Random(seed), []
    for i in range(n):
        correct = rng.random() < 0.5
        if i % 2 == 0:
            response, tests = IO_PROGRAM.format(op="+" if correct else "-"), IO_TESTS
        else:
            response, tests = HE_BODY.format(fn="max" if correct else "min"), HE_TESTS
        items.append((f"{THINK}{response}", Prompt(f"c{i}", "Write the program.", "", {"tests": tests}), correct))
    return items


def measure(name: str, items: list[tuple[str, Prompt, bool]], workers: int, timeout_s: float) -> dict:
    pool = RewardPool(build_reward(name), RewardConfig(name=name, num_workers=workers, timeout_s=timeout_s))
    try:
        # Start the workers and import the verifier in each (math-verify loads sympy on first use, ~1 s):
        # a worker busy importing leaves the next items to the others, so 4 per worker reach them all.
        pool.score([(r, p) for r, p, _ in items[: 4 * max(workers, 1)]])
        pool.num_errors = pool.num_timeouts = 0
        start = time.perf_counter()
        results = pool.score([(r, p) for r, p, _ in items])
        elapsed = time.perf_counter() - start
    finally:
        pool.close()
    agree = sum((reward == 1.0) == expected for (reward, _), (_, _, expected) in zip(results, items))
    return {
        "reward": name,
        "workers": workers,
        "samples": len(items),
        "samples_per_s": len(items) / elapsed,
        "ms_per_sample": 1000 * elapsed / len(items),
        "mean_reward": sum(r for r, _ in results) / len(items),
        "agrees_with_expected": agree / len(items),
        "errors": pool.num_errors,
        "timeouts": pool.num_timeouts,
    }


def run(overrides: list[str], out_dir: Path) -> dict:
    cfg = apply_overrides(BenchConfig(), overrides)
    inputs = {"math": lambda: math_items(cfg.math_samples, cfg.seed),
              "code": lambda: code_items(cfg.code_samples, cfg.seed)}
    present = [name for name in inputs if name in REWARDS]
    rows = [measure(name, inputs[name](), w, cfg.timeout_s) for name in present for w in cfg.workers]
    return {"benchmark": "rewards", "description": DESCRIPTION, "table": rows,
            "skipped": [name for name in inputs if name not in REWARDS]}
