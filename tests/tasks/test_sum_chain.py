"""sum_chain's warm-start demonstrations: a calculator trace by default, or the bare answer."""

import pytest

from tidal.envs.calculator import calculator_trace
from tidal.tasks import TASKS
from tidal.tasks.config import TaskConfig


def _task(**params):
    return TASKS.get("sum_chain")(TaskConfig(name="sum_chain", params=params))


def test_demos_follow_task_params():
    p = _task().train_prompt(0)
    assert _task().sft_example(p) == calculator_trace(p.text.rstrip("=").split("+"))
    assert _task().sft_example(p).endswith(p.answer)
    assert _task(demos="answer").sft_example(p) == p.answer


def test_unknown_demos_name_the_key():
    task = _task(demos="scratch")  # was silently read as "tool"
    with pytest.raises(ValueError, match="task.params.demos"):
        task.sft_example(task.train_prompt(0))
