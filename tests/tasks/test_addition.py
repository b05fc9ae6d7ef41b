"""``addition`` asked in words for a chat model: ``task.template`` over ``{a}``/``{b}``, ``params.min_operand``."""

import pytest

from tidal.config import ConfigError
from tidal.tasks.arithmetic import Addition
from tidal.tasks.config import TaskConfig


def test_template_and_min_operand():
    task = Addition(TaskConfig(template="What is {a} + {b}?", params={"min_operand": 10}, num_eval=100))
    assert task.num_train + 100 == 90 * 90  # both operands two-digit
    for p in [*task.eval_prompts(), *(task.train_prompt(i) for i in range(200))]:
        a, b = (int(x) for x in p.text.removeprefix("What is ").removesuffix("?").split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and p.answer == str(a + b)  # never zero-padded
    assert not {p.text for p in task.eval_prompts()} & {task.train_prompt(i).text for i in range(task.num_train)}


def test_default_prompts_unchanged():
    task = Addition(TaskConfig(num_eval=10))
    p = task.train_prompt(0)
    assert p.text.endswith("=") and len(p.text) == 6 and len(p.answer) == 3  # "07+45=" -> "052"


def test_bad_template_and_min_operand_are_clear_errors():
    with pytest.raises(ValueError, match="min_operand"):
        Addition(TaskConfig(params={"min_operand": 200}))
    with pytest.raises(ConfigError, match="names no"):
        Addition(TaskConfig(template="What is a + b?"))
