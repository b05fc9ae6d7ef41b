"""The code reward on hand-written cases: extraction, both test formats, both modes, and failures."""

import json

import pytest

from tidal.config import ConfigError
from tidal.rewards import build_reward
from tidal.rewards.code import assemble_assert_program, extract_code, normalize_output
from tidal.rewards.pool import RewardConfig, RewardPool
from tidal.rewards.sandbox import isolation_status
from tidal.types import Prompt

ISOLATED, _ = isolation_status()
FAST = {"timeout_s": 1.0, "total_timeout_s": 4.0, "memory_mb": 256, "allow_unisolated": not ISOLATED}
ADD_IO = {
    "kind": "io",
    "cases": [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "5 5\n", "output": "10"},
        {"input": "-1 1\n", "output": "0\n\n"},
        {"input": "2 2\n", "output": "4  \n"},
    ],
}
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
# Right on the first two cases only.
ADD_SOMETIMES = "a, b = map(int, input().split())\nprint(a + b if a != -1 and a != 2 else 7)\n"
SQUARE_ASSERT = {
    "kind": "assert",
    "prompt": 'from typing import List\n\n\ndef squares(xs: List[int]) -> List[int]:\n    """Square each."""\n',
    "code": "def check(candidate):\n    assert candidate([1, 2]) == [1, 4]\n    assert candidate([]) == []\n",
    "entry_point": "squares",
}


def fenced(code: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{code}```\nDone."


def score(response: str, tests, **params) -> tuple[float, dict]:
    return build_reward("code", {**FAST, **params})(response, Prompt("u", "", "", {"tests": tests}))


def test_extract_code_prefers_the_last_python_fence():
    response = "```text\nnot code\n```\n```python\nfirst\n```\n```py\nsecond\n```\n```bash\nls\n```"
    assert extract_code(response) == "second\n"
    assert extract_code("```bash\nls\n```") == "ls\n"
    assert extract_code("```bash\nls\n```", "python") is None
    assert extract_code("print(1)") == "print(1)"
    assert extract_code("print(1)", "fenced") is None
    assert extract_code("```python\nprint(1)\n```", "raw") == "```python\nprint(1)\n```"
    assert extract_code("```python\nprint(1)\nprint(2") == "print(1)\nprint(2"  # truncated response


def test_normalize_output_ignores_trailing_whitespace_only():
    assert normalize_output("1  \n2\t\n\n\n") == normalize_output("1\n2") == "1\n2"
    assert normalize_output(" 1\n2") != normalize_output("1\n2")
    assert normalize_output("1\n\n2") != normalize_output("1\n2")


def test_io_all_cases_pass():
    reward, details = score(fenced(ADD), ADD_IO)
    assert reward == 1.0 and details["passed"] == details["total"] == 4
    assert "reason" not in details and "error" not in details


def test_io_partial_pass_fraction_vs_all_pass():
    reward, details = score(fenced(ADD_SOMETIMES), ADD_IO, mode="fraction")
    assert reward == 0.5 and (details["passed"], details["total"]) == (2, 4)
    assert details["cases"][2] == {"passed": False, "reason": "wrong answer", "got": "7\n", "expected": "0\n\n"}
    reward, details = score(fenced(ADD_SOMETIMES), ADD_IO)  # all_pass stops at the first failure
    assert reward == 0.0 and details["passed"] == 2 and details["reason"] == "wrong answer"
    assert details["cases"][3]["reason"].startswith("not run")


def test_io_wrong_everywhere():
    reward, details = score(fenced("print(42)\n"), ADD_IO, mode="fraction")
    assert reward == 0.0 and details["passed"] == 0 and details["total"] == 4


def test_long_outputs_are_truncated_in_details():
    reward, details = score(fenced("print('x' * 5000)\n"), {"kind": "io", "cases": [{"input": "", "output": "y"}]})
    assert reward == 0.0 and len(details["cases"][0]["got"]) < 300 and "more chars" in details["cases"][0]["got"]


def test_assert_pass_with_body_only_completion_and_with_full_function():
    body = "    return [x * x for x in xs]\n"
    assert score(body, SQUARE_ASSERT, extract="raw")[0] == 1.0
    # A full function without the prompt's import still works: the prompt's imports are kept.
    full = "def squares(xs: List[int]) -> List[int]:\n    return [x * x for x in xs]\n"
    program = assemble_assert_program(full, SQUARE_ASSERT, "MARK")
    assert program.startswith("from typing import List\ndef squares")
    assert program.endswith("check(squares)\nprint('MARK')\n")
    assert score(fenced(full), SQUARE_ASSERT)[0] == 1.0


def test_assert_fail():
    reward, details = score(fenced("def squares(xs):\n    return xs\n"), SQUARE_ASSERT)
    assert reward == 0.0 and details["passed"] == 0 and details["total"] == 1
    assert details["reason"] == "exit code 1: AssertionError"


def test_assert_early_exit_does_not_pass():
    for exit_call in ("import os; os._exit(0)", "import sys; sys.exit(0)", "exit()"):
        completion = f"def squares(xs):\n    {exit_call}\n"
        reward, details = score(fenced(completion), SQUARE_ASSERT)
        assert reward == 0.0 and details["reason"] == "exited before the tests finished", exit_call
    reward, details = score(fenced("import os\nos._exit(0)\n"), SQUARE_ASSERT)
    assert reward == 0.0


def test_syntax_error_is_reported_without_running():
    reward, details = score(fenced("def f(:\n    pass\n"), ADD_IO, mode="fraction")
    assert reward == 0.0 and details["reason"].startswith("SyntaxError") and "line 1" in details["reason"]
    assert "cases" not in details


def test_missing_fence():
    assert score(ADD, ADD_IO)[0] == 1.0  # auto: a response without a fence is the program
    reward, details = score(ADD, ADD_IO, extract="python")
    assert reward == 0.0 and details["reason"] == "no code block (extract='python')"


def test_runtime_error():
    reward, details = score(fenced("raise ValueError('nope')\n"), ADD_IO)
    assert reward == 0.0 and details["reason"] == "exit code 1: ValueError: nope"


def test_timeout_and_total_budget():
    reward, details = score(fenced("while True: pass\n"), ADD_IO, mode="fraction", timeout_s=0.5, total_timeout_s=1.2)
    assert reward == 0.0 and details["cases"][0]["reason"].startswith("timeout")
    assert details["cases"][-1]["reason"] == "time budget exhausted"


def test_tests_as_json_string_and_cli_style_rows():
    """`tidal score` puts every row field into prompt.meta: {"response": ..., "tests": {...}}."""
    assert score(fenced(ADD), json.dumps(ADD_IO))[0] == 1.0
    prompt = Prompt("row-0", "", "", {"response": fenced(ADD), "tests": ADD_IO})
    assert build_reward("code", FAST)(prompt.meta["response"], prompt)[0] == 1.0


@pytest.mark.parametrize(
    "tests, message",
    [
        (None, r'prompt.meta\["tests"\] is missing'),
        ("{not json", "not JSON"),
        ([1], "must be a dict"),
        ({"kind": "unit"}, r"\['kind'\] must be 'io' or 'assert'"),
        ({"kind": "io"}, r"\['cases'\] must be a list \(got missing\)"),
        ({"kind": "io", "cases": []}, "is empty"),
        ({"kind": "io", "cases": [{"input": "1"}]}, r"\['cases'\]\[0\]\['output'\] must be a str"),
        ({"kind": "assert", "code": "", "entry_point": "not valid"}, "identifier"),
        ({"kind": "assert", "entry_point": "f"}, r"\['code'\] must be a str"),
    ],
)
def test_malformed_tests_raise_naming_the_field(tests, message):
    with pytest.raises(ValueError, match=message):
        score(ADD, tests)


def test_bad_params_are_config_errors():
    with pytest.raises(ConfigError, match="mode"):
        build_reward("code", {"mode": "most"})
    with pytest.raises(ConfigError, match="extract"):
        build_reward("code", {"extract": "xml"})
    with pytest.raises(ConfigError, match="timeout_s"):
        build_reward("code", {"timeout_s": 20, "total_timeout_s": 8})
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) \['timeout'\]; valid: mode, .*timeout_s"):
        build_reward("code", {"timeout": 3})


def test_pool_records_malformed_tests_and_hostile_programs_as_zero():
    fn = build_reward("code", FAST)
    pool = RewardPool(fn, RewardConfig(name="code", num_workers=1, timeout_s=10))
    try:
        out = pool.score(
            [
                (fenced(ADD), Prompt("a", "", "", {"tests": ADD_IO})),
                (fenced(ADD), Prompt("b", "", "", {})),
                (fenced("import os\nwhile True:\n    os.fork()\n"), Prompt("c", "", "", {"tests": ADD_IO})),
            ]
        )
    finally:
        pool.close()
    assert [r for r, _ in out] == [1.0, 0.0, 0.0]
    assert 'prompt.meta["tests"] is missing' in out[1][1]["error"]
    assert "error" not in out[2][1] and out[2][1]["passed"] == 0
